// Fused (bias +) (residual +) RMS norm (+ SiLU), or the plain sum, over the channels of channels-last bf16 rows.
// One warp per row (R rows per warp); a lane holds up to 4 vectors of 8 bf16 per row in registers (C <= 1024).
#include <stdexcept>

#include "decode_kernels.h"

namespace wan22 {
namespace {

constexpr int kWarpsPerBlock = 8;

// Streaming variants (STREAM): rows of x and the residual through the read-only (non-coherent) path,
// outputs with the evict-first hint; both are read or written once per kernel. Used only where x and
// the residual are not also written by the kernel (`sum_out` not aliasing them).
template <bool STREAM>
__device__ __forceinline__ uint4 load16(const __nv_bfloat16* ptr) {
    if constexpr (STREAM) return __ldg(reinterpret_cast<const uint4*>(ptr));
    return *reinterpret_cast<const uint4*>(ptr);
}

template <bool STREAM>
__device__ __forceinline__ void store16(__nv_bfloat16* ptr, uint4 bits) {
    if constexpr (STREAM) {
        __stcs(reinterpret_cast<uint4*>(ptr), bits);
    } else {
        *reinterpret_cast<uint4*>(ptr) = bits;
    }
}

__device__ __forceinline__ void unpack8(uint4 bits, float (&out)[8]) {
    const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&bits);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        const float2 f = __bfloat1622float2(pairs[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ uint4 pack8(const float (&in)[8]) {
    uint4 bits;
    __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&bits);
#pragma unroll
    for (int i = 0; i < 4; ++i) pairs[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    return bits;
}

__device__ __forceinline__ void load8_f32(const float* ptr, float (&out)[8]) {
    const float4 a = *reinterpret_cast<const float4*>(ptr);
    const float4 b = *reinterpret_cast<const float4*>(ptr + 4);
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w;
    out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

// NV: vectors of 8 channels per lane (ceil(C / 256)); R: rows per warp. All R·NV row loads of a lane are
// issued before the first reduction, so several 16-byte loads are in flight per thread (one row of 256
// channels is one load per lane, too little to cover the memory latency). The kernel is bound by the
// loads in flight per SM (measured on an H200, docs/KERNEL_NOTES.md), so it spends few registers:
// rows stay in registers as bf16 (exact: x is bf16, and a sum is rounded to bf16 before the norm anyway),
// offsets within a frame are 32-bit, and the pointers other than x and sum_out (which may be one
// tensor: the sum stored in place) are __restrict__, so γ and the bias load early instead of behind the
// sum's stores. Without a residual the rows per warp double (half the bytes per row to hold).
template <int NV, int R, bool HAS_RESIDUAL, bool STREAM>
__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    rms_norm_silu_kernel(RmsNormParams p, const __nv_bfloat16* x, const __nv_bfloat16* __restrict__ residual,
                         const float* __restrict__ bias, const float* __restrict__ gamma, __nv_bfloat16* sum_out,
                         __nv_bfloat16* __restrict__ out, __nv_bfloat16* __restrict__ history) {
    // Grid: x = blocks of rows within a frame, y = frame (b * T + t); no per-row division.
    const int lane = threadIdx.x & 31;
    const int frame = blockIdx.y;
    const int b = frame / p.frames_per_batch;
    const int t = frame - b * p.frames_per_batch;
    const int first_row = (int(blockIdx.x) * kWarpsPerBlock + int(threadIdx.x >> 5)) * R;
    const int rows = int(p.rows_per_frame);  // rows are positions within this frame below
    const int channels = p.channels;
    const bool add = bias != nullptr || HAS_RESIDUAL;
    const int64_t x_base = int64_t(frame) * p.x_frame_stride;
    x += x_base;
    if (HAS_RESIDUAL) residual += x_base;
    if (sum_out != nullptr) sum_out += x_base;
    out += int64_t(b) * p.out_batch_stride + int64_t(t) * p.out_frame_stride;
    const int ht = t - (p.frames_per_batch - 2);
    if (history != nullptr) {
        history = ht >= 0 ? history + int64_t(b) * p.history_batch_stride + int64_t(ht) * p.history_frame_stride
                          : nullptr;
    }

    uint4 row_bits[R][NV];  // bf16 x 8 per vector
    uint4 residual_bits[HAS_RESIDUAL ? R : 1][NV];
#pragma unroll
    for (int r = 0; r < R; ++r) {
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int c = (k * 32 + lane) * 8;
            const int at = (first_row + r) * channels + c;
            const bool valid = first_row + r < rows && c < channels;
            row_bits[r][k] = valid ? load16<STREAM>(x + at) : make_uint4(0, 0, 0, 0);
            if constexpr (HAS_RESIDUAL) {
                residual_bits[r][k] = valid ? load16<STREAM>(residual + at) : make_uint4(0, 0, 0, 0);
            }
        }
    }
    float sum_sq[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        sum_sq[r] = 0.f;
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int c = (k * 32 + lane) * 8;
            if (first_row + r < rows && c < channels) {
                float v[8];
                unpack8(row_bits[r][k], v);
                if (add) {
                    if constexpr (HAS_RESIDUAL) {
                        float res[8];
                        unpack8(residual_bits[r][k], res);
#pragma unroll
                        for (int i = 0; i < 8; ++i) v[i] += res[i];
                    }
                    if (bias != nullptr) {
                        float add_bias[8];
                        load8_f32(bias + c, add_bias);
#pragma unroll
                        for (int i = 0; i < 8; ++i) v[i] += add_bias[i];
                    }
                    // The sum is stored in bf16 (it is the next block's residual input); normalise
                    // exactly what is stored.
                    row_bits[r][k] = pack8(v);
                    unpack8(row_bits[r][k], v);
                    if (sum_out != nullptr) store16<false>(sum_out + (first_row + r) * channels + c, row_bits[r][k]);
                }
#pragma unroll
                for (int i = 0; i < 8; ++i) sum_sq[r] += v[i] * v[i];
            }
        }
    }
    if (!p.normalize) {
        // Plain sum (already rounded to bf16 above when anything was added).
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (first_row + r >= rows) continue;
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int c = (k * 32 + lane) * 8;
                if (c >= channels) continue;
                const int at = (first_row + r) * channels + c;
                store16<STREAM>(out + at, row_bits[r][k]);
                if (history != nullptr) store16<false>(history + at, row_bits[r][k]);
            }
        }
        return;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
#pragma unroll
        for (int r = 0; r < R; ++r) sum_sq[r] += __shfl_xor_sync(0xffffffffu, sum_sq[r], offset);
    // F.normalize: x / max(||x||, eps) with eps = 1e-12 on the norm.
#pragma unroll
    for (int r = 0; r < R; ++r) sum_sq[r] = 1.f / fmaxf(sqrtf(sum_sq[r]), 1e-12f);  // now the inverse norm
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int c = (k * 32 + lane) * 8;
        if (c >= channels) continue;
        float g[8];
        load8_f32(gamma + c, g);
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (first_row + r >= rows) continue;
            float y[8];
            unpack8(row_bits[r][k], y);
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float n = y[i] * sum_sq[r] * g[i];
                y[i] = p.silu ? n / (1.f + __expf(-n)) : n;
            }
            const uint4 bits = pack8(y);
            const int at = (first_row + r) * channels + c;
            store16<STREAM>(out + at, bits);
            if (history != nullptr) store16<false>(history + at, bits);
        }
    }
}

