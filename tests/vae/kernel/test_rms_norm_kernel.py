"""The compiled fused RMS norm (`rms_norm_silu`) against its documented math, on a GPU.

Every mode the decoder uses: norm + SiLU with a bias (conv2's input), with a residual whose sum is kept in
place of x (a block's first norm), the norm without SiLU (the attention), the plain sum, strided output
frames (a conv buffer behind its history), the causal history, and channel counts that are and are not
multiples of 256 (the kernel's vector split per lane).
"""

from __future__ import annotations

import pytest
import torch

from tests.vae.kernel import emulated_ops


def _reference(x, gamma, bias, residual, silu, normalize):
    """(the stored sum, the output) in fp32, from the op's emulation."""
    total, out = torch.empty(x.shape), torch.empty(x.shape)
    emulated_ops.rms_norm_silu(
        x.cpu(),
        gamma.cpu(),
        None if bias is None else bias.cpu(),
        None if residual is None else residual.cpu(),
        total,
        out,
        silu,
        None,
        normalize,
    )
    if bias is None and residual is None:
        total.copy_(x.float().cpu())
    return total.to(x.device), out.to(x.device)


def _close_in_bf16(got: torch.Tensor, expected: torch.Tensor) -> None:
    # One bf16 rounding of a value computed in fp32 with the fast exp: within one bf16 ulp (2^-8 relative).
    torch.testing.assert_close(got.float(), expected, rtol=2**-7, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("channels", [256, 512, 1024, 48, 384])
@pytest.mark.parametrize(
    "mode",
    ["bias-silu", "residual-kept-in-place", "residual-silu", "norm-only", "plain-sum"],
)
def test_rms_norm_silu_matches_its_math(kernel_ops, channels, mode):
    gen = torch.Generator(device="cuda").manual_seed(channels)
    shape = (1, 3, 7, 37, channels)  # rows per frame (259) not a multiple of the rows per block
    x = (3 * torch.randn(shape, device="cuda", generator=gen)).to(torch.bfloat16)
    x[0, 0, 0, 0] = 0  # a row of zeros: eps, and SiLU(0) = 0
    gamma = (1 + 0.1 * torch.randn(channels, device="cuda", generator=gen)) * channels**0.5
    bias = residual = None
    if mode.startswith("bias"):
        bias = torch.randn(channels, device="cuda", generator=gen)
    if mode.startswith("residual") or mode == "plain-sum":
        residual = torch.randn(shape, device="cuda", generator=gen).to(torch.bfloat16)
    silu = mode in ("bias-silu", "residual-kept-in-place", "residual-silu")
    normalize = mode != "plain-sum"
    total, expected = _reference(x, gamma, bias, residual, silu, normalize)
    # out: the frames of a conv buffer behind two history frames, with halo rows (strided frames)
    buffer = torch.full((1, 5, 9, 37, channels), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = buffer[:, 2:, 1:-1]
    sum_out = x if mode == "residual-kept-in-place" else None
    source = x.clone() if sum_out is None else x
    kernel_ops.rms_norm_silu(source, gamma, bias, residual, sum_out, out, silu, None, normalize)
    _close_in_bf16(out, expected)
    assert buffer[:, :2].isnan().all() and buffer[:, 2:, 0].isnan().all() and buffer[:, 2:, -1].isnan().all()
    if sum_out is not None:
        assert torch.equal(x.float(), total)  # the sum, stored in place of x, exactly as normalised


@pytest.mark.gpu
@pytest.mark.parametrize("channels", [256, 1024])
def test_rms_norm_silu_writes_the_last_two_frames_into_the_history(kernel_ops, channels):
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, 4, 5, 6, channels, device="cuda", generator=gen).to(torch.bfloat16)
    gamma = torch.full((channels,), channels**0.5, device="cuda")
    out = torch.empty_like(x)
    history = torch.full((1, 2, 5, 6, channels), float("nan"), device="cuda", dtype=torch.bfloat16)
    kernel_ops.rms_norm_silu(x, gamma, None, None, None, out, True, history, True)
    _close_in_bf16(out, _reference(x, gamma, None, None, True, True)[1])
    assert torch.equal(history, out[:, 2:])
