"""Triton kernel: the gated residual `x + gate·update` in float32, rounded once to the dtype of x.

Eager PyTorch spends five passes over the activations on it (x and update up-cast, addcmul, down-cast);
this is one pass: x and update read once, the result written once. Each program takes `BLOCK_ROWS`
whole rows; the gate is one row per sample (`[B, D]`, batch stride free: the text stream's gate is
one table broadcast over the batch).

Numerics: float32 products and sums (`x + update·gate`, which the compiler may contract to one FMA: a
float32 rounding difference at most), one rounding per output element.

The update may be an fp8 GEMM's unscaled product (`pan2cli.dit.fp8.Fp8Product`, the fp8 tier's fc2): it is
then `raw · row_scale · col_scale + bias`, in float32, before the gate; the column scales and the bias are read
once a program (from L2, as the gate's row is): all the residuals of an fp8 step at 121 frames took 37.3 ms on
an H100 with fc2's scaled this way, 37.7 ms without.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pan2cli.dit.row_kernels import check_token_rows, row_launch, row_tile


@triton.jit
def _gated_residual_kernel(
    X, UPDATE, GATE, OUT, ROW_SCALE, COL_SCALE, BIAS,
    n_rows, n_cols, rows_per_batch,
    stride_x_row, stride_update_row, stride_out_row, stride_gate_batch,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    SCALED: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):  # fmt: skip
    rows, cols, mask = row_tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    x = tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    update = tl.load(UPDATE + rows[:, None] * stride_update_row + cols[None, :], mask=mask, other=0.0)
    update = update.to(tl.float32)
    if SCALED:  # an fp8 product: raw · row scale · column scale (+ bias)
        col_ok = cols < n_cols
        row_scale = tl.load(ROW_SCALE + rows, mask=rows < n_rows, other=0.0)
        update = update * row_scale[:, None] * tl.load(COL_SCALE + cols, mask=col_ok, other=0.0)[None, :]
        if HAS_BIAS:
            update += tl.load(BIAS + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    gate_row = (rows // rows_per_batch) * stride_gate_batch
    gate = tl.load(GATE + gate_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = x + update * gate
    tl.store(OUT + rows[:, None] * stride_out_row + cols[None, :], y.to(OUT.dtype.element_ty), mask=mask)


def gated_residual(
    x: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor,
    out: torch.Tensor,
    *,
    row_scale: torch.Tensor | None = None,
    col_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    block_rows: int | None = None,
    num_warps: int | None = None,
) -> None:
    """`out = x + gate · update`, computed in float32; with `row_scale` and `col_scale`, `out = x + gate ·
    (update · row_scale · col_scale + bias)` (an fp8 product, module docstring).

    Args:
        x, update: `[B, N, D]`, rows contiguous (`stride(-1) == 1`) and flattenable to `[B·N, D]`.
        row_scale: `[B, N]` float32 contiguous, or None; col_scale: `[D]` float32 (with row_scale);
            bias: `[D]` (any float dtype) or None.
        gate: `[B, D]` (any float dtype, read as float32), `stride(-1) == 1`, batch stride free (0 broadcasts).
        out: like x (dtype of x), same layout rules; may be x itself.
        block_rows, num_warps: launch shape; default rows so that a program holds ~8192 elements, and
            `elements / 1024` warps clamped to [1, 8].
    """
    assert x.dim() == 3 and update.shape == x.shape, (
        f"x {tuple(x.shape)} and update {tuple(update.shape)} must be equal [B, N, D]"
    )
    batch, n_tokens, dim = x.shape
    assert gate.shape == (batch, dim) and gate.stride(1) == 1, f"gate must be [{batch}, {dim}] along D"
    assert out.shape == x.shape and out.dtype == x.dtype, "out must match x in shape and dtype"
    check_token_rows(batch, n_tokens, x=x, update=update, out=out)
    scaled = row_scale is not None
    if scaled:
        assert row_scale.shape == (batch, n_tokens) and row_scale.dtype == torch.float32, "row_scale: [B, N]"
        assert row_scale.is_contiguous() and col_scale is not None and col_scale.shape == (dim,), (
            "col_scale: [D]"
        )
        assert col_scale.dtype == torch.float32 and (bias is None or bias.shape == (dim,)), "bias: [D]"
    n_rows = batch * n_tokens
    if n_rows == 0:
        return
    grid, block_rows, block_cols, num_warps = row_launch(n_rows, dim, block_rows, num_warps)
    _gated_residual_kernel[grid](
        x, update, gate, out,
        row_scale if scaled else gate, col_scale if scaled else gate, bias if bias is not None else gate,
        n_rows, dim, n_tokens,
        x.stride(1), update.stride(1), out.stride(1), gate.stride(0),
        BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, SCALED=scaled, HAS_BIAS=bias is not None,
        num_warps=num_warps,
    )  # fmt: skip
