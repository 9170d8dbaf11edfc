"""Triton kernel: the gated residual `x + gate·update` in float32, rounded once to the dtype of x.

Eager PyTorch spends five passes over the activations on it (x and update up-cast, addcmul, down-cast);
this is one pass: x and update read once, the result written once. Each program takes `BLOCK_ROWS`
whole rows; the gate is one row per sample (`[B, D]`, batch stride free: the text stream's gate is
one table broadcast over the batch).

Numerics: float32 products and sums (`x + update·gate`, which the compiler may contract to one FMA: a
float32 rounding difference at most), one rounding per output element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pan2cli.dit.row_kernels import check_token_rows, row_launch, row_tile


@triton.jit
def _gated_residual_kernel(
    X, UPDATE, GATE, OUT,
    n_rows, n_cols, rows_per_batch,
    stride_x_row, stride_update_row, stride_out_row, stride_gate_batch,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):  # fmt: skip
    rows, cols, mask = row_tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    x = tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    update = tl.load(UPDATE + rows[:, None] * stride_update_row + cols[None, :], mask=mask, other=0.0)
    gate_row = (rows // rows_per_batch) * stride_gate_batch
    gate = tl.load(GATE + gate_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = x + update.to(tl.float32) * gate
    tl.store(OUT + rows[:, None] * stride_out_row + cols[None, :], y.to(OUT.dtype.element_ty), mask=mask)


def gated_residual(
    x: torch.Tensor,
    update: torch.Tensor,
    gate: torch.Tensor,
    out: torch.Tensor,
    *,
    block_rows: int | None = None,
    num_warps: int | None = None,
) -> None:
    """`out = x + gate · update`, computed in float32.

    Args:
        x, update: `[B, N, D]`, rows contiguous (`stride(-1) == 1`) and flattenable to `[B·N, D]`.
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
    n_rows = batch * n_tokens
    if n_rows == 0:
        return
    grid, block_rows, block_cols, num_warps = row_launch(n_rows, dim, block_rows, num_warps)
    _gated_residual_kernel[grid](
        x, update, gate, out,
        n_rows, dim, n_tokens,
        x.stride(1), update.stride(1), out.stride(1), gate.stride(0),
        BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
        num_warps=num_warps,
    )  # fmt: skip
