"""Wan2.2 VAE decode on one GPU, side by side: our kernel path, our reference (bf16), diffusers (bf16, fp32).

Usage: python3 scripts/bench_decode.py [--latent-shape 1,48,31,44,78] [--accuracy-frames 5] [--repeats 3]
       [--chunk-latent-frames 4] [--kernel-variants 4:2] [--skip-diffusers] [--skip-reference] [--profile]
       [--conv-layers] [--memory-trace] [--out results.json]

Random weights (γ and biases perturbed, `pan2cli.testing.random_weights`) and random latents. Timing: median
decode seconds over `--repeats` runs after one warm-up (model loading timed separately), CUDA-synchronised;
peak memory is `max_memory_allocated` during the decode, weights included (reserved reported too).
Accuracy: every path decodes a shorter latent (`--accuracy-frames` latent frames, same H and W) and is
compared, as uint8 frames, with our reference decode in fp32 with TF32 off: PSNR (dB, on [0, 255]) and
SSIM (mean over frames and colours, 11x11 Gaussian window). TFLOP/s use the reference algorithm's count
(1.961 PFLOP for [1,48,31,44,78]: 20.06 TFLOP for the first latent frame, 64.69 for each later one, scaled
by H·W). Prints a markdown table last.

`--memory-trace` adds, for each kernel variant, which tensors are alive at the decode's memory peak: the
caching allocator's history of one decode is replayed to the moment of the largest allocated total, and the
live blocks are listed, largest first, by the innermost pan2cli line that allocated them. The peak does not
grow with the length: a short `--latent-shape 1,48,9,44,78` with `--skip-diffusers --skip-reference` is enough.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from pan2cli.config import DEFAULT_CHUNK_LATENT_FRAMES
from pan2cli.frames import frames_to_uint8, psnr
from pan2cli.testing.random_weights import decoder_from_state, random_vae_state_dict
from pan2cli.vae.config import WanVAEConfig
from pan2cli.vae.model import WanVAEDecoder

_TFLOP_FIRST, _TFLOP_LATER = 20.06, 64.69  # at 44x78 latent pixels (wan22_vae.md §8.1)


def decode_tflop(shape) -> float:
    _, _, t, h, w = shape
    return (_TFLOP_FIRST + (t - 1) * _TFLOP_LATER) * (h * w) / (44 * 78)


def reference_decoder(state, dtype) -> WanVAEDecoder:
    return decoder_from_state(state, dtype=dtype, device="cuda")


def diffusers_decoder(state, dtype):
    from diffusers import AutoencoderKLWan

    config = {k: v for k, v in WanVAEConfig().to_diffusers_config().items() if not k.startswith("_")}
    with torch.device("meta"):
        model = AutoencoderKLWan(**config)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return model.to("cuda").eval()


# -- the decode paths: each returns a function z -> iterator of uint8 (f, H, W, 3) chunks -------------
def ours(decoder, chunk_latent_frames: int = DEFAULT_CHUNK_LATENT_FRAMES):
    def run(z):
        if hasattr(decoder, "decode_uint8_chunks"):
            for frames in decoder.decode_uint8_chunks(z, chunk_latent_frames):
                yield frames[0]
        else:
            for video in decoder.decode_chunks(z, chunk_latent_frames):
                yield frames_to_uint8(video[0])

    return run


def diffusers_path(model):
    def run(z):
        with torch.no_grad():
            video = model.decode(z.to(model.dtype)).sample
        yield frames_to_uint8(video[0])

    return run


def time_decode(run, z, repeats: int) -> tuple[list[float], int, int]:
    for _ in run(z):  # warm-up (cuDNN algorithm choice, kernel build/load)
        pass
    torch.cuda.synchronize()
    seconds = []
    torch.cuda.reset_peak_memory_stats()
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in run(z):
            pass
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return seconds, torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def frames_of(run, z) -> torch.Tensor:
    return torch.cat([chunk for chunk in run(z)])  # (F, H, W, 3) uint8


def ssim(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean SSIM of uint8 (F, H, W, 3) videos, per colour channel, 11x11 Gaussian (σ 1.5)."""
    coords = torch.arange(11, device=a.device, dtype=torch.float32) - 5
    g = torch.exp(-(coords**2) / (2 * 1.5**2))
    g = (g / g.sum())[:, None] * (g / g.sum())[None, :]
    window = g.expand(3, 1, 11, 11).contiguous()
    c1, c2 = (0.01 * 255) ** 2, (0.03 * 255) ** 2
    values = []
    for i in range(a.shape[0]):
        x = a[i].permute(2, 0, 1)[None].float()
        y = b[i].permute(2, 0, 1)[None].float()
        mu_x, mu_y = F.conv2d(x, window, groups=3), F.conv2d(y, window, groups=3)
        sxx = F.conv2d(x * x, window, groups=3) - mu_x**2
        syy = F.conv2d(y * y, window, groups=3) - mu_y**2
        sxy = F.conv2d(x * y, window, groups=3) - mu_x * mu_y
        s = ((2 * mu_x * mu_y + c1) * (2 * sxy + c2)) / ((mu_x**2 + mu_y**2 + c1) * (sxx + syy + c2))
        values.append(s.mean().item())
    return sum(values) / len(values)


