"""Triton kernel: LayerNorm (no affine) + AdaLN modulation `LN(x)·(1 + scale) + shift`, one pass over x.

Each program takes `BLOCK_ROWS` whole rows (the row lives in registers, so x is read once and y written
once). Scale and shift come per group of consecutive tokens: one group per sample (per-sample
modulation), per latent frame, or per token; a row's group is `row // rows_per_group`, so every case is
the same kernel and per-sample rows re-read one cached modulation row.

Numerics: mean and variance in float32 from the row held in registers (two-pass, no cancellation),
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

from pan2cli.dit.row_kernels import check_token_rows, quantize_rows, row_launch, row_tile


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
):  # fmt: skip
    rows, cols, mask = row_tile(n_rows, n_cols, BLOCK_ROWS, BLOCK_COLS)
    x = tl.load(X + rows[:, None] * stride_x_row + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    mean = tl.sum(x, axis=1) / n_cols
    centred = tl.where(mask, x - mean[:, None], 0.0)
    var = tl.sum(centred * centred, axis=1) / n_cols
    normed = centred * tl.rsqrt(var + eps)[:, None]
    group = rows // rows_per_group
    batch = group // groups_per_batch
    group = group % groups_per_batch
    scale_row = batch * stride_scale_batch + group * stride_scale_group
    shift_row = batch * stride_shift_batch + group * stride_shift_group
    scale = tl.load(SCALE + scale_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    shift = tl.load(SHIFT + shift_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    y = normed * (1.0 + scale) + shift
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
    if quantize:  # one row a program: the quantising kernel ran at 0.98 TB/s with two (H200, D = 4096)
        block_rows = block_rows or 1
    grid, block_rows, block_cols, num_warps = row_launch(n_rows, dim, block_rows, num_warps)
    _layer_norm_modulate_kernel[grid](
        x, out, scale, shift, out_scale if quantize else scale,
        n_rows, dim, n_tokens // groups, groups,
        x.stride(1), out.stride(1),
        scale.stride(0), scale.stride(1), shift.stride(0), shift.stride(1),
        eps,
        BLOCK_ROWS=block_rows, BLOCK_COLS=block_cols, QUANTIZE=quantize,
        num_warps=num_warps,
    )  # fmt: skip
