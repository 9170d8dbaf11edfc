"""Triton kernels: per-token e4m3 quantisation of a `[M, K]` activation, optionally after GELU (tanh).

The fp8 tier's feed for a GEMM whose input no fused kernel produces: the attention output before `to_out`
(K = 4096: one pass, each program holding whole rows in registers) and, with `gelu=True`, the MLP's hidden
layer after `net.0.proj` (K = 32768 video, 16384 text): GELU(x) and its quantisation without a GELU pass in
between. Holding a 32768-wide row in registers takes a whole SM (32 warps, one program), whose loads then
wait with nothing to hide them (2.4 TB/s on an H200); the GELU kernel instead walks each row twice in
blocks, several programs an SM: first for the row's largest x, which gives the scale without any GELU
(GELU-tanh rises monotonically for x ≥ 0 and its negative values never pass `GELU_NEGATIVE_BOUND` in
magnitude, so where GELU(max x) reaches that bound it is the row's absolute maximum), then from L2 for
GELU and the rounding. A row whose GELU(max x) stays below the bound (all-negative rows) takes one more
walk for the exact maximum.

Numerics: GELU-tanh in float32 (`0.5·x·(1 + tanh(u))`, u = √(2/π)·(x + 0.044715·x³), as `x / (1 + exp(−2u))`), the
row's scale m/448 from its absolute maximum m (`row_kernels.quantize_rows`: 1 for an all-zero row, NaN for a
row holding NaN or Inf), one rounding to e4m3 (nearest even, clamped to ±448).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pan2cli.dit.row_kernels import E4M3_MAX, quantize_rows
from pan2cli.triton_support import triton_interpreting

_SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
_LOG2E = tl.constexpr(1.4426950408889634)
# |GELU-tanh(x)| for x < 0 peaks at 0.16997 (x ≈ −0.752); the bound leaves float32 rounding room.
GELU_NEGATIVE_BOUND = tl.constexpr(0.171)
# Columns a program takes per step of its walks, and its warps: 0.77 ms for 26,598 rows of 32768 on an H200
# (3.4 TB/s), against 0.97 for the whole row in registers; 0.87-1.03 with 1024-4096 columns or 16-32 warps.
GELU_BLOCK, GELU_WARPS = 8192, 8


@triton.jit
def _gelu_tanh(x):
    inner = _SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)
    # 0.5·(1 + tanh(u)) = 1 / (1 + exp(−2u)): no cancellation where tanh(u) → −1 (the 1 − 2/(e²ᵘ + 1) form
    # loses up to 2 % there); exp2 overflows to inf for very negative u, giving −0, and to 0 for large u.
    return x / (1.0 + tl.math.exp2((-2.0 * _LOG2E) * inner))


@triton.jit
def _quantize_rows_kernel(
    X, Y, Y_SCALE, n_rows, n_cols, stride_x_row, stride_y_row,
    BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr,
):  # fmt: skip
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_COLS)
    row_ok = rows < n_rows
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    x = tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = quantize_rows(x, mask, Y_SCALE, rows, row_ok)
    tl.store(Y + rows[:, None] * stride_y_row + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_quantize_rows_kernel(
    X, Y, Y_SCALE, stride_x_row, stride_y_row,
    N_COLS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_x_row
    y_row = Y + row * stride_y_row
    # Walk 1: the row's largest x, NaN and ±Inf counted as +Inf (GELU(−Inf) is NaN too).
    top = tl.zeros([BLOCK], dtype=tl.float32)  # 0 is a safe start: a row whose max is below 0 takes walk 1b
    for start in range(0, N_COLS, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(x_row + cols, mask=cols < N_COLS, other=0.0).to(tl.float32)
        top = tl.maximum(top, tl.where(tl.abs(x) < float("inf"), x, float("inf")))
    x_max = tl.max(top, axis=0)
    amax = _gelu_tanh(x_max)
    if amax < GELU_NEGATIVE_BOUND:  # the negative side may hold the largest magnitude: walk 1b, exact
        largest = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, N_COLS, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(x_row + cols, mask=cols < N_COLS, other=0.0).to(tl.float32)
            largest = tl.maximum(largest, tl.abs(_gelu_tanh(x)))
        amax = tl.max(largest, axis=0)
    bad = x_max == float("inf")
    tl.store(Y_SCALE + row, tl.where(bad, float("nan"), tl.where(amax > 0.0, amax / E4M3_MAX, 1.0)))
    inverse = tl.where(amax > 0.0, E4M3_MAX / tl.maximum(amax, 1e-30), 1.0)
    # Walk 2: GELU, scaled, clamped (NaN rows stay NaN), rounded once.
    for start in range(0, N_COLS, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N_COLS
        x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        y = tl.minimum(tl.maximum(_gelu_tanh(x) * inverse, -E4M3_MAX), E4M3_MAX)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=mask)


def quantize_rows_fp8(
    x: torch.Tensor,
    out: torch.Tensor,
    out_scale: torch.Tensor,
    *,
    gelu: bool = False,
    block: int | None = None,
    num_warps: int | None = None,
) -> None:
    """`out, out_scale` = the per-row e4m3 quantisation of x (of GELU-tanh(x) with `gelu`).

    Args:
        x: `[M, K]` bf16/fp16/fp32, rows contiguous (`stride(1) == 1`), K ≤ 32768.
        out: `[M, K]` float8_e4m3fn, rows contiguous.
        out_scale: `[M]` float32: each row's scale (real value = fp8 value · scale).
        gelu: apply GELU (tanh approximation) first (the two-walk kernel, module docstring).
        block, num_warps: the GELU kernel's launch (columns per step, default `GELU_BLOCK`; `GELU_WARPS`).
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
    if gelu:
        block = min(block or GELU_BLOCK, triton.next_power_of_2(n_cols))
        _gelu_quantize_rows_kernel[(n_rows,)](
            x, out, out_scale, x.stride(0), out.stride(0),
            N_COLS=n_cols, BLOCK=block, num_warps=num_warps or GELU_WARPS,
        )  # fmt: skip
        return
    block_cols = triton.next_power_of_2(n_cols)
    block_rows = max(1, 4096 // block_cols)
    # whole rows in registers, 4+ warps (K = 4096: 4 warps, 32 values a thread)
    _quantize_rows_kernel[(triton.cdiv(n_rows, block_rows),)](
        x, out, out_scale, n_rows, n_cols, x.stride(0), out.stride(0),
        BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
        num_warps=min(32, max(4, block_rows * block_cols // 1024)),
    )  # fmt: skip