class _CountingOps:
    """The extension's ops, counting the bytes each kernel must move (each input read once, each output written once)."""

    def __init__(self, ops):
        self.ops = ops
        self.bytes = {"rms_norm": 0, "phase_interleave": 0, "head_to_uint8": 0}
        self.flop = 0.0  # of the CUTLASS convs

    def rms_norm_silu(self, x, gamma, bias, residual, sum_out, out, silu, history, normalize):
        tensors = 2 + (residual is not None) + (sum_out is not None)
        self.bytes["rms_norm"] += x.numel() * 2 * tensors + (
            history.numel() * 2 if history is not None else 0
        )
        return self.ops.rms_norm_silu(x, gamma, bias, residual, sum_out, out, silu, history, normalize)

    def phase_interleave(self, phases, bias, shortcut, out, factor_t, frame_offset):
        self.bytes["phase_interleave"] += (
            phases.numel() + out.numel() + (shortcut.numel() if shortcut is not None else 0)
        ) * 2
        return self.ops.phase_interleave(phases, bias, shortcut, out, factor_t, frame_offset)

    def head_to_uint8(self, current, previous, before, bias, out):
        partials = [t for t in (current, previous, before) if t is not None]
        self.bytes["head_to_uint8"] += (
            sum(t.numel() for t in partials) // 3 * 4 + out.numel()
        )  # 12 of 36 each
        return self.ops.head_to_uint8(current, previous, before, bias, out)

    def conv_cutlass(self, x, weight, bias, out, pad_w, config):
        self.flop += 2.0 * out.numel() * weight[0].numel()
        return self.ops.conv_cutlass(x, weight, bias, out, pad_w, config)

    def __getattr__(self, name):  # everything else (cutlass_conv_configs) is the extension's
        return getattr(self.ops, name)


