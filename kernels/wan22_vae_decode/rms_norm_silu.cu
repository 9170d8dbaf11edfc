// Fused (bias +) (residual +) RMS norm (+ SiLU) over the channels of channels-last bf16 rows.
// One warp per row; each lane holds up to 4 vectors of 8 bf16 in registers (C <= 1024).
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

template <int NV>  // vectors of 8 channels per lane: ceil(C / 256)
__global__ void __launch_bounds__(kWarpsPerBlock * 32) rms_norm_silu_kernel(RmsNormParams p) {
    const int lane = threadIdx.x & 31;
    const int64_t row = int64_t(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
    const int64_t total_rows = p.rows_per_frame * p.num_frames;
    if (row >= total_rows) return;
    const int64_t frame = row / p.rows_per_frame;
    const int64_t pos = row - frame * p.rows_per_frame;
    const int64_t b = frame / p.frames_per_batch;
    const int64_t t = frame - b * p.frames_per_batch;
    const int64_t x_off = frame * p.x_frame_stride + pos * p.channels;
    const int64_t out_off = b * p.out_batch_stride + t * p.out_frame_stride + pos * p.channels;

    float v[NV][8];
    float sum_sq = 0.f;
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int c = (k * 32 + lane) * 8;
        if (c < p.channels) {
            load8(p.x + x_off + c, v[k]);
            if (p.bias != nullptr) {
#pragma unroll
                for (int i = 0; i < 8; ++i) v[k][i] += p.bias[c + i];
            }
            if (p.residual != nullptr) {
                float r[8];
                load8(p.residual + x_off + c, r);
#pragma unroll
                for (int i = 0; i < 8; ++i) v[k][i] += r[i];
            }
            if (p.bias != nullptr || p.residual != nullptr) {
                // The sum is stored in bf16 (it is the next block's residual input); normalise
                // exactly what is stored.
#pragma unroll
                for (int i = 0; i < 8; ++i) v[k][i] = __bfloat162float(__float2bfloat16_rn(v[k][i]));
                if (p.sum_out != nullptr) store8(p.sum_out + x_off + c, v[k]);
            }
#pragma unroll
            for (int i = 0; i < 8; ++i) sum_sq += v[k][i] * v[k][i];
        }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
    // F.normalize: x / max(||x||, eps) with eps = 1e-12 on the norm.
    const float inv_norm = 1.f / fmaxf(sqrtf(sum_sq), 1e-12f);
#pragma unroll
    for (int k = 0; k < NV; ++k) {
        const int c = (k * 32 + lane) * 8;
        if (c < p.channels) {
            float y[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                float n = v[k][i] * inv_norm * p.gamma[c + i];
                y[i] = p.silu ? n / (1.f + __expf(-n)) : n;
            }
            store8(p.out + out_off + c, y);
        }
    }
}

}  // namespace

void rms_norm_silu(const RmsNormParams& p, cudaStream_t stream) {
    const int64_t rows = p.rows_per_frame * p.num_frames;
    const dim3 grid(static_cast<unsigned>((rows + kWarpsPerBlock - 1) / kWarpsPerBlock));
    const dim3 block(kWarpsPerBlock * 32);
    const int nv = (p.channels + 255) / 256;
    if (nv <= 1)
        rms_norm_silu_kernel<1><<<grid, block, 0, stream>>>(p);
    else if (nv == 2)
        rms_norm_silu_kernel<2><<<grid, block, 0, stream>>>(p);
    else
        rms_norm_silu_kernel<4><<<grid, block, 0, stream>>>(p);
}

}  // namespace wan22
