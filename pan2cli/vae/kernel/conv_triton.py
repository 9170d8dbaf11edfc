"""The Triton kernel of `conv` (imported on first use: Triton is needed only where it runs).

It computes, for output pixel m and channel n, acc = Σ over taps (kt, kh, kw) in order, then over
channel steps of BLOCK_K, of x[pixel(m) + tap, c] · w[n, tap, c], with one `tl.dot` per step into an
fp32 accumulator. (A TMA-fed variant ran no faster on the H200, 514 vs 515 TFLOP/s on up1's 3x3x3
conv, and was removed; Triton 3.6 ignores `warp_specialize` on sm_90.)
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile(M, C_OUT, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(first row, first channel) of this program's output tile; GROUP_M row tiles share weights in L2."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(C_OUT, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    size_m = min(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % size_m
    pid_n = (pid % (GROUP_M * tiles_n)) // size_m
    return pid_m * BLOCK_M, pid_n * BLOCK_N


@triton.jit
def _tap(step, C_IN: tl.constexpr, KH: tl.constexpr, KW: tl.constexpr, BLOCK_K: tl.constexpr):
    """Reduction step -> (kt, kh, kw, first channel): taps in (kt, kh, kw) order, channels within a tap."""
    steps_per_tap: tl.constexpr = C_IN // BLOCK_K
    tap = step // steps_per_tap
    return tap // (KW * KH), (tap // KW) % KH, tap % KW, (step % steps_per_tap) * BLOCK_K


@triton.jit
def _mma(acc, a, w, INTERPRET: tl.constexpr):
    """acc += a @ w in fp32 (bf16 operands on the tensor cores)."""
    if INTERPRET:  # Triton 3.6's CPU interpreter multiplies bf16 bit patterns as integers
        return tl.dot(a.to(tl.float32), w.to(tl.float32), acc)
    return tl.dot(a, w, acc)


@triton.jit
def _store(
    acc, bias_ptr, out_ptr, out_rows, offs_n, keep, C_OUT, HAS_BIAS: tl.constexpr, OUT_FP32: tl.constexpr
):
    """(+ bias in fp32), one bf16 rounding (none with OUT_FP32), rows `out_rows` of the channels-last output
    where `keep`."""
    n_valid = offs_n < C_OUT
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_valid, other=0.0)[None, :]
    out_ptrs = out_ptr + out_rows.to(tl.int64)[:, None] * C_OUT + offs_n[None, :]
    value = acc if OUT_FP32 else acc.to(tl.bfloat16)
    tl.store(out_ptrs, value, mask=keep[:, None] & n_valid[None, :])


# The problem's sizes are not specialised on (Triton would otherwise compile a variant for every
# divisibility by 16 of M, H or W, and for T == 1): one compiled kernel per layer, whatever the video's
# size, so `pan2 kernels build` can compile them all ahead and a decode never compiles or loads a
# new variant mid-way. Alignment comes from C_IN (a multiple of 16): strides are passed in pixels.
@triton.jit(do_not_specialize=["M", "T_OUT", "H_OUT", "W_OUT", "W_IN", "sx_b", "sx_t", "sx_h"])
def implicit_gemm_conv(
    x_ptr,
    w_ptr,
    bias_ptr,
    out_ptr,
    M,
    T_OUT,
    H_OUT,
    W_OUT,
    W_IN,
    sx_b,
    sx_t,
    sx_h,
    C_OUT: tl.constexpr,
    C_IN: tl.constexpr,
    KT: tl.constexpr,
    KH: tl.constexpr,
    KW: tl.constexpr,
    PAD_W: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    OUT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    INTERPRET: tl.constexpr,
):
    """Operands by pointer loads: any batch, any output width (the resamplers' phase convs too)."""
    m0, n0 = _tile(M, C_OUT, BLOCK_M, BLOCK_N, GROUP_M)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # output pixel m -> (b, t, y, x); its input window starts at (b, t, y, x - PAD_W)
    x = offs_m % W_OUT
    rest = offs_m // W_OUT
    y = rest % H_OUT
    rest = rest // H_OUT
    t = rest % T_OUT
    b = rest // T_OUT
    # strides in pixels (units of C_IN elements): every address below is a multiple of C_IN plus c
    row_base = (b.to(tl.int64) * sx_b + t.to(tl.int64) * sx_t + y.to(tl.int64) * sx_h + x.to(tl.int64)) * C_IN
    m_valid = offs_m < M
    n_valid = offs_n < C_OUT
    K: tl.constexpr = KT * KH * KW * C_IN
    w_rows = w_ptr + offs_n.to(tl.int64)[None, :] * K + offs_k[:, None]

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(KT * KH * KW * (C_IN // BLOCK_K)):
        kt, kh, kw, c0 = _tap(step, C_IN, KH, KW, BLOCK_K)
        xx = x + kw - PAD_W
        a_valid = m_valid & (xx >= 0) & (xx < W_IN)
        tap_offset = (kt * sx_t + kh * sx_h + (kw - PAD_W)).to(tl.int64) * C_IN + c0
        a_ptrs = x_ptr + (row_base + tap_offset)[:, None] + offs_k[None, :]
        a = tl.load(a_ptrs, mask=a_valid[:, None], other=0.0)
        w = tl.load(w_rows + ((kt * KH + kh) * KW + kw) * C_IN + c0, mask=n_valid[None, :], other=0.0)
        acc = _mma(acc, a, w, INTERPRET)
    _store(acc, bias_ptr, out_ptr, offs_m, offs_n, m_valid, C_OUT, HAS_BIAS, OUT_FP32)
