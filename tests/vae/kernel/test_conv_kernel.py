"""The fixed-order implicit-GEMM conv (Triton) against PyTorch's conv, and its shape invariance on a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from pan2cli.vae.kernel.conv import conv_channels_last
from tests.subprocess_env import python_env

# TRITON_INTERPRET=1 without CUDA, set for each test of this module only (conftest.py).
pytestmark = pytest.mark.usefixtures("triton_interpreter_without_cuda")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPO = Path(__file__).resolve().parents[3]


def _inputs(shape, c_out, kernel, seed=0, bias=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(torch.bfloat16).to(DEVICE)
    c_in = shape[-1]
    w = (torch.randn(c_out, c_in, *kernel, generator=gen) / (c_in * torch.tensor(kernel).prod()).sqrt()).to(
        torch.bfloat16
    )
    fmt = torch.channels_last_3d if len(kernel) == 3 else torch.channels_last
    w = w.to(DEVICE).contiguous(memory_format=fmt)
    b = torch.randn(c_out, generator=gen).to(DEVICE) if bias else None
    return x, w, b


def _reference(x, w, b, pad_w):
    """fp32 conv of the same bf16 values, channels-last out, rounded once to bf16."""
    if x.dim() == 5:
        out = F.conv3d(x.float().permute(0, 4, 1, 2, 3), w.float(), b, padding=(0, 0, pad_w)).permute(
            0, 2, 3, 4, 1
        )
    else:
        out = F.conv2d(x.float().permute(0, 3, 1, 2), w.float(), b, padding=(0, pad_w)).permute(0, 2, 3, 1)
    return out.to(torch.bfloat16)


@pytest.mark.parametrize(
    "shape, c_out, kernel, pad_w, bias",
    [
        ((1, 4, 5, 6, 64), 32, (3, 3, 3), 1, False),  # causal 3x3x3 over a history buffer with halo rows
        ((2, 3, 4, 5, 128), 160, (3, 3, 3), 1, False),  # batch, several reduction steps per tap, N tail
        ((1, 4, 3, 5, 64), 96, (3, 1, 1), 0, True),  # the upsampler's time conv, with bias
        ((3, 4, 5, 64), 64, (2, 2), 1, False),  # four-phase resampler conv: frames as batch
        ((1, 1, 4, 6, 64), 32, (1, 3, 3), 1, False),  # one tap in time (first chunk)
        ((1, 4, 5, 6, 48), 64, (3, 3, 3), 1, False),  # conv_in: 48 latent channels, steps of 16
        ((1, 3, 4, 5, 48), 48, (1, 1, 1), 0, True),  # post_quant_conv: 1x1x1 with bias
    ],
    ids=["3x3x3", "batch", "time-conv", "phase-2x2", "one-tap", "conv-in", "post-quant"],
)
def test_matches_pytorch_conv(shape, c_out, kernel, pad_w, bias):
    x, w, b = _inputs(shape, c_out, kernel, bias=bias)
    got = conv_channels_last(x, w, b, pad_w=pad_w)
    expected = _reference(x, w, b, pad_w)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    # One bf16 rounding each (the interpreter truncates where GPUs round to nearest): ≤ 1 ulp apart.
    err = (got.float() - expected.float()).abs().max().item()
    assert err <= 2**-7 * expected.float().abs().max().item(), err


def test_fp32_output_is_the_unrounded_sum():
    """conv_out's time partials: a 2-D 3x3 conv to 36 channels whose fp32 sums are kept as they are (the
    head adds three of them before its one rounding, to uint8)."""
    x, w, _ = _inputs((2, 6, 7, 64), 36, (3, 3), seed=5)
    got = conv_channels_last(x, w, pad_w=1, out_dtype=torch.float32)
    expected = F.conv2d(x.float().permute(0, 3, 1, 2), w.float(), padding=(0, 1)).permute(0, 2, 3, 1)
    assert got.dtype == torch.float32 and got.shape == expected.shape == (2, 4, 7, 36)
    # fp32 sums in another order than PyTorch's; a bf16 rounding would be ~1e-2 off
    assert (got - expected).abs().max().item() <= 1e-4 * expected.abs().max().item()
    rounded = conv_channels_last(x, w, pad_w=1)
    assert torch.equal(rounded, got.to(torch.bfloat16)) or DEVICE == "cpu"  # the interpreter truncates


@pytest.mark.parametrize(
    "shape, c_out, kernel, pad_w, bias",
    [
        ((1, 4, 5, 6, 64), 32, (3, 3, 3), 1, False),
        ((1, 4, 3, 5, 64), 96, (3, 1, 1), 0, True),
        ((1, 1, 4, 6, 64), 32, (1, 3, 3), 1, False),
        ((1, 4, 5, 6, 48), 64, (3, 3, 3), 1, False),
    ],
    ids=["3x3x3", "time-conv", "one-tap", "conv-in"],
)
def test_tile_configurations_give_the_same_outputs(shape, c_out, kernel, pad_w, bias):
    """The tiles (block sizes, warps, stages) are a per-layer speed choice: they must not change the
    summation order, so every configuration gives the layer's outputs bit for bit."""
    x, w, b = _inputs(shape, c_out, kernel, seed=3, bias=bias)
    expected = conv_channels_last(x, w, b, pad_w=pad_w)
    for tiles in ((128, 128, 4, 4), (256, 128, 8, 3), (64, 64, 4, 2)):
        assert torch.equal(conv_channels_last(x, w, b, pad_w=pad_w, tiles=tiles), expected), tiles


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_bands_and_frame_counts_give_bit_identical_outputs():
    """A band of rows (one rank's share) and one output frame (a shorter chunk) equal the whole problem's
    rows and frame bit for bit, at the decoder's 1024-channel low-resolution shape."""
    x, w, _ = _inputs((1, 6, 46, 78, 1024), 1024, (3, 3, 3), seed=1)
    whole = conv_channels_last(x, w, pad_w=1)  # (1, 4, 44, 78, 1024)
    top = conv_channels_last(x[:, :, :24].contiguous(), w, pad_w=1)  # rows 0..21 with their halo
    bottom = conv_channels_last(x[:, :, 22:].contiguous(), w, pad_w=1)  # rows 22..43
    one_frame = conv_channels_last(x[:, :3].contiguous(), w, pad_w=1)
    assert torch.equal(top, whole[:, :, :22])
    assert torch.equal(bottom, whole[:, :, 22:])
    assert torch.equal(one_frame, whole[:, :1])


