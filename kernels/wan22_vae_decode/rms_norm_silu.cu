// Fused (bias +) (residual +) RMS norm (+ SiLU), or the plain sum, over the channels of channels-last bf16 rows.
// One warp per row (R rows per warp); a lane holds up to 4 vectors of 8 bf16 per row in registers (C <= 1024).
#include "decode_kernels.h"

namespace wan22 {
namespace {

constexpr int kWarpsPerBlock = 8;

struct alignas(16) Vec8 {
    __nv_bfloat162 v[4];
};

__device__ __forceinline__ void load8(const __nv_bfloat16* ptr, float (&out)[8]) {
    Vec8 raw = *reinterpret_cast<const Vec8*>(ptr);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
        float2 f = __bfloat1622float2(raw.v[i]);
        out[2 * i] = f.x;
        out[2 * i + 1] = f.y;
    }
}

__device__ __forceinline__ void store8(__nv_bfloat16* ptr, const float (&in)[8]) {
    Vec8 raw;
#pragma unroll
    for (int i = 0; i < 4; ++i) raw.v[i] = __floats2bfloat162_rn(in[2 * i], in[2 * i + 1]);
    *reinterpret_cast<Vec8*>(ptr) = raw;
}

// NV: vectors of 8 channels per lane (ceil(C / 256)); R: rows per warp. All R·NV loads of a lane are
// issued before the first reduction, so several 16-byte loads are in flight per thread (a single row of
// 256 channels is one load per lane, too little to cover the memory latency).
template <int NV, int R>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) rms_norm_silu_kernel(RmsNormParams p) {
    // Grid: x = blocks of rows within a frame, y = frame (b * T + t); no per-row division.
    const int lane = threadIdx.x & 31;
    const int frame = blockIdx.y;
    const int b = frame / p.frames_per_batch;
    const int t = frame - b * p.frames_per_batch;
    const int64_t first_pos = (int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5)) * R;
    const int64_t total_rows = p.rows_per_frame;  // rows are positions within this frame below
    const int64_t first_row = first_pos;
    const bool add = p.bias != nullptr || p.residual != nullptr;
    const int64_t x_base = int64_t(frame) * p.x_frame_stride;
    const int64_t out_base = int64_t(b) * p.out_batch_stride + int64_t(t) * p.out_frame_stride;
    const int ht = t - (p.frames_per_batch - 2);
    const int64_t hist_base = (p.history != nullptr && ht >= 0)
                                  ? int64_t(b) * p.history_batch_stride + int64_t(ht) * p.history_frame_stride
                                  : -1;

    float v[R][NV][8];
    int64_t x_off[R], out_off[R], hist_off[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        const int64_t pos = first_pos + r;
        x_off[r] = x_base + pos * p.channels;
        out_off[r] = out_base + pos * p.channels;
        hist_off[r] = hist_base >= 0 ? hist_base + pos * p.channels : -1;
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int c = (k * 32 + lane) * 8;
            if (pos < total_rows && c < p.channels) {
                load8(p.x + x_off[r] + c, v[r][k]);
                if (p.residual != nullptr) {
                    float res[8];
                    load8(p.residual + x_off[r] + c, res);
#pragma unroll
                    for (int i = 0; i < 8; ++i) v[r][k][i] += res[i];
                }
            } else {
#pragma unroll
                for (int i = 0; i < 8; ++i) v[r][k][i] = 0.f;
            }
        }
    }
    float sum_sq[R];
#pragma unroll
    for (int r = 0; r < R; ++r) {
        sum_sq[r] = 0.f;
        const int64_t row = first_row + r;
#pragma unroll
        for (int k = 0; k < NV; ++k) {
            const int c = (k * 32 + lane) * 8;
            if (row < total_rows && c < p.channels) {
                if (p.bias != nullptr) {
                    const float4 b0 = *reinterpret_cast<const float4*>(p.bias + c);
                    const float4 b1 = *reinterpret_cast<const float4*>(p.bias + c + 4);
                    const float bias[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
                    for (int i = 0; i < 8; ++i) v[r][k][i] += bias[i];
                }
                if (add) {
                    // The sum is stored in bf16 (it is the next block's residual input); normalise
                    // exactly what is stored.
#pragma unroll
                    for (int i = 0; i < 8; ++i) v[r][k][i] = __bfloat162float(__float2bfloat16_rn(v[r][k][i]));
                    if (p.sum_out != nullptr) store8(p.sum_out + x_off[r] + c, v[r][k]);
                }
#pragma unroll
                for (int i = 0; i < 8; ++i) sum_sq[r] += v[r][k][i] * v[r][k][i];
            }
        }
    }
    if (!p.normalize) {
        // Plain sum (already rounded to bf16 above when anything was added).
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (first_row + r >= total_rows) continue;
#pragma unroll
            for (int k = 0; k < NV; ++k) {
                const int c = (k * 32 + lane) * 8;
                if (c >= p.channels) continue;
                store8(p.out + out_off[r] + c, v[r][k]);
                if (hist_off[r] >= 0) store8(p.history + hist_off[r] + c, v[r][k]);
            }
        }
        return;
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1)
#pragma unroll
        for (int r = 0; r < R; ++r) sum_sq[r] += __shfl_xor_sync(0xffffffffu, sum_sq[r], offset);
    // F.normalize: x / max(||x||, eps) with eps = 1e-12 on the norm.
    float inv_norm[R];
#pragma unroll
    for (int r = 0; r < R; ++r) inv_norm[r] = 1.f / fmaxf(sqrtf(sum_sq[r]), 1e-12f);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int c = (k * 32 + lane) * 8;
        if (c >= p.channels) continue;
        const float4 g0 = *reinterpret_cast<const float4*>(p.gamma + c);
        const float4 g1 = *reinterpret_cast<const float4*>(p.gamma + c + 4);
        const float gamma[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
#pragma unroll
        for (int r = 0; r < R; ++r) {
            if (first_row + r >= total_rows) continue;
            float y[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float n = v[r][k][i] * inv_norm[r] * gamma[i];
                y[i] = p.silu ? n / (1.f + __expf(-n)) : n;
            }
            store8(p.out + out_off[r] + c, y);
            if (hist_off[r] >= 0) store8(p.history + hist_off[r] + c, y);
        }
    }
}

template <int NV, int R>
void launch(const RmsNormParams& p, cudaStream_t stream) {
    const int64_t rows_per_block = int64_t(kWarpsPerBlock) * R;
    const dim3 grid(static_cast<unsigned>((p.rows_per_frame + rows_per_block - 1) / rows_per_block),
                    static_cast<unsigned>(p.num_frames));
    rms_norm_silu_kernel<NV, R><<<grid, kWarpsPerBlock * 32, 0, stream>>>(p);
}

}  // namespace

void rms_norm_silu(const RmsNormParams& p, cudaStream_t stream) {
    // About 4 vectors of 8 channels in flight per lane whatever C is.
    const int nv = (p.channels + 255) / 256;
    if (nv <= 1)
        launch<1, 4>(p, stream);
    else if (nv == 2)
        launch<2, 2>(p, stream);
    else
        launch<4, 1>(p, stream);
}

}  // namespace wan22
