"""Triton kernel: LayerNorm (no affine) + AdaLN modulation `LN(x)·(1 + scale) + shift`, one pass over x.

Each program takes `BLOCK_ROWS` whole rows (the row lives in registers, so x is read once and y written
once), or several such tiles in turn where they share a modulation row (the fp8 tier's default: the float32
modulation row, twice x's bytes, is then read once a program instead of once a row). Scale and shift come
per group of consecutive tokens: one group per sample (per-sample modulation), per latent frame, or per
token; a row's group is `row // rows_per_group`, so every case is the same kernel and per-sample rows
re-read one cached modulation row.

Numerics: mean and variance in float32 from the row held in registers (two-pass, no cancellation, each sum
times one rounded 1/D),
`rsqrt` the hardware approximation on GPUs, modulation in float32, one rounding per output element.

With a float8_e4m3fn `out` (the fp8 tier) the kernel also quantises: each row's absolute maximum m gives
its scale m/448 (written to `out_scale`; 1 for an all-zero row), the row is multiplied by 448/m, clamped to
±448 and rounded once to e4m3 (nearest even). A row holding NaN or Inf gets a NaN scale, which the fp8
GEMM carries into its output (`pan2cli.dit.fp8` says how the sampler reports it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pan2cli.dit.row_kernels import check_token_rows, quantize_rows, row_launch

# The quantising kernel's launch (measured on an H200 at D = 4096; 4 warps keep the rounding of one row a
# program): tiles of 4 rows, 4 tiles a program where they share one modulation row, read once for them.
QUANTIZE_BLOCK_ROWS, QUANTIZE_WARPS, QUANTIZE_ROW_STEPS = 4, 4, 4


@triton.jit
def _modulation_row(rows, rows_per_group, groups_per_batch, stride_batch, stride_group):
    """The offset of the modulation row (scale or shift) that rows `rows` use: their sample's, their group's."""
    group = rows // rows_per_group
    return (group // groups_per_batch) * stride_batch + (group % groups_per_batch) * stride_group


@triton.jit
def _layer_norm_modulate_kernel(
    X, Y, SCALE, SHIFT, Y_SCALE,
    n_rows, n_cols, rows_per_group, groups_per_batch,
    stride_x_row, stride_y_row,
    stride_scale_batch, stride_scale_group, stride_shift_batch, stride_shift_group,
    eps,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
    QUANTIZE: tl.constexpr,
    ROW_STEPS: tl.constexpr,
):  # fmt: skip
    # A program takes ROW_STEPS tiles of BLOCK_ROWS rows; with ROW_STEPS > 1 all its rows share one
    # modulation row (the launcher checks), read once into registers instead of once a row.
    first_row = tl.program_id(0) * BLOCK_ROWS * ROW_STEPS
    cols = tl.arange(0, BLOCK_COLS)
    # 1/D once, then multiplications: Triton's float32 `/` is the fast division, which the compiler may turn
    # into a reciprocal and a multiply inside the ROW_STEPS loop only (a one-ulp difference in the mean that
    # moved the row scales of one launch shape against another's on an H100). Written out, every launch
    # shape rounds the same way.
    inv_n = 1.0 / n_cols.to(tl.float32)
    if ROW_STEPS > 1:
        col_ok = cols < n_cols
        scale_at = _modulation_row(
            first_row, rows_per_group, groups_per_batch, stride_scale_batch, stride_scale_group
        )
        shift_at = _modulation_row(
            first_row, rows_per_group, groups_per_batch, stride_shift_batch, stride_shift_group
        )
        scale_1 = 1.0 + tl.load(SCALE + scale_at + cols, mask=col_ok, other=0.0).to(tl.float32)
        shift = tl.load(SHIFT + shift_at + cols, mask=col_ok, other=0.0).to(tl.float32)
    for step in range(ROW_STEPS):
        rows = (first_row + step * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)).to(tl.int64)
        mask = (rows < n_rows)[:, None] & (cols < n_cols)[None, :]
        x = tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        mean = tl.sum(x, axis=1) * inv_n
        centred = tl.where(mask, x - mean[:, None], 0.0)
        var = tl.sum(centred * centred, axis=1) * inv_n
        normed = centred * tl.rsqrt(var + eps)[:, None]
        if ROW_STEPS > 1:
            y = normed * scale_1[None, :] + shift[None, :]
        else:
            scale_row = _modulation_row(
                rows, rows_per_group, groups_per_batch, stride_scale_batch, stride_scale_group
            )
            shift_row = _modulation_row(
                rows, rows_per_group, groups_per_batch, stride_shift_batch, stride_shift_group
            )
            row_scale = tl.load(SCALE + scale_row[:, None] + cols[None, :], mask=mask, other=0.0)
            row_shift = tl.load(SHIFT + shift_row[:, None] + cols[None, :], mask=mask, other=0.0)
            y = normed * (1.0 + row_scale.to(tl.float32)) + row_shift.to(tl.float32)
        if QUANTIZE:
            y = quantize_rows(y, mask, Y_SCALE, rows, rows < n_rows)
        tl.store(Y + rows[:, None] * stride_y_row + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


def layer_norm_modulate(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    out: torch.Tensor,
    *,
    eps: float,
    out_scale: torch.Tensor | None = None,
    block_rows: int | None = None,
    num_warps: int | None = None,
    row_steps: int | None = None,
) -> None:
    """`out = LayerNorm(x) · (1 + scale) + shift`, scale/shift per group of tokens (quantised for a float8 `out`).

    Args:
        x: `[B, N, D]`, rows contiguous (`stride(-1) == 1`) and flattenable to `[B·N, D]` without a copy.
        scale, shift: `[B, G, D]` (any float dtype, read as float32), G dividing N: G = 1 per sample,
            G = latent frames per frame, G = N per token; `stride(-1) == 1`, other strides free (a chunk
            of a wider modulation tensor is fine).
        out: like x (dtype of x, or float8_e4m3fn: quantised per row), same layout rules.
        eps: LayerNorm epsilon.
        out_scale: `[B·N]` float32, each row's scale, for a float8 `out` (module docstring); else None.
        block_rows, num_warps: launch shape; default rows so that a program holds ~8192 elements
            (1 row at D = 5120), and `elements / 1024` warps clamped to [1, 8].
            With a float8 `out`: 4 rows of up to 4096 (`QUANTIZE_BLOCK_ROWS`, fewer for wider rows), 4 warps.
        row_steps: tiles of `block_rows` a program takes in turn, reading the modulation once for them (default:
            `QUANTIZE_ROW_STEPS` for a float8 `out` where one modulation row covers them all, one sample or
            groups of a multiple of the rows a program takes; else 1).
    """
    assert x.dim() == 3 and scale.dim() == 3 and shift.dim() == 3, (
        "x, scale, shift must be [B, N, D], [B, G, D]"
    )
    batch, n_tokens, dim = x.shape
    groups = scale.shape[1]
    assert scale.shape == shift.shape == (batch, groups, dim), (
        f"scale {tuple(scale.shape)} and shift {tuple(shift.shape)} must be [{batch}, G, {dim}]"
    )
    assert groups >= 1 and n_tokens % groups == 0, (
        f"{groups} modulation groups do not divide {n_tokens} tokens"
    )
    quantize = out.dtype == torch.float8_e4m3fn
    assert out.shape == x.shape and (quantize or out.dtype == x.dtype), "out must match x in shape and dtype"
    assert (out_scale is not None) == quantize, "out_scale goes with a float8_e4m3fn out, and only with it"
    assert not quantize or (out_scale.shape == (batch * n_tokens,) and out_scale.dtype == torch.float32)
    check_token_rows(batch, n_tokens, x=x, out=out)
    assert scale.stride(2) == 1 and shift.stride(2) == 1, "scale and shift must be contiguous along D"
    n_rows = batch * n_tokens
    if n_rows == 0:
        return
    rows_per_group = n_tokens // groups
    if quantize:  # H200, D = 4096, 26,598 rows: 0.135 ms, against 0.20-0.23 for one or two rows a program
        # wider rows: fewer a tile, as many values a thread
        wide = max(1, triton.next_power_of_2(dim) // 4096)
        block_rows = block_rows or max(1, QUANTIZE_BLOCK_ROWS // wide)
        num_warps = num_warps or QUANTIZE_WARPS
    _, block_rows, block_cols, num_warps = row_launch(n_rows, dim, block_rows, num_warps)
    one_row = batch * groups == 1 or rows_per_group % (block_rows * (row_steps or QUANTIZE_ROW_STEPS)) == 0
    if row_steps is None:
        row_steps = QUANTIZE_ROW_STEPS if quantize and one_row else 1
    assert row_steps == 1 or one_row, f"{row_steps} steps of {block_rows} rows straddle modulation groups"
    grid = (triton.cdiv(n_rows, block_rows * row_steps),)
    _layer_norm_modulate_kernel[grid](
        x, out, scale, shift, out_scale if quantize else scale,
        n_rows, dim, rows_per_group, groups,
        x.stride(1), out.stride(1),
        scale.stride(0), scale.stride(1), shift.stride(0), shift.stride(1),
        eps,
        BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, QUANTIZE=quantize, ROW_STEPS=row_steps,
        num_warps=num_warps,
    )  # fmt: skip
