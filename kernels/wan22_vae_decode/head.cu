// Head epilogue: conv_out's three time partials (fp32) + bias -> unpatchify -> clamp -> uint8, each
// output frame written once.
#include "decode_kernels.h"

namespace wan22 {
namespace {

// Channels [12 k, 12 k + 12) of a pixel's partials: 12 fp32 values as three 16-byte loads.
__device__ __forceinline__ void load12(const float* src, float v[12]) {
    const float4* s = reinterpret_cast<const float4*>(src);
#pragma unroll
    for (int i = 0; i < 3; ++i) {
        const float4 q = s[i];
        v[4 * i] = q.x;
        v[4 * i + 1] = q.y;
        v[4 * i + 2] = q.z;
        v[4 * i + 3] = q.w;
    }
}

__global__ void head_to_uint8_kernel(HeadParams p) {
    const int64_t total = int64_t(p.frames) * p.height * p.width;
    for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
         idx += int64_t(gridDim.x) * blockDim.x) {
        const int w = int(idx % p.width);
        const int64_t rest = idx / p.width;
        const int h = int(rest % p.height);
        const int64_t n = rest / p.height;
        // y(f) = P_2(f) + P_1(f - 1) + P_0(f - 2) + bias, summed in fp32 in this order (one fixed order
        // whatever the split or chunk), never rounded to bf16: the frame's only rounding is the uint8 one.
        float v[12], t[12];
        load12(p.current + idx * 36 + 24, v);
        if (p.previous != nullptr) {
            load12(p.previous + idx * 36 + 12, t);
#pragma unroll
            for (int k = 0; k < 12; ++k) v[k] += t[k];
        }
        if (p.before != nullptr) {
            load12(p.before + idx * 36, t);
#pragma unroll
            for (int k = 0; k < 12; ++k) v[k] += t[k];
        }
        uint8_t px[12];
#pragma unroll
        for (int k = 0; k < 12; ++k) {
            // uint8 = round_half_even((clamp(y + bias, -1, 1) + 1) * 127.5)
            const float y = fminf(fmaxf(v[k] + p.bias[k], -1.f), 1.f);
            px[k] = static_cast<uint8_t>(fminf(fmaxf(rintf((y + 1.f) * 127.5f), 0.f), 255.f));
        }
        // channel k = c*4 + r*2 + q -> colour c at row offset q, column offset r
        const int64_t out_w = 2 * int64_t(p.width);
#pragma unroll
        for (int q = 0; q < 2; ++q) {
            uint8_t* row = p.out + ((n * 2 * p.height + 2 * h + q) * out_w + 2 * w) * 3;
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int c = 0; c < 3; ++c) row[r * 3 + c] = px[c * 4 + r * 2 + q];
        }
    }
}

}  // namespace

void head_to_uint8(const HeadParams& p, cudaStream_t stream) {
    const int64_t total = int64_t(p.frames) * p.height * p.width;
    const int threads = 256;
    const int64_t blocks = (total + threads - 1) / threads;
    const unsigned grid = static_cast<unsigned>(blocks < (1 << 30) ? blocks : (1 << 30));
    head_to_uint8_kernel<<<grid, threads, 0, stream>>>(p);
}

}  // namespace wan22
