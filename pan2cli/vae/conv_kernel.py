"""Implicit-GEMM convolution (Triton) whose every output has one fixed reduction order.

cuDNN picks its algorithm per problem shape, and on the decoder's low-resolution 1024-channel layers it
picks others for a band of rows (a rank's share under a row split) or for another number of frames (a
chunk size) than for the whole problem: the fp32 sums are then added in another order, about 0.1 % of
the bf16 outputs round the other way, and random-weight decoders amplify that to several uint8 levels
(scripts/diag_split_rounding.py finds these layers). This kernel computes output (pixel, channel) as

    acc = Σ_{tap in (kt, kh, kw) order} Σ_{c in blocks of BLOCK_K} x[pixel + tap, c] · w[channel, tap, c]

(BLOCK_K = 64, or 16 for the 48 latent channels)

in fp32 (tensor-core MMA, `tl.dot`), adds the optional fp32 bias and rounds once to bf16. The order
depends on nothing but the layer (one tile configuration per layer, never chosen by problem size, no
split-K), so a pixel's value is the same whatever the height, frame count or position of the problem
it is computed in: one GPU, N GPUs and every chunk size agree bit for bit on these layers.

Layout: channels-last bf16. Input `(B, T_in, H_in, W_in, C_in)` with halo rows already in H_in (no
height padding) and zero padding `pad_w` on the width only; weight as cuDNN holds it channels-last,
`(C_out, C_in, KT, KH, KW)` stored as `(C_out, KT, KH, KW, C_in)`, i.e. row n of a `(C_out, K)` matrix
with k = ((kt·KH + kh)·KW + kw)·C_in + c. Output `(B, T_in − KT + 1, H_in − KH + 1, W_in + 2·pad_w − KW + 1,
C_out)`.
"""

from __future__ import annotations

import importlib.util
import os

import torch


