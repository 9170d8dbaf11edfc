"""The fixed-order Triton conv against cuDNN on the decoder's low-resolution layers (one GPU).

Usage: python scripts/bench_conv_kernel.py [--repeats 20]

For each layer shape (channels-last bf16, as the kernel decode path calls them): cuDNN through ATen and
the Triton kernel with a few tile configurations; milliseconds per call (CUDA events, median of
`--repeats` after a warm-up), TFLOP/s, and whether the outputs agree (max |diff|, bf16).
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
import torch.nn.functional as F

from pan2cli.vae.kernel.conv import conv_channels_last

# (name, input shape, C_out, kernel, pad_w)
LAYERS = [
    ("mid/up0 3x3x3, chunk of 4", (1, 6, 46, 78, 1024), 1024, (3, 3, 3), 1),
    ("up1 3x3x3, chunk of 8", (1, 10, 90, 156, 1024), 1024, (3, 3, 3), 1),
    ("up0 time conv (3,1,1)", (1, 6, 44, 78, 1024), 2048, (3, 1, 1), 0),
    ("up0 phase conv 2x2, 8 frames", (8, 46, 78, 1024), 4096, (2, 2), 1),
    ("up1 phase conv 2x2, 2 frames", (2, 90, 156, 1024), 4096, (2, 2), 1),
]
# (BLOCK_M, BLOCK_N, warps, stages[, BLOCK_K]); None: the layer's own (`pan2cli.vae.kernel.conv._tiles`)
TILES = [
    None,
    (128, 256, 8, 3),
    (128, 256, 8, 4),
    (256, 128, 8, 3),
    (256, 128, 8, 4),
    (128, 256, 8, 2, 128),
    (256, 128, 8, 2, 128),
    (128, 128, 4, 4),
]


def _cudnn(x: torch.Tensor, w: torch.Tensor, pad_w: int) -> torch.Tensor:
    """The same conv through ATen/cuDNN on channels-last views, channels-last out."""
    if w.dim() == 5:
        return F.conv3d(x.permute(0, 4, 1, 2, 3), w, padding=(0, 0, pad_w)).permute(0, 2, 3, 4, 1)
    return F.conv2d(x.permute(0, 3, 1, 2), w, padding=(0, pad_w)).permute(0, 2, 3, 1)


def _time(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args()
    print("| layer | engine | ms | TFLOP/s | max abs diff vs cuDNN |")
    print("| --- | --- | ---: | ---: | ---: |")
    for name, shape, c_out, kernel, pad_w in LAYERS:
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        c_in = shape[-1]
        fmt = torch.channels_last_3d if len(kernel) == 3 else torch.channels_last
        w = (torch.randn(c_out, c_in, *kernel, device="cuda") / (c_in * 9) ** 0.5).to(torch.bfloat16)
        w = w.contiguous(memory_format=fmt)
        cudnn = partial(_cudnn, x, w, pad_w)
        expected = cudnn()
        flop = 2.0 * expected.numel() * c_in * torch.tensor(kernel).prod().item()
        ms = _time(cudnn, args.repeats)
        print(f"| {name} | cuDNN | {ms:.3f} | {flop / ms / 1e9:.0f} | 0 |", flush=True)
        own = conv_channels_last(x, w, pad_w=pad_w)
        for tiles in TILES:
            run = partial(conv_channels_last, x, w, pad_w=pad_w, tiles=tiles)
            got = run()
            diff = (got.float() - expected.float()).abs().max().item()
            same = "" if tiles is None else (", = own tiles" if torch.equal(got, own) else ", ≠ own tiles")
            ms = _time(run, args.repeats)
            label = f"Triton {tiles or 'own tiles'}"
            print(f"| {name} | {label} | {ms:.3f} | {flop / ms / 1e9:.0f} | {diff:.3g}{same} |", flush=True)


if __name__ == "__main__":
    main()