def profile_kernel_path(run, z, kernel=None) -> list[tuple[str, float]]:
    """CUDA time of one decode by kernel group (seconds), largest first; with `kernel`, also the
    bandwidth the fused kernels reach (bytes they must move over their time)."""
    from torch.profiler import ProfilerActivity, profile

    counting = None
    if kernel is not None:
        counting = _CountingOps(kernel.ops)
        kernel.ops = counting
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in run(z):
            pass
        torch.cuda.synchronize()
    if counting is not None:
        kernel.ops = counting.ops
    groups: dict[str, float] = {}
    kernel_seconds: dict[str, float] = {}
    for event in prof.key_averages():
        name = event.key.lower()
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if "implicit_gemm_conv" in name:
            group = "fixed-order convs (Triton: conv_in, post_quant_conv, conv_out's time partials)"
        elif "convuniversal" in name or "persistent_conv" in name:
            group = "fixed-order convs (CUTLASS)"
        elif any(s in name for s in ("conv", "xmma", "cutlass", "implicit", "gemm", "sm90", "cudnn", "nhwc")):
            group = "convolutions / GEMMs (cuDNN, cuBLAS)"
        elif "rms_norm" in name:
            group = "fused RMS norm + SiLU (+ bias, residual)"
        elif "phase_interleave" in name:
            group = "resampler phase interleave"
        elif "head_to_uint8" in name:
            group = "head: unpatchify + uint8"
        elif "copy" in name or "memcpy" in name or "memset" in name or "fill" in name:
            group = "copies / fills (history, depth-to-time)"
        elif "attention" in name or "softmax" in name or "fmha" in name or "flash" in name:
            group = "attention"
        else:
            group = "other elementwise"
        groups[group] = groups.get(group, 0.0) + total / 1e6
        if counting is not None:
            for op, moved in counting.bytes.items():
                if op in name:
                    kernel_seconds[op] = kernel_seconds.get(op, 0.0) + total / 1e6
    rows = sorted(groups.items(), key=lambda kv: -kv[1])
    cutlass_seconds = groups.get("fixed-order convs (CUTLASS)")
    if counting is not None and cutlass_seconds:
        rows.append(
            (
                f"  CUTLASS convs: {counting.flop / 1e12:.0f} TFLOP at {counting.flop / cutlass_seconds / 1e12:.0f} TFLOP/s",
                0.0,
            )
        )
    if counting is not None:
        for op, moved in counting.bytes.items():
            if kernel_seconds.get(op):
                rows.append(
                    (f"  {op}: {moved / 1e9:.1f} GB moved, {moved / kernel_seconds[op] / 1e12:.2f} TB/s", 0.0)
                )
    return rows


def _allocation_site(frames) -> str:
    for frame in frames:
        if "pan2cli" in frame["filename"]:
            return f"{frame['filename'].split('pan2cli/')[-1]}:{frame['line']} {frame['name']}"
    return frames[0]["name"] if frames else "?"


