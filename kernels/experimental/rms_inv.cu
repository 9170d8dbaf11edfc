// Per-pixel inverse L2 norm over the channels (the RMS norm's statistic, for the fused-norm conv's
// operand transform). One warp per pixel, 16-byte loads, fp32 sum of squares reduced across the warp.
#include "fused_norm.h"

namespace wan22 {
namespace {

constexpr int kWarpsPerBlock = 8;

__global__ void __launch_bounds__(kWarpsPerBlock * 32)
    rms_inv_kernel(const __nv_bfloat16* __restrict__ x, int64_t pixels, int c, float* __restrict__ inv_rms) {
    const int lane = threadIdx.x % 32;
    const int64_t pixel = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / 32;
    if (pixel >= pixels) return;
    const uint4* row = reinterpret_cast<const uint4*>(x + pixel * c);
    float sum_sq = 0.f;
    for (int chunk = lane; chunk < c / 8; chunk += 32) {
        uint4 packed = __ldg(row + chunk);
        const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(&packed);
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float2 v = __bfloat1622float2(pairs[j]);
            sum_sq = fmaf(v.x, v.x, fmaf(v.y, v.y, sum_sq));
        }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum_sq += __shfl_xor_sync(0xffffffffu, sum_sq, offset);
    if (lane == 0) inv_rms[pixel] = 1.f / fmaxf(sqrtf(sum_sq), 1e-12f);
}

}  // namespace

void rms_inv(const __nv_bfloat16* x, int64_t pixels, int c, float* inv_rms, cudaStream_t stream) {
    if (pixels == 0) return;
    const int64_t blocks = (pixels + kWarpsPerBlock - 1) / kWarpsPerBlock;
    rms_inv_kernel<<<static_cast<unsigned>(blocks), kWarpsPerBlock * 32, 0, stream>>>(x, pixels, c, inv_rms);
}

}  // namespace wan22
