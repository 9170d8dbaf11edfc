"""Benchmark the fused DiT ops (Q/K RMSNorm + RoPE, LayerNorm + modulation) and one MMDiT block on one GPU.

Per op, bf16 at the released PAN 2 shapes (hidden 4096 = 32 heads × 128, video MLP 8x, text MLP 4x;
61 × 22 × 39 = 52,338 video tokens of a 10 s 704x1248 clip, plus 512 text tokens): the fused Triton kernel, eager PyTorch (the reference path) and
`torch.compile` of the reference, with the bandwidth floor (bytes read + written / 4.2 TB/s, the H200's
measured device-to-device copy rate) and the achieved TB/s. Then a sweep of the kernels' launch shapes,
and one whole block: eager unfused, eager fused, compiled unfused, compiled fused.

Times are medians over `--reps` runs after warm-up, with CUDA events; L2 is flushed before each op run.
Prints a markdown table last; `--out FILE` writes everything as JSON.

    python3 scripts/bench_kernels.py dit-fusions --out dit_fusions.json
    python3 scripts/bench_kernels.py dit-fusions --device cpu --small     # dry run of the set-up, reference path
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from pan2cli.dit import fusions, set_fused_kernels  # noqa: E402
from pan2cli.dit.model import PAN2TransformerBlock  # noqa: E402
from pan2cli.dit.rope import rope_table  # noqa: E402
from pan2cli.triton_support import triton_interpreting  # noqa: E402

COPY_BANDWIDTH = 4.2e12  # bytes/s, H200 device-to-device copy (read + written), docs/measuring.md
# The target each fused op was written to at the release shapes: within 1.35x of its HBM floor (and faster than
# torch.compile's code; docs/BENCHMARKS.md).
FLOOR_TARGET = 1.35


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu for a dry run (default cuda)")
    parser.add_argument("--small", action="store_true", help="tiny shapes (a dry run of the set-up)")
    parser.add_argument(
        "--reps", type=int, default=20, help="timed runs per op (default 20; the block runs a quarter)"
    )
    parser.add_argument("--warmup", type=int, default=3, help="untimed runs before timing (default 3)")
    parser.add_argument("--skip-block", action="store_true", help="ops only")
    parser.add_argument("--skip-sweep", action="store_true", help="no launch-shape sweep")
    parser.add_argument("--out", type=Path, help="write the full results as JSON here")
    return parser.parse_args()


class Timer:
    """Median milliseconds of `fn()`: CUDA events on GPU (L2 flushed and host dispatch hidden), perf_counter on CPU."""

    def __init__(self, device: torch.device, warmup: int):
        self.device = device
        self.warmup = warmup
        self.flush = (
            torch.empty(256 * 2**20, dtype=torch.int8, device=device) if device.type == "cuda" else None
        )

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __call__(self, fn, reps: int) -> float:
        for _ in range(self.warmup):
            fn()
        self.sync()
        times = []
        for _ in range(reps):
            if self.device.type == "cuda":
                self.flush.zero_()
                # Keep the GPU busy for ~1 ms while Python dispatches `fn` (custom-op and compile guards
                # cost tens of µs on the host): the events then bracket device time only, for every variant.
                torch.cuda._sleep(2_000_000)
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def first_call(self, fn) -> float:
        """Seconds of the first call (compilation included)."""
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0


def rel_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def nbytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def main() -> int:
    args = parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "error: CUDA is not available; this benchmark needs a GPU (use --device cpu --small for a dry run)",
            file=sys.stderr,
        )
        return 1
    on_gpu = device.type == "cuda"
    can_fuse = on_gpu or triton_interpreting()
    can_compile = on_gpu
    dtype = torch.bfloat16
    if args.small:
        heads, head_dim, axes = 2, 128, (16, 56, 56)
        grid, n_text = (3, 4, 5), 16
    else:
        heads, head_dim, axes = 32, 128, (16, 56, 56)  # the release: hidden 4096
        grid, n_text = (61, 22, 39), 512
    n_video = grid[0] * grid[1] * grid[2]
    dim = heads * head_dim
    mlp_ratio, context_mlp_ratio, eps = 8.0, 4.0, 1e-6
    n_total = n_video + n_text
    timer = Timer(device, args.warmup)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    results: dict = {
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu",
        "torch": torch.__version__,
        "shapes": {
            "video_tokens": n_video,
            "grid": grid,
            "text_tokens": n_text,
            "hidden": dim,
            "heads": heads,
            "head_dim": head_dim,
        },
        "ops": [],
        "sweep": [],
        "block": [],
    }
    print(
        f"# {results['device']}, torch {torch.__version__}; {n_video} video + {n_text} text tokens, {heads} heads × {head_dim}",
        file=sys.stderr,
    )

    def record_op(name: str, floor_bytes: int, variants: dict, check: tuple | None) -> None:
        floor_ms = floor_bytes / COPY_BANDWIDTH * 1e3
        entry = {"op": name, "bytes": floor_bytes, "floor_ms": floor_ms, "variants": {}}
        for label, fn in variants.items():
            info = {}
            if label == "compiled":
                info["first_call_s"] = timer.first_call(fn)
            ms = timer(fn, args.reps)
            info.update(ms=ms, tb_per_s=floor_bytes / (ms * 1e-3) / 1e12, x_floor=ms / floor_ms)
            entry["variants"][label] = info
        if check is not None:
            entry["rel_error_fused_vs_reference"] = max(rel_error(a, b) for a, b in zip(*check))
        results["ops"].append(entry)
        print(f"{name}: bytes read+written {floor_bytes:,} → floor {floor_ms:.3f} ms; "
              + ", ".join(f"{k} {v['ms']:.3f} ms" for k, v in entry["variants"].items()), file=sys.stderr)  # fmt: skip

    # -- Q/K RMSNorm + RoPE ---------------------------------------------------------------------
    cos, sin = rope_table(grid, axes, 256.0, 16 / 24, device=device)
    qk = dict(
        q=rand(1, n_video, heads, head_dim, scale=2.0),
        k=rand(1, n_video, heads, head_dim),
        q_weight=rand(head_dim, scale=0.2) + 1,
        k_weight=rand(head_dim, scale=0.2) + 1,
        cos=cos,
        sin=sin,
        q_text=rand(1, n_text, heads, head_dim),
        k_text=rand(1, n_text, heads, head_dim),
        q_text_weight=rand(head_dim, scale=0.2) + 1,
        k_text_weight=rand(head_dim, scale=0.2) + 1,
    )
    qk_bytes = 2 * nbytes(qk["q"], qk["k"], qk["q_text"], qk["k_text"]) + nbytes(cos, sin)
    variants = {"eager": lambda: fusions.qk_norm_rope(**qk, eps=eps, fused=False)}
    if can_fuse:
        variants["fused"] = lambda: fusions.qk_norm_rope(**qk, eps=eps, fused=True)
    if can_compile:
        compiled_qk = torch.compile(fusions.qk_norm_rope_reference, dynamic=False)
        variants["compiled"] = lambda: compiled_qk(**qk, eps=eps)
    check = (variants["fused"](), variants["eager"]()) if can_fuse else None
    record_op("qk_norm_rope", qk_bytes, variants, check)

    # -- LayerNorm + modulation, per sample and per token -----------------------------------------
    x = rand(1, n_total, dim, scale=3.0)
    for mode, groups in (("per-sample", 1), ("per-token", n_total)):
        scale, shift = rand(1, groups, dim, scale=0.3), rand(1, groups, dim)
        ln_bytes = 2 * nbytes(x) + nbytes(scale, shift)
        variants = {
            "eager": lambda s=scale, h=shift: fusions.layer_norm_modulate(x, s, h, eps=eps, fused=False)
        }
        if can_fuse:
            variants["fused"] = lambda s=scale, h=shift: fusions.layer_norm_modulate(
                x, s, h, eps=eps, fused=True
            )
        if can_compile:
            compiled_ln = torch.compile(fusions.layer_norm_modulate_reference, dynamic=False)
            variants["compiled"] = lambda s=scale, h=shift, f=compiled_ln: f(x, s, h, eps)
        check = ((variants["fused"](),), (variants["eager"](),)) if can_fuse else None
        record_op(f"ln_modulate/{mode}", ln_bytes, variants, check)

    # -- the gated residual x + gate·update (float32 gate, as the AdaLN linears give) ---------------
    update = rand(1, n_total, dim)
    gate = torch.randn(1, 1, dim, generator=gen, device=device)
    gr_bytes = 3 * nbytes(x) + nbytes(gate)
    variants = {"eager": lambda: fusions.gated_residual(x, update, gate, fused=False)}
    if can_fuse:
        variants["fused"] = lambda: fusions.gated_residual(x, update, gate, fused=True)
    if can_compile:
        compiled_gr = torch.compile(fusions.gated_residual_reference, dynamic=False)
        variants["compiled"] = lambda: compiled_gr(x, update, gate)
    check = ((variants["fused"](),), (variants["eager"](),)) if can_fuse else None
    record_op("gated_residual", gr_bytes, variants, check)

    # -- launch-shape sweep (helps pick the defaults) ----------------------------------------------
    if can_fuse and not args.skip_sweep:
        from pan2cli.dit.layer_norm_modulate_kernel import layer_norm_modulate as ln_launch
        from pan2cli.dit.qk_norm_rope_kernel import qk_norm_rope as qk_launch

        q_out = torch.empty(1, n_total, heads, head_dim, device=device, dtype=dtype)
        k_out = torch.empty_like(q_out)
        for block_rows in (8, 16, 32, 64):
            for warps in (2, 4, 8):

                def run_qk(b=block_rows, w=warps):
                    qk_launch(qk["q"], qk["k"], qk["q_weight"], qk["k_weight"], cos, sin, q_out, k_out,
                              eps=eps, block_rows=b, num_warps=w)  # fmt: skip
                    qk_launch(qk["q_text"], qk["k_text"], qk["q_text_weight"], qk["k_text_weight"], None, None,
                              q_out, k_out, eps=eps, out_token_offset=n_video, block_rows=b, num_warps=w)  # fmt: skip

                ms = timer(run_qk, max(5, args.reps // 2))
                results["sweep"].append(
                    {"op": "qk_norm_rope", "block_rows": block_rows, "num_warps": warps, "ms": ms}
                )
        scale1, shift1 = rand(1, 1, dim), rand(1, 1, dim)
        y = torch.empty_like(x)
        for block_rows in (1, 2):
            for warps in (4, 8, 16):
                ms = timer(lambda b=block_rows, w=warps: ln_launch(x, scale1, shift1, y, eps=eps, block_rows=b, num_warps=w),
                           max(5, args.reps // 2))  # fmt: skip
                results["sweep"].append(
                    {"op": "ln_modulate/per-sample", "block_rows": block_rows, "num_warps": warps, "ms": ms}
                )
        for op in ("qk_norm_rope", "ln_modulate/per-sample"):
            best = min((s for s in results["sweep"] if s["op"] == op), key=lambda s: s["ms"])
            print(
                f"sweep {op}: best block_rows={best['block_rows']} num_warps={best['num_warps']} {best['ms']:.3f} ms",
                file=sys.stderr,
            )

    # -- one block ----------------------------------------------------------------------------
    if not args.skip_block:
        del qk, x
        torch.manual_seed(0)
        block = PAN2TransformerBlock(dim, heads, head_dim, mlp_ratio, context_mlp_ratio, eps).to(
            device=device, dtype=dtype
        )
        block.norm1.float()  # the AdaLN linear is float32, as released
        block = block.eval().requires_grad_(False)
        hidden = rand(1, n_video, dim)
        ctx = rand(1, n_text, dim)
        temb = rand(1, dim)
        block_args = (hidden, ctx, temb, cos, sin)
        # FLOPs: 2 · tokens · (4 D² attention projections + 2 D·F MLP) per stream, plus attention 4 · S² · D.
        flops = (
            2 * n_video * (4 * dim * dim + 2 * dim * int(dim * mlp_ratio))
            + 2 * n_text * (4 * dim * dim + 2 * dim * int(dim * context_mlp_ratio))
            + 4 * n_total * n_total * dim
        )
        block_reps = max(3, args.reps // 4)
        outputs = {}
        configs = [("eager unfused", False, False), ("eager fused", True, False)]
        configs += [("compiled unfused", False, True), ("compiled fused", True, True)] if can_compile else []
        for label, fused, compiled in configs:
            if fused and not can_fuse:
                continue
            set_fused_kernels(block, fused)
            fn = torch.compile(block, dynamic=False) if compiled else block
            entry = {"variant": label}
            if compiled:
                entry["first_call_s"] = timer.first_call(lambda: fn(*block_args))
            entry["ms"] = timer(lambda: fn(*block_args), block_reps)
            entry["tflop_per_s"] = flops / (entry["ms"] * 1e-3) / 1e12
            outputs[label] = fn(*block_args)[0]
            results["block"].append(entry)
            print(f"block {label}: {entry['ms']:.2f} ms", file=sys.stderr)
        results["block_flops"] = flops
        if "eager unfused" in outputs:
            for entry in results["block"]:
                entry["rel_error_vs_eager_unfused"] = rel_error(
                    outputs[entry["variant"]], outputs["eager unfused"]
                )

    print_table(results)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        print(f"results written to {args.out}", file=sys.stderr)
    return 0


def print_table(results: dict) -> None:
    lines = ["| op | floor ms (bytes) | eager ms | compiled ms | fused ms | fused TB/s | fused / floor | fused vs compiled |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for entry in results["ops"]:
        v = entry["variants"]
        ms = lambda k: f"{v[k]['ms']:.3f}" if k in v else "–"  # noqa: E731
        fused = v.get("fused")
        ratio = f"{v['compiled']['ms'] / fused['ms']:.2f}x faster" if fused and "compiled" in v else "–"
        note = f" (target ≤ {FLOOR_TARGET * entry['floor_ms']:.3f})" if fused else ""
        lines.append(
            f"| {entry['op']} | {entry['floor_ms']:.3f} ({entry['bytes'] / 1e9:.3f} GB) | {ms('eager')} | {ms('compiled')} "
            f"| {ms('fused')}{note} | {fused['tb_per_s']:.2f} | {fused['x_floor']:.2f} | {ratio} |"
            if fused else
            f"| {entry['op']} | {entry['floor_ms']:.3f} ({entry['bytes'] / 1e9:.3f} GB) | {ms('eager')} | {ms('compiled')} | – | – | – | – |"
        )  # fmt: skip
    if results["block"]:
        base = next((e["ms"] for e in results["block"] if e["variant"] == "eager unfused"), None)
        lines += [
            "",
            "| block variant | ms | vs eager unfused | TFLOP/s | rel. error vs eager unfused |",
            "| --- | --- | --- | --- | --- |",
        ]
        for e in results["block"]:
            speed = f"{base / e['ms']:.2f}x" if base else "–"
            lines.append(
                f"| {e['variant']} | {e['ms']:.2f} | {speed} | {e['tflop_per_s']:.0f} | {e.get('rel_error_vs_eager_unfused', 0):.2e} |"
            )
    print("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
