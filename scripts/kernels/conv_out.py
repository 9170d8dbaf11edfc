"""conv_out, one 704x1248 frame: cuDNN's 3-D conv over three frames against the Triton time partials.

cuDNN's 3-D conv is how a history ring of three frames would run conv_out; the kernel decoder runs it as time
partials instead (one 2-D conv of the frame by the three time taps' filters, 36 fp32 outputs, the fixed-order
Triton kernel). With a sweep of the Triton tiles, all of which must give the same bits.

Usage: python3 scripts/bench_kernels.py conv-out [--repeats 30]   (one CUDA GPU; milliseconds per frame, median)
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from pan2cli.vae.kernel.conv import conv_channels_last  # noqa: E402
from scripts.kernels.conv import _time  # noqa: E402

# (BLOCK_M, BLOCK_N, warps, stages); None: the layer's own (`conv._tiles`)
TILES = [
    None,
    (128, 64, 4, 3),
    (128, 64, 8, 4),
    (256, 64, 8, 3),
    (256, 64, 8, 4),
    (64, 64, 4, 4),
    (128, 64, 4, 5),
    (64, 64, 4, 6),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=30, help="timed runs per variant (default 30)")
    _ms = partial(_time, repeats=parser.parse_args().repeats)
    h, w, c = 352, 624, 256  # conv_out's input at 704x1248 (before the 2x2 unpatchify)
    ring = torch.randn(1, 3, h + 2, w, c, device="cuda").to(torch.bfloat16)  # frames f - 2, f - 1, f
    weight = (torch.randn(12, c, 3, 3, 3, device="cuda") / (c * 27) ** 0.5).to(torch.bfloat16)
    weight = weight.contiguous(memory_format=torch.channels_last_3d)

    def cudnn():
        return F.conv3d(ring.permute(0, 4, 1, 2, 3), weight, padding=(0, 0, 1))

    print(f"cuDNN 3-D conv, three frames -> 12 channels: {_ms(cudnn):.3f} ms")
    stacked = torch.cat([weight[:, :, k] for k in range(3)]).contiguous(memory_format=torch.channels_last)
    flop = 2 * h * w * 36 * c * 9
    own = None
    for tiles in TILES:

        def partials(tiles=tiles):
            return conv_channels_last(ring[:, 2], stacked, pad_w=1, tiles=tiles, out_dtype=torch.float32)

        out = partials()
        own = out if own is None else own
        ms = _ms(partials)
        print(
            f"time partials, Triton {tiles or 'own tiles'}: {ms:.3f} ms, {flop / ms / 1e9:.0f} TFLOP/s "
            f"({flop / 36 * 64 / ms / 1e9:.0f} with the padding channels), same bits as own tiles: {torch.equal(out, own)}"
        )

    def one(frame):
        return conv_channels_last(ring[:, frame], stacked, pad_w=1, out_dtype=torch.float32)

    y = one(2)[..., 24:] + one(1)[..., 12:24] + one(0)[..., :12]
    expected = cudnn().permute(0, 2, 3, 4, 1)[:, 0].float()
    print(
        f"max |partials' sum - cuDNN (bf16)| {(y - expected).abs().max().item():.4f}, max |cuDNN| {expected.abs().max().item():.2f}"
    )


if __name__ == "__main__":
    main()
