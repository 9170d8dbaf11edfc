"""Triton kernels: V of the joint attention in e4m3 with one scale per head, laid out for the fp8 attention.

V comes from two projections (video `to_v`, text `add_v_proj`), each `[B, n, H·D]` bf16, whose tokens the
attention reads end to end (video first). Three kernels, two passes over V (two more kernels with `mean`):

1. `_channel_stats_kernel`: each program reads 512 tokens of one head of one stream and writes their sum,
   maximum and minimum per channel (float32) to its own row of a buffer, no atomics.
2. `_head_amax_kernel`, one program a head: the rows reduced in a fixed order (the same result on every run)
   to each head's absolute maximum over both streams and the batch; a NaN or Inf makes it Inf, hence a NaN
   scale downstream, never a silent wrong value. With `mean` (V smoothed) each channel's mean over the tokens
   of its batch item is written to `mean` first and the maximum is that of |V − mean| (the channel's maximum
   and minimum less the mean): the pass below then quantises V − mean, and the attention adds the mean back
   to its output, exact since a softmax row sums to 1. It keeps the P·V sums of the CUDA kernel's wide tiles,
   which accumulate across tiles in the fp8 MMA's accumulator, from growing with the keys where V's tokens
   share a part. With `per_tensor` every head then takes the largest (cuDNN's fp8 attention applies one V
   descale to all heads).
3. `_quantize_values_kernel`: one program per `[BLOCK_T keys, D]` tile of the output of one head: each output
   key column gathers its token's row of V (from whichever stream holds it; zeros past the last token), less
   the mean with `mean`, multiplied by 448/amax, clamped to ±448, rounded once to e4m3 and stored transposed,
   `[B, H, D, S_pad]`, as the fp8 attention's P·V wants it (keys along the contiguous axis), or as
   `[B, S, H, D]` (`transposed=False`).
4. With `mean` only: `_value_sums_kernel` reads the e4m3 output back (a third of the bytes of V in bf16) and
   writes the sums over 256 keys of each channel, each program to its own row; a sum inside the quantising
   kernel, whose tile Triton lays out for the transposed store, cost 3.3x that kernel's time (62.9 against
   18.9 ms a step on an H100 at 121 frames); apart, the two take 18.3 + 3.9 ms. Then `_shift_kernel`, one
   program a head: `mean` less the mean over the tokens of the e4m3 values (those sums, added in a fixed
   order, times the descale). Rounding V − mean to e4m3 is biased: the values are no longer symmetric about
   zero and e4m3's spacing grows with the magnitude, so the rounded values' mean is off by about 5·10⁻⁴ σ
   (N(0, 1) V, 27,198 tokens) against 1.6·10⁻⁴ σ for V itself. Where a softmax is broad its output is close
   to that mean, and the bias showed (docs/BENCHMARKS.md, "fp8 attention on outlier inputs"). Adding back the
   corrected mean is adding one vector to every value: exact under the softmax, and the values the attention
   effectively uses then average to V's own mean.

The key order. With `key_order="wgmma"` (transposed only) the keys of each 32-key block are stored in the
order the CUDA fp8 attention's TMA producer reads them (`kernels/fp8_attention/fp8_attention_layout.h`,
`key_of_row` = κ): key 32b + c at column 32b + κ(c), so that its P·V multiplies the scores of S's accumulators
in place. The permutation is applied where the tile is read, not where it is written: column j loads the row
of key κ⁻¹(j) (a row of V is 2·D contiguous bytes whatever its token, so the gather costs the loads nothing),
and the store is the natural order's, whole contiguous columns. Both orders compile to the same instructions
but for the key index: 16-byte stores (`st.global.v4`, four a thread at BLOCK_T 64, D 128). A permuted store
index instead hides from Triton that a thread's keys are contiguous: the kernel that permuted its stores wrote
V one byte at a time (`st.global.b8`, 64 a thread) and took 6x the natural order's time in the model on an
H100 (61.8 against 10.0 ms a step at 121 frames).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pan2cli.triton_support import triton_interpreting

# Tokens of one head each program of `_channel_stats_kernel` reads: 512 gives 53 programs a head at 121 frames
# (26,898 video tokens), 1,696 in all, and a statistics buffer of 2.7 MB (three rows of 16 KB a program).
STATS_TOKENS_PER_PROGRAM = 512


@triton.jit
def _channel_stats_kernel(
    V, STATS, n_tokens, block_offset, n_batch, plane, stride_batch, stride_token, width,
    BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr, TOKENS_PER_PROGRAM: tl.constexpr,
):  # fmt: skip
    """STATS[0, 1, 2][block_offset + program, batch, head·D + d] = the sum, maximum and minimum of V over this
    program's `TOKENS_PER_PROGRAM` tokens of one head, per channel, in float32 (a NaN counts as +Inf in the
    maximum and −Inf in the minimum); `plane` = the elements of one statistic. Grid: (token block, head, batch)."""
    block = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    cols = head * HEAD_DIM + tl.arange(0, HEAD_DIM)
    # Element-wise over the tiles, reduced across the tokens once at the end: a reduction a tile would cross
    # the warps (shared memory and a barrier) three times a tile.
    total = tl.zeros([BLOCK_T, HEAD_DIM], tl.float32)
    high = tl.full([BLOCK_T, HEAD_DIM], float("-inf"), tl.float32)
    low = tl.full([BLOCK_T, HEAD_DIM], float("inf"), tl.float32)
    for start in range(0, TOKENS_PER_PROGRAM, BLOCK_T):
        tokens = block * TOKENS_PER_PROGRAM + start + tl.arange(0, BLOCK_T)
        in_range = (tokens < n_tokens)[:, None]
        rows = batch.to(tl.int64) * stride_batch + tokens.to(tl.int64) * stride_token
        v = tl.load(V + rows[:, None] + cols[None, :], mask=in_range, other=0.0).to(tl.float32)
        total += v
        number = v == v
        high = tl.maximum(high, tl.where(in_range, tl.where(number, v, float("inf")), float("-inf")))
        low = tl.minimum(low, tl.where(in_range, tl.where(number, v, float("-inf")), float("inf")))
    row = ((block_offset + block).to(tl.int64) * n_batch + batch) * width + cols
    tl.store(STATS + row, tl.sum(total, axis=0))
    tl.store(STATS + plane + row, tl.max(high, axis=0))
    tl.store(STATS + 2 * plane + row, tl.min(low, axis=0))


@triton.jit
def _head_amax_kernel(
    STATS, MEAN, AMAX, n_blocks, n_batch, plane, width, n_total,
    HEAD_DIM: tl.constexpr, BLOCKS: tl.constexpr, SMOOTH: tl.constexpr,
):  # fmt: skip
    """AMAX[head] = max |V − MEAN| (|V| without SMOOTH) over the head's tokens, batch items and channels, from
    `_channel_stats_kernel`'s STATS; with SMOOTH, MEAN[batch, head·D + d] = the channel's mean over the tokens
    first (the blocks' sums added in a fixed order: the same mean on every run). NaN → Inf. Grid: (head,)."""
    head = tl.program_id(0)
    cols = head * HEAD_DIM + tl.arange(0, HEAD_DIM)
    amax = tl.zeros([HEAD_DIM], tl.float32)
    for batch in range(n_batch):
        total = tl.zeros([HEAD_DIM], tl.float32)
        high = tl.full([HEAD_DIM], float("-inf"), tl.float32)
        low = tl.full([HEAD_DIM], float("inf"), tl.float32)
        for first in range(0, n_blocks, BLOCKS):
            blocks = first + tl.arange(0, BLOCKS)
            present = (blocks < n_blocks)[:, None]
            rows = ((blocks.to(tl.int64) * n_batch + batch) * width)[:, None] + cols[None, :]
            total += tl.sum(tl.load(STATS + rows, mask=present, other=0.0), axis=0)
            high = tl.maximum(
                high, tl.max(tl.load(STATS + plane + rows, mask=present, other=float("-inf")), 0)
            )
            low = tl.minimum(
                low, tl.min(tl.load(STATS + 2 * plane + rows, mask=present, other=float("inf")), 0)
            )
        if SMOOTH:
            mean = total / n_total
            tl.store(MEAN + batch * width + cols, mean)
            magnitude = tl.maximum(high - mean, mean - low)
        else:
            magnitude = tl.maximum(high, -low)
        amax = tl.maximum(amax, tl.where(magnitude == magnitude, magnitude, float("inf")))  # NaN → Inf
    tl.store(AMAX + head, tl.max(amax, axis=0))


# Keys each program of `_value_sums_kernel` adds up: a [D, 256] tile of the transposed output, 107 programs a
# head at 121 frames.
VALUE_SUM_KEYS = 256


@triton.jit
def _value_sums_kernel(
    OUT, SUMS, n_columns, stride_batch, stride_head, stride_dim, stride_key, width,
    BLOCK_K: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """SUMS[key block, batch, head·D + d] = OUT's e4m3 values of channel d over the block's `BLOCK_K` key columns,
    summed in float32 (padding columns hold zeros). Grid: (key block, head, batch)."""
    block = tl.program_id(0)
    head = tl.program_id(1)
    batch = tl.program_id(2)
    keys = block * BLOCK_K + tl.arange(0, BLOCK_K)
    dims = tl.arange(0, HEAD_DIM)
    tile = (
        OUT + batch.to(tl.int64) * stride_batch + head.to(tl.int64) * stride_head
        + dims.to(tl.int64)[:, None] * stride_dim + keys.to(tl.int64)[None, :] * stride_key
    )  # fmt: skip
    values = tl.load(tile, mask=(keys < n_columns)[None, :], other=0.0).to(tl.float32)
    row = (block.to(tl.int64) * tl.num_programs(2) + batch) * width
    tl.store(SUMS + row + head * HEAD_DIM + dims, tl.sum(values, axis=1))


@triton.jit
def _shift_kernel(
    SUMS, MEAN, DESCALE, n_blocks, n_batch, width, n_total, HEAD_DIM: tl.constexpr, BLOCKS: tl.constexpr,
):  # fmt: skip
    """MEAN[batch, head·D + d] −= the mean over the tokens of the e4m3 values of V − MEAN as the attention reads
    them (`_value_sums_kernel`'s SUMS, added in a fixed order, times the head's descale): afterwards the
    e4m3 values plus MEAN average to V's own mean, channel by channel. Grid: (head,)."""
    head = tl.program_id(0)
    cols = head * HEAD_DIM + tl.arange(0, HEAD_DIM)
    descale = tl.load(DESCALE + head)
    for batch in range(n_batch):
        total = tl.zeros([HEAD_DIM], tl.float32)
        for first in range(0, n_blocks, BLOCKS):
            blocks = first + tl.arange(0, BLOCKS)
            rows = ((blocks.to(tl.int64) * n_batch + batch) * width)[:, None] + cols[None, :]
            total += tl.sum(tl.load(SUMS + rows, mask=(blocks < n_blocks)[:, None], other=0.0), axis=0)
        mean = tl.load(MEAN + batch * width + cols)
        tl.store(MEAN + batch * width + cols, mean - descale * (total / n_total))


@triton.jit
def _wgmma_key_of_column(column):
    """The key stored at `column` in the wgmma key order: κ⁻¹, within each 32-key block. κ takes key
    c = 8i + 2q + e to 16(i // 2) + 4q + 2(i % 2) + e (`key_of_row`); so column j = 16a + 4q + 2b + e holds
    key 16a + 8b + 2q + e."""
    j = column % 32
    return column - j + 16 * (j // 16) + 8 * ((j % 4) // 2) + 2 * ((j % 16) // 4) + j % 2


@triton.jit
def _quantize_values_kernel(
    V0, V1, MEAN, AMAX, OUT, n0, n1, n_columns, stride0_batch, stride0_token, stride1_batch, stride1_token,
    stride_out_batch, stride_out_head, stride_out_dim, stride_out_key, width,
    BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr, WGMMA_KEY_ORDER: tl.constexpr, SMOOTH: tl.constexpr,
):  # fmt: skip
    """OUT's `[BLOCK_T columns, HEAD_DIM]` tile of one head = e4m3((V − MEAN) · 448 / AMAX[head]) of the keys those
    columns hold: keys < n0 from V0 (video), the next n1 from V1 (text), zeros after (MEAN with SMOOTH only).
    Grid: (column block, head, batch)."""
    head = tl.program_id(1)
    batch = tl.program_id(2).to(tl.int64)
    columns = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    if WGMMA_KEY_ORDER:
        keys = _wgmma_key_of_column(columns)
    else:
        keys = columns
    dims = tl.arange(0, HEAD_DIM)
    cols = (head * HEAD_DIM + dims)[None, :]
    in0 = keys < n0
    in1 = (keys >= n0) & (keys < n0 + n1)
    rows0 = batch * stride0_batch + keys.to(tl.int64) * stride0_token
    rows1 = batch * stride1_batch + (keys - n0).to(tl.int64) * stride1_token
    v = tl.load(V0 + rows0[:, None] + cols, mask=in0[:, None], other=0.0)
    v = tl.where(in1[:, None], tl.load(V1 + rows1[:, None] + cols, mask=in1[:, None], other=0.0), v)
    v = v.to(tl.float32)
    if SMOOTH:
        mean = tl.load(MEAN + batch * width + cols)
        v = tl.where((in0 | in1)[:, None], v - mean, 0.0)
    amax = tl.load(AMAX + head)
    inverse = tl.where(amax > 0.0, 448.0 / tl.maximum(amax, 1e-30), 1.0)
    v8 = tl.minimum(tl.maximum(v * inverse, -448.0), 448.0).to(OUT.dtype.element_ty)
    out = (
        OUT + batch * stride_out_batch + head.to(tl.int64) * stride_out_head
        + columns.to(tl.int64)[:, None] * stride_out_key + dims[None, :] * stride_out_dim
    )  # fmt: skip
    tl.store(out, v8, mask=(columns < n_columns)[:, None])


def values_fp8(
    streams: list[torch.Tensor],
    n_heads: int,
    out: torch.Tensor,
    descale: torch.Tensor,
    *,
    transposed: bool = True,
    per_tensor: bool = False,
    key_order: str = "natural",
    mean: torch.Tensor | None = None,
) -> None:
    """Quantise the V streams (video first) into `out` with one descale per head (module docstring).

    Args:
        streams: one or two `[B, n_i, H·D]` tensors (bf16), rows contiguous; their tokens are laid end to end.
        n_heads: H.
        out: float8_e4m3fn, `[B, H, D, S_pad]` (transposed; S_pad ≥ S = Σ n_i, the tail zero-filled) or
            `[B, S, H, D]`.
        descale: `[H]` float32, written: the real value of V is fp8 value · descale[head].
        transposed: the layout of `out`.
        per_tensor: one scale for all heads (the largest head's), for attention kernels with one V descale.
        key_order: "natural", or "wgmma" (transposed only; the module docstring).
        mean: `[B, H·D]` float32, or None: V − (each channel's mean over the tokens) is what is quantised (V
            smoothed), and `mean` is written with what the attention must add back to its output: that mean
            less the mean of the rounding (module docstring, 4).
    """
    batch, _, width = streams[0].shape
    head_dim = width // n_heads
    assert 1 <= len(streams) <= 2, "one or two V streams (video, text)"
    assert head_dim * n_heads == width and head_dim & (head_dim - 1) == 0, "H·D with D a power of two"
    n_total = sum(s.shape[1] for s in streams)
    assert key_order in ("natural", "wgmma"), f"key_order {key_order!r}: natural or wgmma"
    assert transposed or key_order == "natural", "the wgmma key order is a layout of the transposed V"
    if transposed:
        assert out.shape[:3] == (batch, n_heads, head_dim) and out.shape[3] >= n_total, (
            "out: [B, H, D, S_pad]"
        )
        out_strides = (out.stride(0), out.stride(1), out.stride(2), out.stride(3))
        n_columns = out.shape[3]
        # κ permutes each 32-key block, and maps the first 16 keys of a block onto themselves: S_pad (a
        # multiple of 16) holds whole blocks or a block's first half.
        assert key_order == "natural" or n_columns % 16 == 0, (
            "the wgmma key order needs S_pad a multiple of 16"
        )
    else:
        assert out.shape == (batch, n_total, n_heads, head_dim), "out: [B, S, H, D]"
        out_strides = (out.stride(0), out.stride(2), out.stride(3), out.stride(1))
        n_columns = n_total
    assert out.dtype == torch.float8_e4m3fn and descale.shape == (n_heads,) and descale.dtype == torch.float32
    for name, t in (("out", out), ("descale", descale), *((f"stream {i}", s) for i, s in enumerate(streams))):
        assert t.is_cuda or triton_interpreting(), f"{name} must be a CUDA tensor (or set TRITON_INTERPRET=1)"
    for s in streams:
        assert s.shape[0] == batch and s.shape[2] == width and s.stride(2) == 1, "streams: [B, n, H·D] rows"
    block_t = 64
    smooth = mean is not None
    if smooth:
        assert mean.shape == (batch, width) and mean.dtype == torch.float32 and mean.is_contiguous(), (
            "mean: [B, H·D] float32, contiguous"
        )
    blocks = [triton.cdiv(s.shape[1], STATS_TOKENS_PER_PROGRAM) for s in streams]
    stats = torch.empty(3, sum(blocks), batch, width, dtype=torch.float32, device=out.device)
    plane = stats[0].numel()
    for s, n_blocks, offset in zip(streams, blocks, (0, blocks[0])):
        if n_blocks and batch:
            _channel_stats_kernel[(n_blocks, n_heads, batch)](
                s, stats, s.shape[1], offset, batch, plane, s.stride(0), s.stride(1), width,
                BLOCK_T=32, HEAD_DIM=head_dim, TOKENS_PER_PROGRAM=STATS_TOKENS_PER_PROGRAM,
            )  # fmt: skip
    amax = torch.empty(n_heads, dtype=torch.float32, device=out.device)
    _head_amax_kernel[(n_heads,)](
        stats, mean if smooth else amax, amax, sum(blocks), batch, plane, width, max(n_total, 1),
        HEAD_DIM=head_dim, BLOCKS=32, SMOOTH=smooth,
    )  # fmt: skip
    if per_tensor:
        amax.copy_(amax.amax().expand(n_heads))
    video, text = streams[0], streams[-1]
    n_text = text.shape[1] if len(streams) == 2 else 0
    grid = (triton.cdiv(n_columns, block_t), n_heads, batch)
    _quantize_values_kernel[grid](
        video, text, mean if smooth else amax, amax, out, video.shape[1], n_text, n_columns,
        video.stride(0), video.stride(1), text.stride(0), text.stride(1), *out_strides, width,
        BLOCK_T=block_t, HEAD_DIM=head_dim, WGMMA_KEY_ORDER=key_order == "wgmma", SMOOTH=smooth,
    )  # fmt: skip
    torch.where(amax > 0, amax / 448.0, torch.ones_like(amax), out=descale)
    if smooth:
        sum_blocks = triton.cdiv(n_columns, VALUE_SUM_KEYS)
        sums = torch.empty(sum_blocks, batch, width, dtype=torch.float32, device=out.device)
        _value_sums_kernel[(sum_blocks, n_heads, batch)](
            out, sums, n_columns, *out_strides, width, BLOCK_K=VALUE_SUM_KEYS, HEAD_DIM=head_dim
        )
        _shift_kernel[(n_heads,)](
            sums, mean, descale, sum_blocks, batch, width, max(n_total, 1), HEAD_DIM=head_dim, BLOCKS=32
        )


def transposed_values(
    streams: list[torch.Tensor], n_heads: int, *, key_order: str = "natural", smooth: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """`values_fp8` into new tensors: the V streams (`[B, n, H·D]`, video first) → (`[B, H, D, S_pad]` e4m3 in
    `key_order`, the descales `[H]`, and with `smooth` the shift `[B, H·D]` float32 that `values_fp8` writes
    into its `mean`, else None)."""
    from pan2cli.dit.fp8_attention_kernel import padded_keys

    batch, _, width = streams[0].shape
    device = streams[0].device
    n_tokens = sum(s.shape[1] for s in streams)
    v_t = torch.empty(
        batch, n_heads, width // n_heads, padded_keys(n_tokens), dtype=torch.float8_e4m3fn, device=device
    )
    descale = torch.empty(n_heads, dtype=torch.float32, device=device)
    mean = torch.empty(batch, width, dtype=torch.float32, device=device) if smooth else None
    values_fp8(streams, n_heads, v_t, descale, key_order=key_order, mean=mean)
    return v_t, descale, mean
