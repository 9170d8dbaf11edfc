"""Triton kernels: V of the joint attention in e4m3 with one scale per head, laid out for the fp8 attention.

V comes from two projections (video `to_v`, text `add_v_proj`), each `[B, n, H·D]` bf16. Two passes:

1. `_head_amax_kernel`: each head's absolute maximum over both streams and the batch, by atomic max into a
   `[H]` float32 buffer (absolute values are non-negative, so float order is integer order; a NaN or Inf
   makes the head's maximum Inf, hence a NaN scale downstream, never a silent wrong value).
2. `_quantize_values_kernel`: each `[BLOCK_T tokens, D]` tile of one head multiplied by 448/amax, clamped
   to ±448, rounded once to e4m3 and stored transposed, `[B, H, D, S_pad]`, as the fp8 attention's P·V wants
   it (keys along the contiguous axis); the text stream lands after the video tokens, and the tokens
   between S and S_pad are written as zeros. With `transposed=False` the tile is stored as `[B, S, H, D]`.
   With `key_order="wgmma"` (transposed only) the keys of each 32-key block are stored in the order the CUDA
   fp8 attention's TMA variant reads them (`kernels/experimental/fp8_attention_layout.h`, `key_of_row`): key
   32b + c at column 32b + κ(c), so that its P·V multiplies the scores of S's accumulators in place.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pan2cli.triton_support import triton_interpreting


@triton.jit
def _head_tile(V, n_tokens, stride_batch, stride_token, BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr):
    """This program's `[BLOCK_T, HEAD_DIM]` tile of V (grid: token block, head, batch; rows past `n_tokens`
    read as 0) → (tile, its token indices, head, batch)."""
    head = tl.program_id(1)
    batch = tl.program_id(2)
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rows = batch.to(tl.int64) * stride_batch + tokens.to(tl.int64) * stride_token
    cols = head * HEAD_DIM + tl.arange(0, HEAD_DIM)
    v = tl.load(V + rows[:, None] + cols[None, :], mask=(tokens < n_tokens)[:, None], other=0.0)
    return v, tokens, head, batch


@triton.jit
def _head_amax_kernel(
    V, AMAX, n_tokens, stride_batch, stride_token,
    BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    v, _, head, _ = _head_tile(V, n_tokens, stride_batch, stride_token, BLOCK_T, HEAD_DIM)
    magnitude = tl.abs(v.to(tl.float32))
    magnitude = tl.where(magnitude == magnitude, magnitude, float("inf"))  # NaN → Inf
    tl.atomic_max(AMAX + head, tl.max(tl.max(magnitude, axis=1), axis=0))


@triton.jit
def _wgmma_key_column(key):
    """Column of `key` in the wgmma key order: within each 32-key block, c = 8i + 2q + e → 16(i // 2) + 4q +
    2(i % 2) + e (`key_of_row` of kernels/experimental/fp8_attention_layout.h)."""
    c = key % 32
    i = c // 8
    return key - c + 16 * (i // 2) + 4 * ((c % 8) // 2) + 2 * (i % 2) + c % 2


@triton.jit
def _quantize_values_kernel(
    V, AMAX, OUT, n_tokens, n_written, token_offset, stride_batch, stride_token,
    stride_out_batch, stride_out_head, stride_out_dim, stride_out_token,
    BLOCK_T: tl.constexpr, HEAD_DIM: tl.constexpr, WGMMA_KEY_ORDER: tl.constexpr,
):  # fmt: skip
    v, tokens, head, batch = _head_tile(V, n_tokens, stride_batch, stride_token, BLOCK_T, HEAD_DIM)
    amax = tl.load(AMAX + head)
    inverse = tl.where(amax > 0.0, 448.0 / tl.maximum(amax, 1e-30), 1.0)
    v8 = tl.minimum(tl.maximum(v.to(tl.float32) * inverse, -448.0), 448.0).to(OUT.dtype.element_ty)
    dims = tl.arange(0, HEAD_DIM)
    keys = token_offset + tokens
    if WGMMA_KEY_ORDER:
        keys = _wgmma_key_column(keys)
    out = (
        OUT + batch.to(tl.int64) * stride_out_batch + head.to(tl.int64) * stride_out_head
        + keys.to(tl.int64)[:, None] * stride_out_token + dims[None, :] * stride_out_dim
    )  # fmt: skip
    tl.store(out, v8, mask=(tokens < n_written)[:, None])


def values_fp8(
    streams: list[torch.Tensor],
    n_heads: int,
    out: torch.Tensor,
    descale: torch.Tensor,
    *,
    transposed: bool = True,
    per_tensor: bool = False,
    key_order: str = "natural",
) -> None:
    """Quantise the V streams (video first) into `out` with one descale per head (module docstring).

    Args:
        streams: `[B, n_i, H·D]` tensors (bf16), rows contiguous; their tokens are laid end to end.
        n_heads: H.
        out: float8_e4m3fn, `[B, H, D, S_pad]` (transposed; S_pad ≥ S = Σ n_i, the tail zero-filled) or
            `[B, S, H, D]`.
        descale: `[H]` float32, written: the real value of V is fp8 value · descale[head].
        transposed: the layout of `out`.
        per_tensor: one scale for all heads (the largest head's), for attention kernels with one V descale.
        key_order: "natural", or "wgmma" (transposed only; the module docstring).
    """
    batch, _, width = streams[0].shape
    head_dim = width // n_heads
    assert head_dim * n_heads == width and head_dim & (head_dim - 1) == 0, "H·D with D a power of two"
    n_total = sum(s.shape[1] for s in streams)
    assert key_order in ("natural", "wgmma"), f"key_order {key_order!r}: natural or wgmma"
    assert transposed or key_order == "natural", "the wgmma key order is a layout of the transposed V"
    if transposed:
        assert out.shape[:3] == (batch, n_heads, head_dim) and out.shape[3] >= n_total, (
            "out: [B, H, D, S_pad]"
        )
        out_strides = (out.stride(0), out.stride(1), out.stride(2), out.stride(3))
        s_pad = out.shape[3]
    else:
        assert out.shape == (batch, n_total, n_heads, head_dim), "out: [B, S, H, D]"
        out_strides = (out.stride(0), out.stride(2), out.stride(3), out.stride(1))
        s_pad = n_total
    assert out.dtype == torch.float8_e4m3fn and descale.shape == (n_heads,) and descale.dtype == torch.float32
    for name, t in (("out", out), ("descale", descale), *((f"stream {i}", s) for i, s in enumerate(streams))):
        assert t.is_cuda or triton_interpreting(), f"{name} must be a CUDA tensor (or set TRITON_INTERPRET=1)"
    for s in streams:
        assert s.shape[0] == batch and s.shape[2] == width and s.stride(2) == 1, "streams: [B, n, H·D] rows"
    block_t = 64
    amax = torch.zeros(n_heads, dtype=torch.float32, device=out.device)
    for s in streams:
        if s.shape[1]:
            grid = (triton.cdiv(s.shape[1], block_t), n_heads, batch)
            _head_amax_kernel[grid](
                s, amax, s.shape[1], s.stride(0), s.stride(1), BLOCK_T=block_t, HEAD_DIM=head_dim
            )
    if per_tensor:
        amax.copy_(amax.amax().expand(n_heads))
    offset = 0
    for i, s in enumerate(streams):
        last = i == len(streams) - 1
        written = (s_pad - offset) if last else s.shape[1]  # the last stream also zero-fills the padding
        grid = (triton.cdiv(written, block_t), n_heads, batch)
        _quantize_values_kernel[grid](
            s, amax, out, s.shape[1], written, offset, s.stride(0), s.stride(1), *out_strides,
            BLOCK_T=block_t, HEAD_DIM=head_dim, WGMMA_KEY_ORDER=key_order == "wgmma",
        )  # fmt: skip
        offset += s.shape[1]
    torch.where(amax > 0, amax / 448.0, torch.ones_like(amax), out=descale)
