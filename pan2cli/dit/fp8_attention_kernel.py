"""Triton kernel: attention with fp8 e4m3 Q, K, V (a flash-attention forward, no mask), bf16 output.

The joint attention of the fp8 tier. One program takes `BLOCK_M` query rows of one (batch, head) and walks
the keys in tiles of `BLOCK_N`: S = Q·Kᵀ on the fp8 tensor cores (float32 accumulation), an online softmax in
float32 (exp2 with the scale folded in), P·V on the fp8 tensor cores, the running output in float32.

Scales. Q and K come with one descale each per call (a `[1]` float32 tensor: the fp8 tier derives them from
the Q/K RMSNorm weights, which bound every element, see `pan2cli.dit.fp8`); V with one descale per head
(`[H]`, from V's absolute maximum per head). They are applied to S (one multiply folded into the softmax
scale) and to the final output, never to the tiles. P is in [0, 1] after the running-max subtraction; it is
made 2⁸ times larger (the 8 added to its exponent) before its cast to e4m3 so that probabilities down to
2⁻¹⁴ stay normal numbers (e4m3's smallest normal is 2⁻⁶), and the 2⁸ leaves with the softmax's row sum,
which is taken from the same P.

Numerics: the row sum is taken from the float32 P (before its cast), so the output is a convex combination
of V's rows up to P's rounding (3 mantissa bits); each tile's P·V is summed by the tensor core (Hopper keeps
~14 bits there) and then added to the float32 output in float32 (`acc += dot(...)`: never accumulated
across tiles in the tensor core, which would lose precision over 10⁵ keys).

Layouts (all contiguous): q, k `[B, S, H, D]` (the joint buffer of `qk_norm_rope`), v transposed as
`[B, H, D, S_pad]` (S_pad ≥ S a multiple of 16, the padding zero: fp8 tensor cores read the B operand of P·V
along the keys), out `[B, S, H, D]` bf16. Tensor descriptors (TMA on Hopper) load and store the tiles;
rows past S are zero-filled on load and dropped on store.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from pan2cli.dit.fp8 import P_SHIFT
from pan2cli.triton_support import triton_interpreting

FP8 = torch.float8_e4m3fn


@triton.jit
def _attend_tile(
    q, k_desc, v_desc, acc, m_i, l_i, batch_head, batch, head_col, start_n, n_keys, qk_scale,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, MASK: tl.constexpr, P_SHIFT: tl.constexpr,
):  # fmt: skip
    """One key tile: S, the online softmax update and P·V. Returns the new (acc, m_i, l_i)."""
    k = k_desc.load([batch, start_n, head_col]).reshape(BLOCK_N, HEAD_DIM)
    s = tl.dot(q, tl.trans(k))
    if MASK:  # the last tile: keys past the sequence take no weight
        cols = start_n + tl.arange(0, BLOCK_N)
        s = tl.where((cols < n_keys)[None, :], s, -float("inf"))
    # Log2 units (exp2(s·qk_scale) = exp(scale · q·k)). qk_scale > 0, so the row maximum is taken before the
    # scaling and the scaling is one FMA with the subtraction; the 2^P_SHIFT rides in the exponent. (The
    # exponentials are as much work as the fp8 MMAs, so the elementwise instructions per score count: this
    # form has 12 % fewer in the loop than scaling S, subtracting and multiplying P by 2^P_SHIFT.)
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - (m_new - P_SHIFT)[:, None])  # ≤ 2^P_SHIFT
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    v = v_desc.load([batch_head, 0, start_n]).reshape(HEAD_DIM, BLOCK_N)
    p8 = p.to(tl.float8e4nv)
    # max_num_imprecise_acc = BLOCK_N: the tile's sum leaves the tensor core and is added in float32.
    acc = tl.dot(p8, tl.trans(v), acc * alpha[:, None], max_num_imprecise_acc=BLOCK_N)
    return acc, m_new, l_i


@triton.jit
def _fp8_attention_kernel(
    q_desc, k_desc, v_desc, o_desc, QK_DESCALE, V_DESCALE,
    n_tokens, full_tiles, n_heads, sm_scale_log2,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, P_SHIFT: tl.constexpr,
):  # fmt: skip
    start_m = tl.program_id(0) * BLOCK_M
    batch_head = tl.program_id(1)
    batch = batch_head // n_heads
    head = batch_head % n_heads
    head_col = head * HEAD_DIM
    qk_scale = sm_scale_log2 * tl.load(QK_DESCALE)
    q = q_desc.load([batch, start_m, head_col]).reshape(BLOCK_M, HEAD_DIM)
    m_i = tl.full([BLOCK_M], -float("inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for start_n in range(0, full_tiles, BLOCK_N):
        acc, m_i, l_i = _attend_tile(
            q, k_desc, v_desc, acc, m_i, l_i, batch_head, batch, head_col, start_n, n_tokens, qk_scale,
            BLOCK_N, HEAD_DIM, False, P_SHIFT,
        )  # fmt: skip
    if full_tiles < n_tokens:
        acc, m_i, l_i = _attend_tile(
            q, k_desc, v_desc, acc, m_i, l_i, batch_head, batch, head_col, full_tiles, n_tokens, qk_scale,
            BLOCK_N, HEAD_DIM, True, P_SHIFT,
        )  # fmt: skip
    out = acc * (tl.load(V_DESCALE + head) / l_i)[:, None]  # l_i carries the 2^P_SHIFT of P
    o_desc.store([batch, start_m, head_col], out.to(tl.bfloat16).reshape(1, BLOCK_M, HEAD_DIM))


# (BLOCK_M, BLOCK_N, num_warps, num_stages): the default, and the others `scripts/bench_kernels.py fp8-attention` sweeps.
# Measured on an H200 at 121/241/481 frames (docs/BENCHMARKS.md): 64x128 with 4 warps 654-675 TFLOP/s, 128x128
# with 8 warps 587-616, the others 460-580 (before the loop lost 12 % of its instructions at `e60c9aa`: the default
# then 712-731).
DEFAULT_CONFIG = (64, 128, 4, 3)
CONFIGS = ((64, 128, 4, 3), (64, 128, 4, 4), (64, 64, 4, 4), (64, 256, 8, 2), (128, 128, 8, 3))


def padded_keys(n_tokens: int) -> int:
    """S_pad of the transposed V: the keys rounded up to 16 (a 16-byte row stride for the tensor descriptor)."""
    return (n_tokens + 15) // 16 * 16


def fp8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v_t: torch.Tensor,
    qk_descale: torch.Tensor,
    v_descale: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    config: tuple[int, int, int, int] = DEFAULT_CONFIG,
) -> torch.Tensor:
    """softmax(Q·Kᵀ/√D)·V over fp8 inputs with their descales (module docstring), no mask.

    Args:
        q, k: `[B, S, H, D]` float8_e4m3fn, contiguous; q·descale and k·descale are the real values.
        v_t: `[B, H, D, S_pad]` float8_e4m3fn, contiguous, `S_pad == padded_keys(S)`, columns ≥ S zero.
        qk_descale: `[1]` float32: the product of Q's and K's descales.
        v_descale: `[H]` float32: V's descale per head.
        out: `[B, S, H, D]` bfloat16 to write, or None (allocated).
        config: (BLOCK_M, BLOCK_N, num_warps, num_stages).

    Returns:
        `out`, `[B, S, H, D]` bfloat16.
    """
    batch, n_tokens, n_heads, head_dim = q.shape
    assert q.dtype == k.dtype == v_t.dtype == FP8, "q, k, v_t must be float8_e4m3fn"
    assert k.shape == q.shape and q.is_contiguous() and k.is_contiguous(), (
        "q, k: equal contiguous [B, S, H, D]"
    )
    assert v_t.shape == (batch, n_heads, head_dim, padded_keys(n_tokens)) and v_t.is_contiguous(), (
        f"v_t must be [B, H, D, S_pad] = {(batch, n_heads, head_dim, padded_keys(n_tokens))}, got {tuple(v_t.shape)}"
    )
    assert head_dim in (64, 128, 256), f"head_dim {head_dim} must be 64, 128 or 256"
    assert qk_descale.shape == (1,) and v_descale.shape == (n_heads,), "qk_descale [1], v_descale [H]"
    assert qk_descale.dtype == v_descale.dtype == torch.float32, "descales must be float32"
    for name, t in (("q", q), ("k", k), ("v_t", v_t), ("qk_descale", qk_descale), ("v_descale", v_descale)):
        assert t.is_cuda or triton_interpreting(), f"{name} must be a CUDA tensor (or set TRITON_INTERPRET=1)"
    if out is None:
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    assert out.shape == q.shape and out.dtype == torch.bfloat16 and out.is_contiguous(), "out: bf16 like q"
    block_m, block_n, num_warps, num_stages = config
    width = n_heads * head_dim

    def tokens(t: torch.Tensor, block_rows: int) -> TensorDescriptor:  # [B, S, H·D] in [1, rows, D] tiles
        return TensorDescriptor(
            t, [batch, n_tokens, width], [n_tokens * width, width, 1], [1, block_rows, head_dim]
        )

    s_pad = v_t.shape[-1]
    v_desc = TensorDescriptor(
        v_t, [batch * n_heads, head_dim, s_pad], [head_dim * s_pad, s_pad, 1], [1, head_dim, block_n]
    )
    grid = (triton.cdiv(n_tokens, block_m), batch * n_heads)
    _fp8_attention_kernel[grid](
        tokens(q, block_m), tokens(k, block_n), v_desc, tokens(out, block_m), qk_descale, v_descale,
        n_tokens, n_tokens // block_n * block_n, n_heads, math.log2(math.e) / math.sqrt(head_dim),
        BLOCK_M=block_m, BLOCK_N=block_n, HEAD_DIM=head_dim, P_SHIFT=P_SHIFT,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
