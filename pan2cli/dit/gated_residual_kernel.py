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

from pan2cli.triton_support import triton_interpreting


@triton.jit
def _gated_residual_kernel(
    X, UPDATE, GATE, OUT,
    n_rows, n_cols, rows_per_batch,
    stride_x_row, stride_update_row, stride_out_row, stride_gate_batch,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = (pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_COLS)
    mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
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
    for name, t in (("x", x), ("update", update), ("out", out)):
        assert t.stride(2) == 1 and (batch == 1 or t.stride(0) == n_tokens * t.stride(1)), (
            f"{name} must be [B·N, D] rows"
        )
        assert t.is_cuda or triton_interpreting(), f"{name} must be a CUDA tensor (or set TRITON_INTERPRET=1)"
    n_rows = batch * n_tokens
    if n_rows == 0:
        return
    block_cols = triton.next_power_of_2(dim)
    block_rows = block_rows or max(1, min(64, 8192 // block_cols))
    assert block_rows & (block_rows - 1) == 0, f"block_rows {block_rows} must be a power of two"
    grid = (triton.cdiv(n_rows, block_rows),)
    _gated_residual_kernel[grid](
        x, update, gate, out,
        n_rows, dim, n_tokens,
        x.stride(1), update.stride(1), out.stride(1), gate.stride(0),
        BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols,
        num_warps=num_warps or min(8, max(1, block_rows * block_cols // 1024)),
    )  # fmt: skip