template <int NV, int R, bool HAS_RESIDUAL, bool STREAM>
void launch(const RmsNormParams& p, cudaStream_t stream) {
    const int64_t rows_per_block = int64_t(kWarpsPerBlock) * R;
    const dim3 grid(static_cast<unsigned>((p.rows_per_frame + rows_per_block - 1) / rows_per_block),
                    static_cast<unsigned>(p.num_frames));
    rms_norm_silu_kernel<NV, R, HAS_RESIDUAL, STREAM><<<grid, kWarpsPerBlock * 32, 0, stream>>>(
        p, p.x, p.residual, p.bias, p.gamma, p.sum_out, p.out, p.history);
}

// About 4 (with a residual: 2 x 2) vectors of 8 channels in flight per lane whatever C is.
template <int NV, int R, bool STREAM>
void launch_rows(const RmsNormParams& p, cudaStream_t stream) {
    if (p.residual != nullptr)
        launch<NV, R, true, STREAM>(p, stream);
    else
        launch<NV, 2 * R, false, STREAM>(p, stream);
}

}  // namespace

void rms_norm_silu(const RmsNormParams& p, cudaStream_t stream) {
    // The kernel's offsets within a frame are 32-bit (pybind11 turns this into a ValueError).
    if (p.rows_per_frame * p.channels >= (int64_t(1) << 31)) {
        throw std::invalid_argument("rms_norm_silu: a frame of 2^31 elements or more");
    }
    // The read-only (non-coherent) loads and evict-first stores measured faster at C <= 256 only (3.84
    // against 3.58 TB/s; slower at 512 and 1024), and need x and the residual not to be written by the
    // kernel (`sum_out` may be x itself: the sum stored in place).
    const int nv = (p.channels + 255) / 256;
    const bool in_place = p.sum_out != nullptr && (p.sum_out == p.x || p.sum_out == p.residual);
    if (nv <= 1 && !in_place)
        launch_rows<1, 4, true>(p, stream);
    else if (nv <= 1)
        launch_rows<1, 4, false>(p, stream);
    else if (nv == 2)
        launch_rows<2, 2, false>(p, stream);
    else
        launch_rows<4, 1, false>(p, stream);
}

}  // namespace wan22
