"""What the row-wise Triton kernels share (LayerNorm + modulation, the gated residual): the `[B·N, D]` layout
check and the launch shape, whole rows per program so that a row is read once and stays in registers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pan2cli.triton_support import triton_interpreting


def check_token_rows(batch: int, n_tokens: int, **tensors: torch.Tensor) -> None:
    """Each tensor `[B, N, D]` flattenable to `[B·N, D]` rows without a copy, on CUDA (or interpreted)."""
    for name, t in tensors.items():
        assert t.stride(2) == 1 and (batch == 1 or t.stride(0) == n_tokens * t.stride(1)), (
            f"{name} must be [B·N, D] rows"
        )
        assert t.is_cuda or triton_interpreting(), f"{name} must be a CUDA tensor (or set TRITON_INTERPRET=1)"


def row_launch(
    n_rows: int, dim: int, block_rows: int | None, num_warps: int | None
) -> tuple[tuple[int], int, int, int]:
    """(grid, BLOCK_ROWS, BLOCK_COLS, num_warps): by default rows so that a program holds ~8192 elements
    (2 rows at D = 4096), and `elements / 1024` warps clamped to [1, 8]."""
    block_cols = triton.next_power_of_2(dim)
    block_rows = block_rows or max(1, min(64, 8192 // block_cols))
    assert block_rows & (block_rows - 1) == 0, f"block_rows {block_rows} must be a power of two"
    warps = num_warps or min(8, max(1, block_rows * block_cols // 1024))
    return (triton.cdiv(n_rows, block_rows),), block_rows, block_cols, warps


@triton.jit
def row_tile(n_rows, n_cols, BLOCK_ROWS: tl.constexpr, BLOCK_COLS: tl.constexpr):
    """This program's rows (int64: B·N·D passes 2^31), the columns, and the mask of the valid elements."""
    rows = (tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
    cols = tl.arange(0, BLOCK_COLS)
    return rows, cols, (rows < n_rows)[:, None] & (cols < n_cols)[None, :]


E4M3_MAX = tl.constexpr(448.0)  # the largest finite float8_e4m3fn


@triton.jit
def quantize_rows(y, mask, SCALE_OUT, rows, row_ok):
    """Per-row e4m3 quantisation of the float32 tile `y` `[ROWS, COLS]`: writes each row's scale m/448 (m its
    absolute maximum; 1 for an all-zero row, NaN for a row holding NaN or Inf) to `SCALE_OUT[rows]` and
    returns `y · 448/m` clamped to ±448, ready for one rounding to e4m3."""
    # NaN ≠ NaN: a NaN counts as Inf, so one max finds both (max reductions may drop NaNs themselves).
    magnitude = tl.where(mask, tl.where(y == y, tl.abs(y), float("inf")), 0.0)
    amax = tl.max(magnitude, axis=1)
    bad = amax == float("inf")
    scale = tl.where(bad, float("nan"), tl.where(amax > 0.0, amax / E4M3_MAX, 1.0))
    tl.store(SCALE_OUT + rows, scale, mask=row_ok)
    inverse = tl.where(amax > 0.0, E4M3_MAX / tl.maximum(amax, 1e-30), 1.0)  # no 1/0, even where unused
    return tl.minimum(tl.maximum(y * inverse[:, None], -E4M3_MAX), E4M3_MAX)