@pytest.mark.parametrize("arch, instruction", [(90, "wgmma"), (100, "tcgen05")], ids=["sm_90", "sm_100"])
def test_compiles_for_hopper_and_blackwell_without_a_gpu(arch, instruction):
    """Triton builds the kernel ahead of time for both architectures (bundled ptxas), with tensor-core
    MMAs: the thin conv_in layer (steps of 16 channels), a 1024-channel 3x3x3 layer, a phase conv (its
    own tiles) and conv_out's fp32 time partials (36 channels in 64-channel tiles). In a process of its own: this one may have run the CPU interpreter."""
    code = (
        "from scripts.check_conv_kernel_compiles import compile_layer, tensor_core_instruction\n"
        "for layer in ('conv_in', '3x3x3 1024', 'phase conv 2x2', 'conv_out time partials'):\n"
        f"    c = compile_layer(layer, {arch})\n"
        "    print(layer, '|', tensor_core_instruction(c), len(c.asm['cubin']) > 0)\n"
    )
    env = python_env(TRITON_INTERPRET="0")
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.splitlines() == [
        f"conv_in | {instruction} True",
        f"3x3x3 1024 | {instruction} True",
        f"phase conv 2x2 | {instruction} True",
        f"conv_out time partials | {instruction} True",
    ]