def block_k(c_in: int) -> int:
    """The reduction step of a layer with `c_in` input channels: 64, or 16 for thin inputs (48 latent
    channels). Fixed per layer; it never depends on the problem's size."""
    return 64 if c_in % 64 == 0 else 16


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def implicit_gemm_conv(
        x_ptr,
        w_ptr,
        bias_ptr,
        out_ptr,
        M,
        C_OUT,
        T_OUT,
        H_OUT,
        W_OUT,
        W_IN,
        sx_b,
        sx_t,
        sx_h,
        C_IN: tl.constexpr,
        KT: tl.constexpr,
        KH: tl.constexpr,
        KW: tl.constexpr,
        PAD_W: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        # Grouped tile order: GROUP_M row tiles share their weight tiles in L2.
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(C_OUT, BLOCK_N)
        group = pid // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        size_m = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
        pid_n = (pid % (GROUP_M * tiles_n)) // size_m

        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        # output pixel m -> (b, t, y, x); its input window starts at (b, t, y, x - PAD_W)
        x = offs_m % W_OUT
        rest = offs_m // W_OUT
        y = rest % H_OUT
        rest = rest // H_OUT
        t = rest % T_OUT
        b = rest // T_OUT
        row_base = b.to(tl.int64) * sx_b + t.to(tl.int64) * sx_t + y.to(tl.int64) * sx_h + x.to(tl.int64) * C_IN
        m_valid = offs_m < M
        n_valid = offs_n < C_OUT
        K: tl.constexpr = KT * KH * KW * C_IN
        STEPS_PER_TAP: tl.constexpr = C_IN // BLOCK_K
        w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(KT * KH * KW * STEPS_PER_TAP):
            tap = step // STEPS_PER_TAP
            c0 = (step % STEPS_PER_TAP) * BLOCK_K
            kw = tap % KW
            kh = (tap // KW) % KH
            kt = tap // (KW * KH)
            xx = x + kw - PAD_W
            a_valid = m_valid & (xx >= 0) & (xx < W_IN)
            a_ptrs = x_ptr + (row_base + kt * sx_t + kh * sx_h + (kw - PAD_W) * C_IN + c0)[:, None] + offs_k[None, :]
            a = tl.load(a_ptrs, mask=a_valid[:, None], other=0.0)
            w = tl.load(w_rows + (tap * C_IN + c0), mask=n_valid[None, :], other=0.0)
            if INTERPRET:  # Triton 3.6's CPU interpreter multiplies bf16 bit patterns as integers
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc)
            else:
                acc = tl.dot(a, w, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0)[None, :]
        out_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * C_OUT + offs_n[None, :]
        tl.store(out_ptrs, acc.to(tl.bfloat16), mask=m_valid[:, None] & n_valid[None, :])

    return implicit_gemm_conv


def _tma_kernel():
    """The same sums with both operands loaded by TMA (experimental: not yet measured, not used by the decoder).

    Output pixels are enumerated in the input's geometry, m = (t·H_in + y)·W + x, so that every tap's
    operand rows are one dense block of the input seen as a (pixels, C_in) matrix, at a constant offset
    (kt·H_in + kh)·W + kw − pad_w; rows whose column wrapped around the frame's edge are zeroed in
    registers, rows y ≥ H_out (2 per frame: the halo) are computed and not stored. One batch only.
    """
    import triton
    import triton.language as tl

    @triton.jit
    def implicit_gemm_conv_tma(
        x_desc,
        w_desc,
        bias_ptr,
        out_ptr,
        M,
        C_OUT,
        H_IN,
        H_OUT,
        W,
        C_IN: tl.constexpr,
        KT: tl.constexpr,
        KH: tl.constexpr,
        KW: tl.constexpr,
        PAD_W: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        INTERPRET: tl.constexpr,
    ):
        pid = tl.program_id(0)
        tiles_m = tl.cdiv(M, BLOCK_M)
        tiles_n = tl.cdiv(C_OUT, BLOCK_N)
        group = pid // (GROUP_M * tiles_n)
        first_m = group * GROUP_M
        size_m = min(tiles_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
        pid_n = (pid % (GROUP_M * tiles_n)) // size_m
        m0 = pid_m * BLOCK_M
        n0 = pid_n * BLOCK_N
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        x = offs_m % W
        rest = offs_m // W
        y = rest % H_IN
        t = rest // H_IN
        STEPS_PER_TAP: tl.constexpr = C_IN // BLOCK_K

        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for step in range(KT * KH * KW * STEPS_PER_TAP):
            tap = step // STEPS_PER_TAP
            c0 = (step % STEPS_PER_TAP) * BLOCK_K
            kw = tap % KW
            kh = (tap // KW) % KH
            kt = tap // (KW * KH)
            a = x_desc.load([m0 + (kt * H_IN + kh) * W + kw - PAD_W, c0])  # out-of-range rows read as 0
            xx = x + kw - PAD_W
            a = tl.where(((xx >= 0) & (xx < W))[:, None], a, 0.0)
            w = w_desc.load([n0, tap * C_IN + c0])
            if INTERPRET:  # Triton 3.6's CPU interpreter multiplies bf16 bit patterns as integers
                acc = tl.dot(a.to(tl.float32), w.to(tl.float32).T, acc)
            else:
                acc = tl.dot(a, w.T, acc)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < C_OUT, other=0.0)[None, :]
        out_rows = (t.to(tl.int64) * H_OUT + y) * W + x
        out_ptrs = out_ptr + out_rows[:, None] * C_OUT + offs_n[None, :]
        keep = (offs_m < M) & (y < H_OUT)
        tl.store(out_ptrs, acc.to(tl.bfloat16), mask=keep[:, None] & (offs_n < C_OUT)[None, :])

    return implicit_gemm_conv_tma


_compiled = []
_compiled_tma = []


def _implicit_gemm_conv():
    if not _compiled:
        _compiled.append(_kernel())
    return _compiled[0]


def available() -> bool:
    """Whether Triton is installed (CUDA builds of torch bring it on Linux)."""
    return importlib.util.find_spec("triton") is not None


def applies(c_in: int) -> bool:
    """Whether a layer with `c_in` input channels can run here (whole reduction steps per tap)."""
    return c_in % 16 == 0


def _tiles(c_out: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of a layer: chosen by its width only, never by M."""
    if c_out >= 256:
        return 128, 256, 8, 3
    return 128, 128, 4, 4


def conv_channels_last(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    pad_w: int = 0,
    tiles: tuple[int, int, int, int] | None = None,
    tma: bool = False,
) -> torch.Tensor:
    """Convolve channels-last bf16 frames with a fixed summation order (module docstring).

    Args:
        x: `(B, T_in, H_in, W_in, C_in)` bf16, dense over (H, W, C) with batch stride T·frame stride, or
            `(N, H_in, W_in, C_in)` for a 2-D conv (frames as batch).
        weight: `(C_out, C_in, KT, KH, KW)` (or `(C_out, C_in, KH, KW)`) bf16 whose memory is channels-last.
        bias: optional `(C_out,)`, added in fp32 before the bf16 rounding.
        pad_w: zero columns on each side of the width.
        tiles: (BLOCK_M, BLOCK_N, num_warps, num_stages) instead of the layer's own (benchmarks only; the
            summation order does not depend on them).
        tma: the experimental TMA variant (`_tma_kernel`; one batch, convs that keep the width); the
            same summation order.

    Returns:
        `(B, T_out, H_out, W_out, C_out)` (or `(N, H_out, W_out, C_out)`) bf16, contiguous.
    """
    two_d = x.dim() == 4
    if two_d:
        x, weight = x.unsqueeze(1), weight.unsqueeze(2)
    b, t_in, h_in, w_in, c_in = x.shape
    c_out, _, kt, kh, kw = weight.shape
    assert x.dtype == weight.dtype == torch.bfloat16 and applies(c_in), (x.dtype, weight.dtype, c_in)
    assert x.stride(4) == 1 and x.stride(3) == c_in and x.stride(2) == w_in * c_in, x.stride()
    assert b == 1 or x.stride(0) == t_in * x.stride(1), x.stride()
    w = weight.permute(0, 2, 3, 4, 1)
    assert w.is_contiguous(), "weight must be channels-last"
    t_out, h_out, w_out = t_in - kt + 1, h_in - kh + 1, w_in + 2 * pad_w - kw + 1
    out = torch.empty(b, t_out, h_out, w_out, c_out, dtype=torch.bfloat16, device=x.device)
    m = b * t_out * h_out * w_out
    block_m, block_n, warps, stages = tiles or _tiles(c_out)
    if m and tma:
        _launch_tma(x, w, bias, out, pad_w, block_m, block_n, warps, stages)
    elif m:
        grid = (triton_cdiv(m, block_m) * triton_cdiv(c_out, block_n),)
        _implicit_gemm_conv()[grid](
            x,
            w,
            bias.float().contiguous() if bias is not None else x,
            out,
            m,
            c_out,
            t_out,
            h_out,
            w_out,
            w_in,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            C_IN=c_in,
            KT=kt,
            KH=kh,
            KW=kw,
            PAD_W=pad_w,
            HAS_BIAS=bias is not None,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k(c_in),
            GROUP_M=8,
            INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
            num_warps=warps,
            num_stages=stages,
        )
    return out.squeeze(1) if two_d else out


def _launch_tma(x, w, bias, out, pad_w, block_m, block_n, warps, stages) -> None:
    from triton.tools.tensor_descriptor import TensorDescriptor

    b, t_in, h_in, w_in, c_in = x.shape
    c_out, kt, kh, kw, _ = w.shape
    _, t_out, h_out, w_out, _ = out.shape
    assert b == 1 and w_out == w_in and x.is_contiguous(), "the TMA variant takes one batch and keeps the width"
    bk = block_k(c_in)
    x_desc = TensorDescriptor(x, [t_in * h_in * w_in, c_in], [c_in, 1], [block_m, bk])
    w_desc = TensorDescriptor(w, [c_out, kt * kh * kw * c_in], [kt * kh * kw * c_in, 1], [block_n, bk])
    m = t_out * h_in * w_in  # in the input's geometry: 2 halo rows per frame computed, not stored
    grid = (triton_cdiv(m, block_m) * triton_cdiv(c_out, block_n),)
    if not _compiled_tma:
        _compiled_tma.append(_tma_kernel())
    _compiled_tma[0][grid](
        x_desc,
        w_desc,
        bias.float().contiguous() if bias is not None else out,
        out,
        m,
        c_out,
        h_in,
        h_out,
        w_in,
        C_IN=c_in,
        KT=kt,
        KH=kh,
        KW=kw,
        PAD_W=pad_w,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=bk,
        GROUP_M=8,
        INTERPRET=os.environ.get("TRITON_INTERPRET") == "1",
        num_warps=warps,
        num_stages=stages,
    )


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
