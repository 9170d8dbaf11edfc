"""The fused-norm conv prototype against the decode's two passes, per 3x3x3 layer (one GPU).

Usage: python3 scripts/bench_kernels.py fused-norm [--repeats 10] [--layers up1,up3]

For each residual-block conv of a 704x1248 decode (the `conv` benchmark's LAYERS): today's
rms_norm_silu (read x, write the normed copy) + the plain conv, against rms_inv (read x, write one fp32 per
pixel) + the conv that normalises its operand tiles in shared memory; milliseconds (CUDA events, median),
the conv's TFLOP/s, and max |fused - two passes|. The prototype (kernels/experimental/, its own extension, built
here on first use) measured 2.7-3.0x
slower than the two passes (docs/KERNEL_NOTES.md says why); this is how a next version is timed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from pan2cli.vae.kernel import conv  # noqa: E402
from pan2cli.vae.kernel.build import load_kernel  # noqa: E402
from pan2cli.vae.kernel.prototypes import load_prototypes  # noqa: E402
from scripts.kernels.conv import LAYERS, _time  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument(
        "--layers", default="", help="comma-separated name prefixes (default: every 3x3x3 layer)"
    )
    args = parser.parse_args()
    ops, prototype = load_kernel(), load_prototypes()
    wanted = [p for p in args.layers.split(",") if p]
    print("| layer | two passes ms | fused ms (rms_inv + conv) | conv TFLOP/s two / fused | max abs diff |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, shape, c_out, kernel, pad_w, _ in LAYERS:
        if kernel != (3, 3, 3) or (wanted and not any(name.startswith(p) for p in wanted)):
            continue
        c_in = shape[-1]
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(c_out, c_in, *kernel, device="cuda") / (c_in * 27) ** 0.5).to(torch.bfloat16)
        w = w.contiguous(memory_format=torch.channels_last_3d)
        gamma = torch.full((c_in,), c_in**0.5, device="cuda")
        bias = torch.zeros(c_out, device="cuda")
        normed = torch.empty_like(x)
        inv = torch.empty(shape[:-1], dtype=torch.float32, device="cuda")
        out = conv._output(x, w, pad_w)

        def two_passes():
            ops.rms_norm_silu(x, gamma, None, None, None, normed, True, None, True)
            return conv.conv_cutlass(ops, normed, w, bias, pad_w=pad_w)

        def fused():
            prototype.rms_inv(x, inv)
            prototype.conv_cutlass_norm(x, inv, gamma, w, bias, out, pad_w)
            return out

        diff = (fused().float() - two_passes().float()).abs().max().item()
        flop = 2.0 * out.numel() * c_in * 27
        conv_two = _time(lambda: conv.conv_cutlass(ops, normed, w, bias, pad_w=pad_w), args.repeats)
        conv_fused = _time(lambda: prototype.conv_cutlass_norm(x, inv, gamma, w, bias, out, pad_w), args.repeats)
        print(
            f"| {name} | {_time(two_passes, args.repeats):.3f} | {_time(fused, args.repeats):.3f} | "
            f"{flop / conv_two / 1e9:.0f} / {flop / conv_fused / 1e9:.0f} | {diff:.3g} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
