"""Triton kernel: per-head RMSNorm of q and k plus 3D RoPE, one pass, writing into the joint buffer.

Each program takes `BLOCK_ROWS` (token, head) rows of one stream and handles both q and k for them, so the
RoPE table rows and the norm weights are loaded once for both. A row is loaded as the two members of its
channel pairs — channels (2i, 2i+1) for PAN 2's interleaved (GPT-J) pairs, or the two contiguous halves
(i, i + head_dim/2) — normalised and rotated in float32, rounded once to the output dtype, and stored at
`out_token_offset + token` of the joint `[B, S, H, head_dim]` output: the concatenation of the video and
text streams costs no extra pass. Rows are loaded and stored whole (vector accesses); the interleaved pairs
are split and joined in registers.

Numerics: sum of squares and every product in float32; `rsqrt` is the hardware approximation (≤ 2 ulp)
on GPUs; one rounding per output element.

For the fp8 tier the outputs may be float8_e4m3fn: each row is then multiplied by a fixed factor per
tensor (`q_out_mult`, `k_out_mult`: 448 over a bound of every element, see `pan2cli.dit.fp8`), clamped to
±448 and rounded once to e4m3 (nearest even).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pan2cli.triton_support import triton_interpreting


@triton.jit
def _norm_rope_tile(
    X, OUT, W, x_row, out_row, mask, c, s, eps, out_mult,
    HALF: tl.constexpr, BLOCK_ROWS: tl.constexpr, ROTATE: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """Normalise (and rotate) one `[BLOCK_ROWS, head_dim]` tile of X into OUT; c/s: `[BLOCK_ROWS, HALF]`."""
    if INTERLEAVED:
        # Whole rows, contiguous (16-byte vector loads), then split into the (2i, 2i+1) pairs in registers:
        # two stride-2 gathers instead cost 8-16x the HBM floor on an H200 (scripts/bench_kernels.py dit-fusions).
        cols = tl.arange(0, 2 * HALF)
        x = tl.load(X + x_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x1, x2 = tl.split(tl.reshape(x, (BLOCK_ROWS, HALF, 2)))
        w1, w2 = tl.split(tl.reshape(tl.load(W + cols).to(tl.float32), (HALF, 2)))
    else:  # the two contiguous halves
        cols = tl.arange(0, HALF)
        x1 = tl.load(X + x_row[:, None] + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(X + x_row[:, None] + HALF + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        w1 = tl.load(W + cols).to(tl.float32)
        w2 = tl.load(W + HALF + cols).to(tl.float32)
    mean_sq = (tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF)
    rstd = tl.rsqrt(mean_sq + eps)[:, None]
    y1 = x1 * rstd * w1[None, :]
    y2 = x2 * rstd * w2[None, :]
    if ROTATE:
        o1 = y1 * c - y2 * s
        o2 = y2 * c + y1 * s
    else:
        o1 = y1
        o2 = y2
    if OUT.dtype.element_ty == tl.float8e4nv:
        o1 = tl.minimum(tl.maximum(o1 * out_mult, -448.0), 448.0)
        o2 = tl.minimum(tl.maximum(o2 * out_mult, -448.0), 448.0)
    if INTERLEAVED:
        out = tl.reshape(tl.join(o1, o2), (BLOCK_ROWS, 2 * HALF))
        tl.store(OUT + out_row[:, None] + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)
    else:
        tl.store(OUT + out_row[:, None] + cols[None, :], o1.to(OUT.dtype.element_ty), mask=mask)
        tl.store(OUT + out_row[:, None] + HALF + cols[None, :], o2.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    Q, K, Q_OUT, K_OUT, Q_WEIGHT, K_WEIGHT, COS, SIN,
    n_rows, n_heads, n_tokens, out_token_offset,
    stride_q_batch, stride_q_token, stride_k_batch, stride_k_token,
    stride_out_batch, stride_out_token,
    eps, q_out_mult, k_out_mult,
    HALF: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    ROTATE: tl.constexpr,
    INTERLEAVED: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)  # flat (batch, token, head) index
    row_ok = rows < n_rows
    head = rows % n_heads
    token = (rows // n_heads) % n_tokens
    batch = rows // (n_heads * n_tokens)
    # int64 offsets: B · S · H · head_dim passes 2^31 at batch ≥ 8 for PAN 2 shapes.
    token64 = token.to(tl.int64)
    batch64 = batch.to(tl.int64)
    head_off = head.to(tl.int64) * (2 * HALF)
    q_row = batch64 * stride_q_batch + token64 * stride_q_token + head_off
    k_row = batch64 * stride_k_batch + token64 * stride_k_token + head_off
    out_row = batch64 * stride_out_batch + (token64 + out_token_offset) * stride_out_token + head_off
    mask = row_ok[:, None]
    if ROTATE:
        table = token64[:, None] * HALF + tl.arange(0, HALF)[None, :]
        c = tl.load(COS + table, mask=mask, other=1.0)
        s = tl.load(SIN + table, mask=mask, other=0.0)
    else:
        c = 1.0
        s = 0.0
    _norm_rope_tile(
        Q, Q_OUT, Q_WEIGHT, q_row, out_row, mask, c, s, eps, q_out_mult, HALF, BLOCK_ROWS, ROTATE, INTERLEAVED
    )
    _norm_rope_tile(
        K, K_OUT, K_WEIGHT, k_row, out_row, mask, c, s, eps, k_out_mult, HALF, BLOCK_ROWS, ROTATE, INTERLEAVED
    )


def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    q_out: torch.Tensor,
    k_out: torch.Tensor,
    *,
    eps: float,
    interleaved: bool = True,
    out_token_offset: int = 0,
    q_out_mult: float = 1.0,
    k_out_mult: float = 1.0,
    block_rows: int | None = None,
    num_warps: int | None = None,
) -> None:
    """RMSNorm each head of q and k (and rotate them when `cos` is given), writing into `q_out`/`k_out`.

    Args:
        q, k: `[B, N, H, head_dim]`, same shape and dtype; the `[H, head_dim]` block of a token must be
            contiguous (views of a projection's output are); batch and token strides are free.
        q_weight, k_weight: `[head_dim]` RMSNorm weights (any float dtype, read as float32).
        cos, sin: `[N, head_dim/2]` float32 contiguous tables from `rope.rope_table`, or both None (no
            rotation: text tokens).
        q_out, k_out: `[B, S, H, head_dim]` (S ≥ out_token_offset + N), dtype of q (or both float8_e4m3fn),
            same strides as each other, `[H, head_dim]` contiguous; rows `out_token_offset : out_token_offset + N`
            are written.
        eps: RMSNorm epsilon.
        interleaved: RoPE pairs are channels (2i, 2i+1) (PAN 2) rather than (i, i + head_dim/2).
        out_token_offset: first output token of this stream.
        q_out_mult, k_out_mult: factors applied before a float8 output's cast (module docstring); unused else.
        block_rows, num_warps: launch shape; default `2048 // head_dim` rows (≥ 1, ≤ 64) and 4 warps.
    """
    assert q.dim() == 4 and q.shape == k.shape, (
        f"q {tuple(q.shape)} and k {tuple(k.shape)} must be equal [B, N, H, D]"
    )
    batch, n_tokens, n_heads, head_dim = q.shape
    half = head_dim // 2
    assert head_dim >= 2 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} must be a power of two"
    assert q.dtype == k.dtype and q_out.dtype == k_out.dtype, "q and k, q_out and k_out must share a dtype"
    assert q_out.dtype in (q.dtype, torch.float8_e4m3fn), "q_out must have the dtype of q, or float8_e4m3fn"
    for name, t in (("q", q), ("k", k), ("q_out", q_out), ("k_out", k_out)):
        assert t.stride(3) == 1 and t.stride(2) == head_dim, (
            f"{name}: each token's [H, head_dim] block must be contiguous"
        )
        assert t.is_cuda or triton_interpreting(), f"{name} must be a CUDA tensor (or set TRITON_INTERPRET=1)"
    assert q_out.shape == k_out.shape and q_out.stride() == k_out.stride(), (
        "q_out and k_out must share shape and strides"
    )
    assert q_out.shape[0] == batch and q_out.shape[2:] == q.shape[2:], (
        f"q_out {tuple(q_out.shape)} does not fit q"
    )
    assert 0 <= out_token_offset and out_token_offset + n_tokens <= q_out.shape[1], "output rows out of range"
    assert q_weight.shape == k_weight.shape == (head_dim,), f"norm weights must be [{head_dim}]"
    rotate = cos is not None
    if rotate:
        assert sin is not None and cos.shape == sin.shape == (n_tokens, half), (
            f"cos/sin must be [{n_tokens}, {half}], got {tuple(cos.shape)}/{tuple(sin.shape)}"
        )
        assert cos.dtype == sin.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous(), (
            "cos/sin must be contiguous float32"
        )
    n_rows = batch * n_tokens * n_heads
    if n_rows == 0:
        return
    # 16 rows of 128 at 4 warps: 0.427 ms = 1.02x the HBM floor on an H200 (32 rows: 0.481; the dit-fusions benchmark's sweep)
    block_rows = block_rows or max(1, min(64, 2048 // head_dim))
    assert block_rows & (block_rows - 1) == 0, f"block_rows {block_rows} must be a power of two"
    grid = (triton.cdiv(n_rows, block_rows),)
    _qk_norm_rope_kernel[grid](
        q, k, q_out, k_out, q_weight, k_weight,
        cos if rotate else q_weight, sin if rotate else q_weight,  # unused pointers when not rotating
        n_rows, n_heads, n_tokens, out_token_offset,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1),
        eps, float(q_out_mult), float(k_out_mult),
        HALF=half, BLOCK_ROWS=block_rows, ROTATE=rotate, INTERLEAVED=interleaved,
        num_warps=num_warps or 4,
    )  # fmt: skip
