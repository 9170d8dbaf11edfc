// Head epilogue: conv_out (12 channels) + bias -> unpatchify -> clamp -> uint8, frames written once.
#include "decode_kernels.h"

namespace wan22 {
namespace {

__global__ void head_to_uint8_kernel(HeadParams p) {
    const int64_t total = int64_t(p.frames) * p.height * p.width;
    for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
         idx += int64_t(gridDim.x) * blockDim.x) {
        const int w = int(idx % p.width);
        const int64_t rest = idx / p.width;
        const int h = int(rest % p.height);
        const int64_t n = rest / p.height;
        const __nv_bfloat16* y = p.y + idx * 12;
        uint8_t px[12];
#pragma unroll
        for (int k = 0; k < 12; ++k) {
            // The reference's conv adds its bias in bf16, then clamps; uint8 = round((v + 1) * 127.5).
            float v = __bfloat162float(__float2bfloat16_rn(__bfloat162float(y[k]) + p.bias[k]));
            v = fminf(fmaxf(v, -1.f), 1.f);
            px[k] = static_cast<uint8_t>(fminf(fmaxf(rintf((v + 1.f) * 127.5f), 0.f), 255.f));
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
