"""The compiled resampler epilogue (`phase_interleave`) and head (`head_to_uint8`) against their documented
math (the emulations in emulated_ops.py), bit for bit, on a GPU.

phase_interleave: every DupUp3D shortcut layout the kernel has a path for (as many input as output channels,
twice as many, any other ratio), upsample3d's two frames per input frame with and without the first
chunk's offset, no shortcut, a batch, a row band's shortcut, and channel counts whose 8-channel vectors do
not fill a block evenly. head_to_uint8: conv_out's time partials of one, two and three frames, a batch.
"""

from __future__ import annotations

import pytest
import torch

from tests.vae.kernel import emulated_ops

pytestmark = pytest.mark.gpu


def _bf16(*shape, gen):
    return torch.randn(*shape, generator=gen, device="cuda").to(torch.bfloat16)


@pytest.mark.parametrize(
    "batch, frames_out, frames_in, h, w, channels, shortcut_channels, factor_t, frame_offset",
    [
        (1, 4, 2, 5, 7, 64, 64, 2, 0),  # upsample3d, C_in = C (up_blocks.0 and .1)
        (1, 3, 2, 5, 7, 64, 64, 2, 1),  # the first chunk: DupUp3D drops its first frame
        (1, 1, 1, 6, 9, 64, 128, 1, 0),  # upsample2d, C_in = 2C (up_blocks.2)
        (2, 2, 1, 4, 5, 64, 128, 2, 0),  # upsample3d with C_in = 2C, a batch
        (1, 1, 1, 4, 5, 64, 32, 1, 0),  # C_in = C / 2: the general gather
        (1, 2, 1, 3, 11, 48, 48, 2, 0),  # 6 vectors a pixel: blocks of 6 x 42 threads
        (1, 1, 1, 3, 4, 2048, 2048, 1, 0),  # the widest: one vector a thread, one column a block row
        (1, 2, 2, 4, 6, 64, None, 1, 0),  # no shortcut
    ],
    ids=[
        "3d",
        "3d-first-chunk",
        "2d-twice",
        "3d-twice-batch",
        "2d-half",
        "48-channels",
        "2048-channels",
        "none",
    ],
)
def test_phase_interleave_matches_its_math(
    kernel_ops, batch, frames_out, frames_in, h, w, channels, shortcut_channels, factor_t, frame_offset
):
    gen = torch.Generator(device="cuda").manual_seed(channels + h)
    phases = _bf16(batch * frames_out, h + 1, w + 1, 4 * channels, gen=gen)
    bias = torch.randn(channels, generator=gen, device="cuda")
    shortcut = None
    if shortcut_channels is not None:
        shortcut = _bf16(batch, frames_in, h, w, shortcut_channels, gen=gen)
    got = torch.empty(batch, frames_out, 2 * h, 2 * w, channels, dtype=torch.bfloat16, device="cuda")
    kernel_ops.phase_interleave(phases, bias, shortcut, got, factor_t, frame_offset)
    expected = torch.empty(got.shape, dtype=torch.bfloat16)
    emulated_ops.phase_interleave(
        phases.cpu(),
        bias.cpu(),
        None if shortcut is None else shortcut.cpu(),
        expected,
        factor_t,
        frame_offset,
    )
    # bias + phase + shortcut in fp32 in one order, one rounding: the same bits
    assert torch.equal(got.cpu(), expected)


def test_phase_interleave_of_row_bands_equals_the_whole_frame(kernel_ops):
    """The lazy upsampler writes a frame in two bands of rows, each with its rows of the shortcut."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    h, w, c = 6, 5, 64
    phases = _bf16(1, h + 1, w + 1, 4 * c, gen=gen)
    bias = torch.randn(c, generator=gen, device="cuda")
    shortcut = _bf16(1, 1, h, w, 2 * c, gen=gen)
    whole = torch.empty(1, 1, 2 * h, 2 * w, c, dtype=torch.bfloat16, device="cuda")
    kernel_ops.phase_interleave(phases, bias, shortcut, whole, 1, 0)
    bands = torch.empty_like(whole)
    for r0, r1 in ((0, 3), (3, 6)):
        kernel_ops.phase_interleave(
            phases[:, r0 : r1 + 1].contiguous(),
            bias,
            shortcut[:, :, r0:r1],
            bands[:, :, 2 * r0 : 2 * r1],
            1,
            0,
        )
    assert torch.equal(bands, whole)


@pytest.mark.parametrize("history", [0, 1, 2])
@pytest.mark.parametrize("batch", [1, 2])
def test_head_to_uint8_matches_its_math(kernel_ops, history, batch):
    gen = torch.Generator(device="cuda").manual_seed(10 * history + batch)
    h, w = 5, 7
    # conv_out outputs around [-1.5, 1.5]: some clamp, most do not
    partials = [0.5 * torch.randn(batch, h, w, 36, generator=gen, device="cuda") for _ in range(3)]
    current = partials[0]
    previous = partials[1] if history >= 1 else None
    before = partials[2] if history >= 2 else None
    bias = 0.1 * torch.randn(12, generator=gen, device="cuda")
    got = torch.empty(batch, 2 * h, 2 * w, 3, dtype=torch.uint8, device="cuda")
    kernel_ops.head_to_uint8(current, previous, before, bias, got)
    expected = torch.empty(got.shape, dtype=torch.uint8)
    cpu = [None if t is None else t.cpu() for t in (current, previous, before, bias)]
    emulated_ops.head_to_uint8(*cpu, expected)
    assert torch.equal(got.cpu(), expected)
    assert 0 < (got == 255).float().mean().item() < 0.5  # the clamp was exercised, not everything
