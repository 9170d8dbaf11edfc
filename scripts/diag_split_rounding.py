"""Where does a row split change the bf16 rounding? And where is the kernel path's memory peak?

Usage: python scripts/diag_split_rounding.py [--latent-shape 1,48,9,44,78] [--tail-frames 2] [--out diag.json]

Decodes once with the kernel path on one GPU (full-size random weights) while a probe wraps every
convolution and linear layer of `pan2cli.vae.kernel.decoder`:

* exactness: each op is also run on the top and the bottom half of its rows, as the two ranks of a
  2-GPU split would run it (dense band with its halo rows), and compared bit for bit with the matching
  rows of the whole-frame result. An op whose bands differ is one whose library kernel depends on the
  problem's height (another algorithm or reduction order); those are the ops that make split frames
  differ from one GPU's in bf16.
* memory: a second decode records `max_memory_allocated` between consecutive convolutions, named by
  the conv, so the stage that sets the peak is known.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict

import torch
import torch.nn.functional as F

from pan2cli.testing.random_weights import random_decoder
from pan2cli.vae.config import WanVAEConfig
from pan2cli.vae.kernel import decoder as kernel_decoder
from pan2cli.vae.kernel.build import load_kernel

_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


class _Probe:
    """Stands in for `torch.nn.functional` in `pan2cli.vae.kernel.decoder`; forwards what it does not wrap."""

    def __init__(self, compare: bool):
        self.compare = compare
        self.stage = "?"
        self.exactness: dict[str, dict] = {}
        self.memory: list[tuple[str, float]] = []
        self.timings: list[tuple[str, float, torch.cuda.Event, torch.cuda.Event]] = []
        self.workspace: dict[str, float] = {}

    def __getattr__(self, name):
        return getattr(F, name)

    # -- helpers ------------------------------------------------------------------------------
    def _record(self, op: str, shape, out_rows: torch.Tensor, band: torch.Tensor) -> None:
        key = f"{op} {self.stage} {tuple(shape)}"
        entry = self.exactness.setdefault(key, {"calls": 0, "differing": 0, "values": 0, "max_abs": 0.0})
        diff = (out_rows.float() - band.float()).abs()
        entry["calls"] += 1
        entry["differing"] += int((diff > 0).sum())
        entry["values"] += diff.numel()
        entry["max_abs"] = max(entry["max_abs"], float(diff.max()))

    def _mark_memory(self) -> None:
        # Allocator statistics are host-side: no synchronisation needed.
        self.memory.append((self.stage, torch.cuda.max_memory_allocated() / 2**30))
        torch.cuda.reset_peak_memory_stats()

    def _timed(self, fn, flop: float):
        start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        start.record()
        out = fn()
        end.record()
        self.timings.append((self.stage, flop, start, end))
        return out

    @staticmethod
    def _dense(t: torch.Tensor) -> torch.Tensor:
        return t.contiguous(memory_format=_CHANNELS_LAST[t.dim()])

    def _bands(
        self, op: str, fn, inp: torch.Tensor, out: torch.Tensor, halo: int, row_dim: int, dense=None
    ) -> None:
        """Run `fn` on the top and bottom half of the rows (with `halo` extra input rows each side).

        Each band is first copied to a dense tensor (`dense`, default: channels-last), as a rank holds it.
        """
        dense = dense or self._dense
        rows_out = out.shape[row_dim]
        rows_in = inp.shape[row_dim]
        interior = rows_in - 2 * halo
        half = interior // 2
        top_in = inp.narrow(row_dim, 0, half + 2 * halo)
        bottom_in = inp.narrow(row_dim, half, rows_in - half)
        top = fn(dense(top_in))
        bottom = fn(dense(bottom_in))
        self._record(op, inp.shape, out.narrow(row_dim, 0, top.shape[row_dim]), top)
        self._record(
            op,
            inp.shape,
            out.narrow(row_dim, rows_out - bottom.shape[row_dim], bottom.shape[row_dim]),
            bottom,
        )

    def _conv(self, conv, inp, weight, bias, stride, padding):
        if self.compare:
            return conv(inp, weight, bias, stride, padding)
        # The interval before the conv, then the conv alone: its workspace is what it holds beyond its output.
        self.memory.append((self.stage, torch.cuda.max_memory_allocated() / 2**30))
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        out = self._timed(lambda: conv(inp, weight, bias, stride, padding), 0.0)
        workspace = torch.cuda.max_memory_allocated() - before - out.numel() * out.element_size()
        self.workspace[self.stage] = max(self.workspace.get(self.stage, 0), workspace / 2**30)
        stage, _, start, end = self.timings[-1]
        self.timings[-1] = (stage, 2.0 * out.numel() * weight[0].numel(), start, end)
        return out

    # -- wrapped ops --------------------------------------------------------------------------
    def conv3d(self, inp, weight, bias=None, stride=1, padding=0):
        out = self._conv(F.conv3d, inp, weight, bias, stride, padding)
        if self.compare:
            halo = (weight.shape[3] - 1) // 2  # 3x3 convs read explicit halo rows
            self._bands("conv3d", lambda x: F.conv3d(x, weight, bias, stride, padding), inp, out, halo, 3)
            if inp.shape[2] > weight.shape[2]:  # several output frames: is frame 0 the same computed alone?
                alone = F.conv3d(self._dense(inp[:, :, : weight.shape[2]]), weight, bias, stride, padding)
                self._record("conv3d one-frame", inp.shape, out[:, :, :1], alone)
        else:
            self._mark_memory()
        return out

    def conv2d(self, inp, weight, bias=None, stride=1, padding=0):
        out = self._conv(F.conv2d, inp, weight, bias, stride, padding)
        if self.compare:
            # 2x2 phase convs on frames with one halo row above and below: h + 1 output rows.
            self._bands("conv2d", lambda x: F.conv2d(x, weight, bias, stride, padding), inp, out, 1, 2)
        else:
            self._mark_memory()
        return out

    def linear(self, inp, weight, bias=None):
        out = F.linear(inp, weight, bias)
        if self.compare and inp.dim() == 5:  # (B, T, H, W, C): post_quant_conv and 1x1 shortcuts
            contiguous = torch.Tensor.contiguous  # (B, T, H, W, C) rows, as the decoder holds them
            self._bands("linear", lambda x: F.linear(x, weight, bias), inp, out, 0, 2, contiguous)
            # The same 1x1 layer as a cuDNN conv, whose 3x3 siblings are height-invariant at these sizes.
            w5 = weight[:, :, None, None, None].contiguous(memory_format=torch.channels_last_3d)

            def as_conv(x):
                return F.conv3d(x.permute(0, 4, 1, 2, 3), w5, bias).permute(0, 2, 3, 4, 1)

            whole = as_conv(inp)
            self._bands("linear as 1x1 conv", as_conv, inp, whole, 0, 2, contiguous)
            self._record("linear as 1x1 conv vs linear", inp.shape, out, whole)
        return out


def _staged(method_name: str, probe: _Probe, stage_of):
    original = getattr(kernel_decoder.WanKernelDecoder, method_name)

    def wrapped(self, *args, **kwargs):
        previous = probe.stage
        probe.stage = stage_of(args)
        try:
            return original(self, *args, **kwargs)
        finally:
            probe.stage = previous

    setattr(kernel_decoder.WanKernelDecoder, method_name, wrapped)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--latent-shape", default="1,48,9,44,78")
    parser.add_argument("--chunk-latent-frames", type=int, default=4)
    parser.add_argument("--tail-frames", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument(
        "--deterministic", action="store_true", help="torch.backends.cudnn.deterministic = True"
    )
    parser.add_argument(
        "--fp32-gemm-reductions",
        action="store_true",
        help="torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False",
    )
    parser.add_argument("--skip-memory", action="store_true", help="only the exactness pass")
    args = parser.parse_args()
    torch.backends.cudnn.deterministic = args.deterministic
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = not args.fp32_gemm_reductions
    shape = tuple(int(v) for v in args.latent_shape.split(","))

    kwargs = {} if args.tail_frames is None else {"tail_frames": args.tail_frames}
    decoder = kernel_decoder.WanKernelDecoder(random_decoder(WanVAEConfig()), load_kernel(), **kwargs)
    torch.cuda.empty_cache()
    z = torch.randn(shape, generator=torch.Generator().manual_seed(1))

    for _ in decoder.decode_uint8_chunks(z, args.chunk_latent_frames):  # warm-up: cuDNN plans, allocator
        pass
    probe = _Probe(compare=False)
    for method in ("_norm_conv", "_upsample", "_buffer"):
        _staged(method, probe, lambda a: a[0])  # the first argument of each is the conv's name
    results = {}
    for compare in (True,) if args.skip_memory else (False, True):
        probe.compare, probe.exactness, probe.memory = compare, {}, []
        kernel_decoder.F = probe
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        frames = 0
        for chunk in decoder.decode_uint8_chunks(z, args.chunk_latent_frames):
            frames += chunk.shape[1]
        kernel_decoder.F = F
        if compare:
            differing = {k: v for k, v in probe.exactness.items() if v["differing"]}
            results["exactness"] = probe.exactness
            print(
                f"{len(probe.exactness)} op shapes compared, {len(differing)} differ between bands and whole frames:"
            )
            for key, v in sorted(probe.exactness.items()):
                frac = v["differing"] / max(1, v["values"])
                print(
                    f"  {'DIFF' if v['differing'] else 'same'} {key}: {frac:.4%} of values, max |diff| {v['max_abs']:.3g}"
                )
        else:
            peaks = defaultdict(float)
            for stage, gib in probe.memory:
                peaks[stage] = max(peaks[stage], gib)
            results["memory_peaks_gib"] = dict(peaks)
            torch.cuda.synchronize()
            by_stage = defaultdict(lambda: [0.0, 0.0, 0])
            for stage, flop, start, end in probe.timings:
                entry = by_stage[stage]
                entry[0] += start.elapsed_time(end) / 1e3
                entry[1] += flop
                entry[2] += 1
            total = sum(v[0] for v in by_stage.values())
            results["conv_seconds"] = {k: v[0] for k, v in by_stage.items()}
            print(f"convolutions: {total:.3f} s in {sum(v[2] for v in by_stage.values())} calls; by conv:")
            for stage, (seconds, flop, calls) in sorted(by_stage.items(), key=lambda kv: -kv[1][0]):
                print(
                    f"  {seconds * 1e3:8.2f} ms {calls:4d} calls {flop / seconds / 1e12 if seconds else 0:6.0f} TFLOP/s  {stage}"
                )
            print(f"memory: {frames} frames; peak between convs, by the conv that ends the interval (GiB):")
            for stage, gib in sorted(peaks.items(), key=lambda kv: -kv[1])[:15]:
                print(f"  {gib:6.2f}  {stage}   (conv workspace {probe.workspace.get(stage, 0):.2f} GiB)")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