def memory_trace(run, z, top: int = 25) -> dict:
    """Live blocks at the peak of one decode (after a warm-up), grouped by allocation site, largest first."""
    for _ in run(z):  # warm-up
        pass
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    for _ in run(z):
        pass
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)

    # Blocks alive before recording started (weights, histories) are in the segments but not the trace.
    live = {}
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            if block["state"] == "active_allocated":
                live[block["address"]] = (block["size"], _allocation_site(block.get("frames", [])))
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    # Walk back from the end state to the state before the trace, then forward to the peak.
    for event in reversed(trace):
        if event["action"] == "alloc":
            live.pop(event["addr"], None)
        elif event["action"] == "free_completed":
            live[event["addr"]] = (event["size"], _allocation_site(event["frames"]))
    start = dict(live)
    total = sum(size for size, _ in live.values())
    peak, peak_live = total, dict(live)
    for event in trace:
        if event["action"] == "alloc":
            live[event["addr"]] = (event["size"], _allocation_site(event["frames"]))
            total += event["size"]
            if total > peak:
                peak, peak_live = total, dict(live)
        elif event["action"] == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])[0]
    by_site: dict[str, list[int]] = {}
    for address, (size, where) in peak_live.items():
        by_site.setdefault(("(before the decode) " if address in start else "") + where, []).append(size)
    sites = sorted(by_site.items(), key=lambda kv: -sum(kv[1]))[:top]
    return {
        "max_memory_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "replayed_peak_gib": peak / 2**30,
        "alive_before_the_decode_gib": sum(size for size, _ in start.values()) / 2**30,
        "at_the_peak": [
            {"gib": sum(sizes) / 2**30, "blocks": len(sizes), "site": where} for where, sizes in sites
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--latent-shape", default="1,48,31,44,78")
    parser.add_argument("--accuracy-frames", type=int, default=5, help="latent frames of the accuracy decode")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--chunk-latent-frames", type=int, default=4)
    parser.add_argument(
        "--kernel-variants",
        default="4:2",
        help="comma-separated CHUNK:TAIL[:bench][:det][:triton][:cudnn][:cfg=NAME] of the kernel path (latent "
        "frames per chunk : video frames per pass through the high-resolution stages [: torch.backends.cudnn.benchmark] "
        "[: cudnn.deterministic] [: no CUTLASS conv: the Triton conv at low resolution, cuDNN above] [: cuDNN for "
        "every conv] [: one CUTLASS tile configuration for every layer]); one row each",
    )
    parser.add_argument("--skip-diffusers", action="store_true", help="only our two paths")
    parser.add_argument("--skip-reference", action="store_true", help="no timing of our bf16 reference")
    parser.add_argument("--profile", action="store_true", help="CUDA time of the kernel path by kernel group")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument(
        "--conv-layers",
        action="store_true",
        help="first, per conv layer: our CUTLASS conv against cuDNN (and Triton) on the same shapes, in TFLOP/s "
        "(`scripts/bench_kernels.py conv`'s table)",
    )
    parser.add_argument(
        "--memory-trace",
        action="store_true",
        help="for each kernel variant, the tensors alive at the decode's memory peak, by allocation site",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode.py needs a CUDA GPU")

    from pan2cli.vae.kernel.build import load_kernel
    from pan2cli.vae.kernel.decoder import WanKernelDecoder

    shape = tuple(int(v) for v in args.latent_shape.split(","))
    acc_shape = (*shape[:2], args.accuracy_frames, *shape[3:])
    generator = torch.Generator().manual_seed(7)
    z = torch.randn(shape, generator=generator).cuda()
    z_acc = torch.randn(acc_shape, generator=generator).cuda()
    state = random_vae_state_dict(WanVAEConfig(), seed=11)
    results: dict = {
        "shape": shape,
        "accuracy_shape": acc_shape,
        "gpu": torch.cuda.get_device_name(),
        "paths": {},
    }

    start = time.perf_counter()
    load_kernel()
    results["kernel_load_seconds"] = time.perf_counter() - start
    print(f"kernel build/load: {results['kernel_load_seconds']:.1f} s", flush=True)
    if args.conv_layers:
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from scripts.kernels.conv import layer_tables

        layer_tables(repeats=10, engines="cudnn,cutlass,triton")

    # fp32 reference, TF32 off (our reference switches it off itself in fp32)
    ref32 = reference_decoder(state, torch.float32)
    torch.backends.cudnn.allow_tf32 = False
    truth = frames_of(ours(ref32), z_acc).cpu()  # host side: not part of any path's peak
    torch.backends.cudnn.allow_tf32 = True
    del ref32
    torch.cuda.empty_cache()

    def measure(name: str, build, timed: bool = True):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        run, keep = build()
        torch.cuda.synchronize()
        load = time.perf_counter() - start
        weights = torch.cuda.memory_allocated()
        got, expected = frames_of(run, z_acc), truth.cuda()
        row = {
            "load_s": load,
            "weights_gib": weights / 2**30,
            "psnr_db": psnr(got, expected),
            "ssim": ssim(got, expected),
        }
        del (
            got,
            expected,
        )  # the timed decodes' peak counts the weights and the latents, not the accuracy check's frames
        if timed:
            seconds, peak, reserved = time_decode(run, z, args.repeats)
            row.update(
                seconds=seconds,
                median_s=statistics.median(seconds),
                peak_gib=peak / 2**30,
                reserved_gib=reserved / 2**30,
                tflops=decode_tflop(shape) / statistics.median(seconds),
            )
        results["paths"][name] = row
        print(name, json.dumps(row), flush=True)
        return run, keep

    def build_kernel(chunk: int, tail: int, fixed_order: bool, cutlass: bool, config: str | None):
        ref = reference_decoder(state, torch.bfloat16)
        kernel = WanKernelDecoder(
            ref,
            load_kernel(),
            tail_frames=tail,
            fixed_order_convs=fixed_order,
            cutlass_convs=None if cutlass else False,
            cutlass_config=config,
        )
        return ours(kernel, chunk), kernel

    def build_reference():
        ref = reference_decoder(state, torch.bfloat16)
        return ours(ref, args.chunk_latent_frames), ref

    for variant in args.kernel_variants.split(","):
        parts = variant.split(":")
        chunk, tail = int(parts[0]), int(parts[1])
        autotune = "bench" in parts[2:]
        deterministic = "det" in parts[2:]
        fixed_order = "cudnn" not in parts[2:]
        cutlass = fixed_order and "triton" not in parts[2:]
        config = next((p.removeprefix("cfg=") for p in parts[2:] if p.startswith("cfg=")), None)
        torch.backends.cudnn.benchmark = autotune
        torch.backends.cudnn.deterministic = deterministic
        flags = (", cudnn.benchmark" if autotune else "") + (", cudnn.deterministic" if deterministic else "")
        flags += "" if fixed_order else ", cuDNN for every conv"
        flags += "" if cutlass or not fixed_order else ", no CUTLASS: Triton + cuDNN convs"
        flags += f", CUTLASS {config} everywhere" if config else ""
        name = f"pan2cli kernel (bf16, chunk {chunk}, tail {tail}{flags})"
        kernel_run, kernel = measure(name, lambda: build_kernel(chunk, tail, fixed_order, cutlass, config))
        if args.profile:
            results.setdefault("profile", {})[name] = profile = profile_kernel_path(kernel_run, z, kernel)
            for group, seconds in profile:
                print(f"  {group:<45} {seconds:7.3f} s", flush=True)
        if args.memory_trace:
            results.setdefault("memory_trace", {})[name] = trace = memory_trace(kernel_run, z)
            print(
                f"  memory: max allocated {trace['max_memory_allocated_gib']:.2f} GiB, replayed peak "
                f"{trace['replayed_peak_gib']:.2f} GiB, alive before the decode {trace['alive_before_the_decode_gib']:.2f} GiB",
                flush=True,
            )
            for site in trace["at_the_peak"]:
                print(f"  {site['gib']:6.3f} GiB in {site['blocks']:4d} blocks  {site['site']}", flush=True)
        del kernel_run, kernel
        torch.backends.cudnn.benchmark = torch.backends.cudnn.deterministic = False
    if not args.skip_reference:
        measure("pan2cli reference (bf16)", build_reference)
    if not args.skip_diffusers:
        for name, dtype in (
            ("diffusers 0.42.1 (bf16)", torch.bfloat16),
            ("diffusers 0.42.1 (fp32, TF32 convs)", torch.float32),
        ):
            measure(name, lambda dtype=dtype: (diffusers_path(m := diffusers_decoder(state, dtype)), m))

    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    base = results["paths"].get("diffusers 0.42.1 (bf16)", {}).get("median_s")
    print(
        f"\nlatent {list(shape)} on {results['gpu']}; accuracy on {list(acc_shape)} vs our fp32 reference (TF32 off)"
    )
    print(
        "| path | median s | runs | peak GiB (reserved) | weights GiB | TFLOP/s | PSNR dB | SSIM | vs diffusers bf16 |"
    )
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, row in results["paths"].items():
        speedup = f"{base / row['median_s']:.2f}x" if base and "median_s" in row else "—"
        runs = ", ".join(f"{s:.2f}" for s in row.get("seconds", []))
        print(
            f"| {name} | {row.get('median_s', float('nan')):.3f} | {runs} | {row.get('peak_gib', float('nan')):.2f} "
            f"({row.get('reserved_gib', float('nan')):.2f}) | {row['weights_gib']:.2f} | {row.get('tflops', float('nan')):.0f} | "
            f"{row['psnr_db']:.2f} | {row['ssim']:.5f} | {speedup} |"
        )


if __name__ == "__main__":
    main()
