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
±448 and rounded once to e4m3 (nearest even). Before that cast, the fp8 attention's two exact
transformations (`pan2cli.dit.fp8_attention`), in float32 after RoPE:

* K smoothing (`k_mean`): a mean of K over the joint tokens of its (batch, head) is subtracted from every K
  row. It is taken over every `K_MEAN_STRIDE`-th token of each stream (`k_mean_tokens`): any vector
  subtracted from every key leaves the softmax as it was, and what the smoothing is for, a part that the keys
  share, is measured as well from a quarter of them as from all (its error, σ/√(N/4), is under 2 % of one
  key's own part at 121 frames). The mean comes from a first pass, `_k_sums_kernel` (`k_token_sums`): each
  program normalises and rotates `SUM_TOKENS_PER_PROGRAM` of the sampled tokens of one (batch, head) as the
  main pass does and writes their float32 sum to its own row of a partial buffer (`[blocks, B, H,
  head_dim]`), which `partial.sum(0)` adds up in a fixed order: no atomics, the same mean on every run. It
  reads a quarter of K in bf16, against the main pass's whole Q and K and their e4m3 output: 4.2 ms of an fp8
  CFG step at 121 frames on an H100, against 12.9 ms over every token.
* the Hadamard rotation (`hadamard`): each row times the ±1 Sylvester matrix, built in registers once a
  program (`_hadamard_signs`: the parity of popcount(i & j)) and used for the q and k of its `TILES` tiles,
  with the 1/√head_dim folded into the output factor. The product runs on the tensor cores (`tl.dot`):
  operands in float16, the row already multiplied by its factor, so every operand is at most 448/√head_dim
  (the fixed scales bound the rotated row's length, `pan2cli.dit.fp8`) and is rounded to 11 significant
  bits (2⁻¹¹ relative, 128 times finer than e4m3's 2⁻⁴; the ±1 entries are exact), summed in float32.
  That is 2·head_dim² flops a row, 56 GFLOP a call at 121 frames for Q and K: about 0.1 ms of tensor-core
  time at 600 TFLOP/s, which overlaps the pass's memory traffic (an estimate, not yet measured). head_dim
  16 to 128 only (`pan2cli.dit.fp8.hadamard_rotates` says why); the caller leaves other sizes unrotated.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pan2cli.dit.fp8 import K_MEAN_STRIDE, k_mean_tokens
from pan2cli.triton_support import triton_interpreting

# The rotating kernel's launch (rows a tile, tiles a program, warps), swept on an H100 80GB at 121 frames (26,898
# tokens, 32 heads, e4m3 out, K smoothed; every shape of 16-64 rows x 1-4 tiles x 4-8 warps): 64 rows, one
# tile, 4 warps 0.792 ms a call for norm, RoPE, K's mean and the rotation of Q and K, against 1.2 ms for 16 x 4 x
# 8 and 0.323 ms without the mean and the rotation (the tensor cores' 64-row tiles amortise the ±1 matrix).
HADAMARD_LAUNCH = (64, 1, 4)


@triton.jit
def _normed_rows(
    X, W, x_row, mask, c, s, eps,
    HALF: tl.constexpr, BLOCK_ROWS: tl.constexpr, ROTATE: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """RMSNorm (and RoPE) of `BLOCK_ROWS` rows of X in float32 → the two members of each channel pair, `o1`
    and `o2`, each `[BLOCK_ROWS, HALF]` (channels 2i and 2i+1, or i and i + HALF); c/s: `[BLOCK_ROWS, HALF]`.
    Masked rows read as 0 (and come out 0 for eps > 0)."""
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
        return y1 * c - y2 * s, y2 * c + y1 * s
    return y1, y2


@triton.jit
def _rope_rows(COS, SIN, token64, mask, HALF: tl.constexpr, ROTATE: tl.constexpr):
    """The RoPE cos/sin of the tokens `token64` (`[BLOCK_ROWS, HALF]`), or 1 and 0 where there is no rotation."""
    if ROTATE:
        table = token64[:, None] * HALF + tl.arange(0, HALF)[None, :]
        c = tl.load(COS + table, mask=mask, other=1.0)
        s = tl.load(SIN + table, mask=mask, other=0.0)
    else:  # one return for both: Triton wants a function's returns of one type
        c = 1.0
        s = 0.0
    return c, s


@triton.jit
def _whole_rows(o1, o2, HALF: tl.constexpr, BLOCK_ROWS: tl.constexpr, INTERLEAVED: tl.constexpr):
    """The pair members joined into `[BLOCK_ROWS, 2·HALF]` rows in channel order."""
    if INTERLEAVED:
        return tl.reshape(tl.join(o1, o2), (BLOCK_ROWS, 2 * HALF))
    return tl.reshape(tl.permute(tl.join(o1, o2), (0, 2, 1)), (BLOCK_ROWS, 2 * HALF))


@triton.jit
def _hadamard_signs(D: tl.constexpr):
    """The ±1 Sylvester–Hadamard matrix `[D, D]` in float16 (exact): (−1)^popcount(i & j), the parity of
    popcount by folding the bits (D ≤ 256: 8 bits)."""
    i = tl.arange(0, D)
    bits = i[:, None] & i[None, :]
    bits = bits ^ (bits >> 4)
    bits = bits ^ (bits >> 2)
    bits = bits ^ (bits >> 1)
    return tl.where((bits & 1) == 0, 1.0, -1.0).to(tl.float16)


@triton.jit
def _norm_rope_tile(
    X, OUT, W, MEAN, x_row, out_row, mean_row, mask, c, s, eps, out_mult, signs,
    HALF: tl.constexpr, BLOCK_ROWS: tl.constexpr, ROTATE: tl.constexpr, INTERLEAVED: tl.constexpr,
    SMOOTH: tl.constexpr, HADAMARD: tl.constexpr,
):  # fmt: skip
    """Normalise (and rotate) one `[BLOCK_ROWS, head_dim]` tile of X into OUT; c/s: `[BLOCK_ROWS, HALF]`.

    With SMOOTH, each row's `MEAN + mean_row` (`[head_dim]` float32) is subtracted after RoPE; with HADAMARD,
    the row (times out_mult/√head_dim, in float16) is multiplied by the ±1 matrix `signs` on the tensor
    cores with float32 sums (module docstring)."""
    o1, o2 = _normed_rows(X, W, x_row, mask, c, s, eps, HALF, BLOCK_ROWS, ROTATE, INTERLEAVED)
    if SMOOTH or HADAMARD:
        cols = tl.arange(0, 2 * HALF)
        y = _whole_rows(o1, o2, HALF, BLOCK_ROWS, INTERLEAVED)
        if SMOOTH:
            y -= tl.load(MEAN + mean_row[:, None] + cols[None, :], mask=mask, other=0.0)
        if HADAMARD:
            y = tl.dot((y * out_mult).to(tl.float16), signs, out_dtype=tl.float32)
        elif OUT.dtype.element_ty == tl.float8e4nv:
            y = y * out_mult
        if OUT.dtype.element_ty == tl.float8e4nv:
            y = tl.minimum(tl.maximum(y, -448.0), 448.0)
        tl.store(OUT + out_row[:, None] + cols[None, :], y.to(OUT.dtype.element_ty), mask=mask)
        return
    if OUT.dtype.element_ty == tl.float8e4nv:
        o1 = tl.minimum(tl.maximum(o1 * out_mult, -448.0), 448.0)
        o2 = tl.minimum(tl.maximum(o2 * out_mult, -448.0), 448.0)
    if INTERLEAVED:
        cols = tl.arange(0, 2 * HALF)
        out = tl.reshape(tl.join(o1, o2), (BLOCK_ROWS, 2 * HALF))
        tl.store(OUT + out_row[:, None] + cols[None, :], out.to(OUT.dtype.element_ty), mask=mask)
    else:
        cols = tl.arange(0, HALF)
        tl.store(OUT + out_row[:, None] + cols[None, :], o1.to(OUT.dtype.element_ty), mask=mask)
        tl.store(OUT + out_row[:, None] + HALF + cols[None, :], o2.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _qk_norm_rope_kernel(
    Q, K, Q_OUT, K_OUT, Q_WEIGHT, K_WEIGHT, COS, SIN, K_MEAN,
    n_rows, n_heads, n_tokens, out_token_offset,
    stride_q_batch, stride_q_token, stride_k_batch, stride_k_token,
    stride_out_batch, stride_out_token,
    eps, q_out_mult, k_out_mult,
    HALF: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    ROTATE: tl.constexpr,
    INTERLEAVED: tl.constexpr,
    SMOOTH_K: tl.constexpr,
    HADAMARD: tl.constexpr,
    TILES: tl.constexpr,
):  # fmt: skip
    if HADAMARD:
        signs = _hadamard_signs(2 * HALF)  # built once a program, used for the q and k of its TILES tiles
    else:
        signs = 0.0
    for tile in range(TILES):  # a loop of one tile is folded away: the plain kernel's code as it was
        first = (tl.program_id(0) * TILES + tile) * BLOCK_ROWS
        rows = first + tl.arange(0, BLOCK_ROWS)  # flat (batch, token, head) index
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
        mean_row = batch64 * (n_heads * 2 * HALF) + head_off  # K_MEAN: [B, H, head_dim]
        mask = row_ok[:, None]
        c, s = _rope_rows(COS, SIN, token64, mask, HALF, ROTATE)
        _norm_rope_tile(
            Q, Q_OUT, Q_WEIGHT, K_MEAN, q_row, out_row, mean_row, mask, c, s, eps, q_out_mult, signs,
            HALF, BLOCK_ROWS, ROTATE, INTERLEAVED, False, HADAMARD,
        )  # fmt: skip
        _norm_rope_tile(
            K, K_OUT, K_WEIGHT, K_MEAN, k_row, out_row, mean_row, mask, c, s, eps, k_out_mult, signs,
            HALF, BLOCK_ROWS, ROTATE, INTERLEAVED, SMOOTH_K, HADAMARD,
        )  # fmt: skip


@triton.jit
def _k_sums_kernel(
    K, K_WEIGHT, COS, SIN, PARTIAL,
    n_tokens, n_heads, n_batch, block_offset, stride_k_batch, stride_k_token, eps,
    HALF: tl.constexpr, BLOCK_ROWS: tl.constexpr, TOKENS_PER_PROGRAM: tl.constexpr, TOKEN_STRIDE: tl.constexpr,
    ROTATE: tl.constexpr, INTERLEAVED: tl.constexpr,
):  # fmt: skip
    """One program: the sum of the normalised (and rotated) K rows of `TOKENS_PER_PROGRAM` sampled tokens (every
    `TOKEN_STRIDE`-th) of one (batch, head), written to `PARTIAL[block_offset + program, batch, head, :]`
    (float32, channel order)."""
    block = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    # Summed element-wise over the tiles, across the rows once at the end: a sum across the rows a tile would
    # cross the warps (shared memory and a barrier) twice a tile.
    acc1 = tl.zeros([BLOCK_ROWS, HALF], tl.float32)
    acc2 = tl.zeros([BLOCK_ROWS, HALF], tl.float32)
    for start in range(0, TOKENS_PER_PROGRAM, BLOCK_ROWS):
        sample = block * TOKENS_PER_PROGRAM + start + tl.arange(0, BLOCK_ROWS)
        token64 = sample.to(tl.int64) * TOKEN_STRIDE
        mask = (token64 < n_tokens)[:, None]
        k_row = batch.to(tl.int64) * stride_k_batch + token64 * stride_k_token + head * (2 * HALF)
        c, s = _rope_rows(COS, SIN, token64, mask, HALF, ROTATE)
        o1, o2 = _normed_rows(K, K_WEIGHT, k_row, mask, c, s, eps, HALF, BLOCK_ROWS, ROTATE, INTERLEAVED)
        acc1 += tl.where(mask, o1, 0.0)  # rows past the stream: 0 (even with eps = 0)
        acc2 += tl.where(mask, o2, 0.0)
    row = ((block_offset + block).to(tl.int64) * n_batch + batch) * n_heads + head
    sums = _whole_rows(tl.sum(acc1, axis=0)[None, :], tl.sum(acc2, axis=0)[None, :], HALF, 1, INTERLEAVED)
    tl.store(PARTIAL + row * (2 * HALF) + tl.arange(0, 2 * HALF)[None, :], sums)


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
    k_mean: torch.Tensor | None = None,
    hadamard: bool = False,
    block_rows: int | None = None,
    num_warps: int | None = None,
    tiles: int | None = None,
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
        q_out_mult, k_out_mult: factors applied before a float8 output's cast (module docstring); unused
            otherwise, except with `hadamard`.
        k_mean: `[B, H, head_dim]` float32 contiguous, subtracted from every K row of its (batch, head) after
            RoPE (`k_token_sums` makes it), or None.
        hadamard: multiply each row by H/√head_dim after that (H the ±1 Sylvester matrix), float16 operands
            on the tensor cores, float32 sums: q_out_mult and k_out_mult then apply with any output dtype
            (1 for the plain rotation), and must keep every operand |x · mult/√head_dim| within float16's
            range (the fp8 scales keep it within ±448/√head_dim). head_dim 16 to 128.
        block_rows, num_warps, tiles: launch shape: `tiles` tiles of `block_rows` rows a program; default
            `2048 // head_dim` rows (≥ 1, ≤ 64; ≥ 16 with `hadamard`, the tensor cores' smallest tile),
            4 warps and 1 tile, or with `hadamard` `HADAMARD_LAUNCH`.
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
    if k_mean is not None:
        assert k_mean.shape == (batch, n_heads, head_dim) and k_mean.dtype == torch.float32, (
            f"k_mean must be [{batch}, {n_heads}, {head_dim}] float32"
        )
        assert k_mean.is_contiguous(), "k_mean must be contiguous"
    assert not hadamard or 16 <= head_dim <= 128, (
        f"the Hadamard rotation takes head_dim 16-128, not {head_dim}"
    )
    n_rows = batch * n_tokens * n_heads
    if n_rows == 0:
        return
    # 16 rows of 128 at 4 warps: 0.427 ms = 1.02x the HBM floor on an H200 (32 rows: 0.481; the dit-fusions benchmark's sweep)
    if hadamard:
        block_rows, tiles, num_warps = (
            block_rows or HADAMARD_LAUNCH[0],
            tiles or HADAMARD_LAUNCH[1],
            num_warps or HADAMARD_LAUNCH[2],
        )
    block_rows = block_rows or max(1, min(64, 2048 // head_dim))
    tiles = tiles or 1
    assert block_rows & (block_rows - 1) == 0, f"block_rows {block_rows} must be a power of two"
    assert not hadamard or block_rows >= 16, "the Hadamard rotation needs block_rows ≥ 16"
    grid = (triton.cdiv(n_rows, block_rows * tiles),)
    _qk_norm_rope_kernel[grid](
        q, k, q_out, k_out, q_weight, k_weight,
        cos if rotate else q_weight, sin if rotate else q_weight,  # unused pointers when not rotating
        k_mean if k_mean is not None else q_weight,  # unused pointer without smoothing
        n_rows, n_heads, n_tokens, out_token_offset,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        q_out.stride(0), q_out.stride(1),
        eps, float(q_out_mult), float(k_out_mult),
        HALF=half, BLOCK_ROWS=block_rows, ROTATE=rotate, INTERLEAVED=interleaved,
        SMOOTH_K=k_mean is not None, HADAMARD=hadamard, TILES=tiles,
        num_warps=num_warps or 4,
    )  # fmt: skip


# Sampled tokens each program of `k_token_sums` adds up: 64 gives 104 programs a head at 121 frames (6,650 of
# 26,598 tokens sampled).
SUM_TOKENS_PER_PROGRAM = 64


def k_sum_blocks(n_tokens: int) -> int:
    """Rows of the partial-sum buffer that `k_token_sums` fills for a stream of `n_tokens` tokens."""
    return triton.cdiv(k_mean_tokens(n_tokens), SUM_TOKENS_PER_PROGRAM)


def k_token_sums(
    k: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    partial: torch.Tensor,
    *,
    eps: float,
    block_offset: int = 0,
    interleaved: bool = True,
) -> None:
    """Partial sums over every `K_MEAN_STRIDE`-th token of RMSNorm(k) (and RoPE), per (batch, head), for K's mean
    (`k_mean_tokens` of them).

    Each program adds up `SUM_TOKENS_PER_PROGRAM` sampled tokens of one (batch, head) in float32 and writes its sum
    to its own row of `partial`, so the caller's `partial.sum(0)` finishes the sum in a fixed order (no
    atomics: the same inputs give the same mean, bit for bit, on every run).

    Args:
        k, k_weight, cos, sin, eps, interleaved: as `qk_norm_rope`'s.
        partial: `[P, B, H, head_dim]` float32 contiguous; rows `block_offset : block_offset +
            k_sum_blocks(N)` are written.
    """
    batch, n_tokens, n_heads, head_dim = k.shape
    blocks = k_sum_blocks(n_tokens)
    assert k.stride(3) == 1 and k.stride(2) == head_dim, (
        "k: each token's [H, head_dim] block must be contiguous"
    )
    assert head_dim >= 2 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} must be a power of two"
    assert partial.dtype == torch.float32 and partial.is_contiguous(), "partial must be contiguous float32"
    assert partial.shape[1:] == (batch, n_heads, head_dim) and block_offset + blocks <= partial.shape[0], (
        f"partial {tuple(partial.shape)} has no rows {block_offset}:{block_offset + blocks} for k"
    )
    for name, t in (("k", k), ("partial", partial)):
        assert t.is_cuda or triton_interpreting(), f"{name} must be a CUDA tensor (or set TRITON_INTERPRET=1)"
    rotate = cos is not None
    if rotate:
        assert sin is not None and cos.shape == sin.shape == (n_tokens, head_dim // 2), (
            "cos/sin: [N, head_dim/2]"
        )
    if n_tokens == 0 or batch == 0:
        return
    _k_sums_kernel[(blocks, n_heads, batch)](
        k, k_weight, cos if rotate else k_weight, sin if rotate else k_weight, partial,
        n_tokens, n_heads, batch, block_offset, k.stride(0), k.stride(1), eps,
        HALF=head_dim // 2, BLOCK_ROWS=max(1, min(32, 4096 // head_dim)),
        TOKENS_PER_PROGRAM=SUM_TOKENS_PER_PROGRAM, TOKEN_STRIDE=K_MEAN_STRIDE, ROTATE=rotate,
        INTERLEAVED=interleaved, num_warps=4,
    )  # fmt: skip
