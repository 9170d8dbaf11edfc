"""Triton kernel: per-token e4m3 quantisation of a `[M, K]` activation, optionally after GELU (tanh), one pass.

The fp8 tier's feed for a GEMM whose input no fused kernel produces: the attention output before `to_out`
(K = 4096) and, with `gelu=True`, the MLP's hidden layer after `net.0.proj` (K = 32768 video, 16384 text):
GELU(x) and its quantisation in one read of x instead of a GELU pass and a quantisation pass. Each program
holds whole rows in registers (K ≤ 32768: 32 values a thread at up to 32 warps), so x is read once and the fp8
row and its scale written once.

Numerics: GELU-tanh in float32 (`0.5·x·(1 + tanh(u))`, u = √(2/π)·(x + 0.044715·x³), as `x / (1 + exp(−2u))`), the
row's scale m/448 from its absolute maximum m (`row_kernels.quantize_rows`), one rounding to e4m3 (nearest
even, clamped to ±448).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pan2cli.dit.row_kernels import quantize_rows
from pan2cli.triton_support import triton_interpreting

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _gelu_tanh(x):
    inner = _SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
    # 0.5·(1 + tanh(u)) = 1 / (1 + exp(−2u)): no cancellation where tanh(u) → −1 (the 1 − 2/(e²ᵘ + 1) form
    # loses up to 2 % there); exp2 overflows to inf for very negative u, giving −0, and to 0 for large u.
    return x / (1.0 + tl.math.exp2((-2.0 * _LOG2E) * inner))


@triton.jit
def _quantize_rows_kernel(
    X, Y, Y_SCALE, n_rows, n_cols, stride_x_row, stride_y_row,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr, GELU: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_COLS)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if GELU:
        x = _gelu_tanh(x)
    y = quantize_rows(x, mask, Y_SCALE, rows, row_ok)
    tl.store(Y + rows[:, None] * stride_y_row + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def quantize_rows_fp8(
    x: torch.Tensor, out: torch.Tensor, out_scale: torch.Tensor, *, gelu: bool = False
) -> None:
    """`out, out_scale` = the per-row e4m3 quantisation of x (of GELU-tanh(x) with `gelu`).

    Args:
        x: `[M, K]` bf16/fp16/fp32, rows contiguous (`stride(1) == 1`), K ≤ 32768.
        out: `[M, K]` float8_e4m3fn, rows contiguous.
        out_scale: `[M]` float32: each row's scale (real value = fp8 value · scale).
        gelu: apply GELU (tanh approximation) first.
    """
    assert x.dim() == 2 and out.shape == x.shape and out.dtype == torch.float8_e4m3fn, (
        "out: [M, K] e4m3 like x"
    )
    n_rows, n_cols = x.shape
    assert x.stride(1) == 1 and out.stride(1) == 1, "rows must be contiguous"
    assert out_scale.shape == (n_rows,) and out_scale.dtype == torch.float32, "out_scale: [M] float32"
    assert n_cols <= 32768, f"rows of {n_cols} > 32768 do not fit one program's registers"
    for name, t in (("x", x), ("out", out), ("out_scale", out_scale)):
        assert t.is_cuda or triton_interpreting(), f"{name} must be a CUDA tensor (or set TRITON_INTERPRET=1)"
    if n_rows == 0:
        return
    block_cols = triton.next_power_of_2(n_cols)
    block_rows = max(1, 4096 // block_cols)
    # 32 values a thread (K = 32768: 32 warps, 64 registers, no spills; sm_90 compile report)
    num_warps = min(32, max(4, block_rows * block_cols // 1024))
    _quantize_rows_kernel[(triton.cdiv(n_rows, block_rows),)](
        x, out, out_scale, n_rows, n_cols, x.stride(0), out.stride(0),
        BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, GELU=gelu, num_warps=num_warps,
    )  # fmt: skip
