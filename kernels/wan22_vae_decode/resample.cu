// Four-phase resampler epilogue: interleave the four output-parity phases of the low-resolution 2x2
// convolution into the 2x upsampled frame, adding the conv bias and the DupUp3D shortcut.
// Each thread writes 8 consecutive channels of one output pixel (16-byte loads and stores).
#include "decode_kernels.h"

namespace wan22 {
namespace {

// Grid: x over (output column, 8-channel vector) of one output row, y = output row, z = output frame.
__global__ void phase_interleave_kernel(PhaseInterleaveParams p) {
    const int vecs = p.channels / 8;
    const int out_w = 2 * p.width;
    const int id = blockIdx.x * blockDim.x + threadIdx.x;
    if (id >= out_w * vecs) return;
    const int cv = id % vecs;
    const int x = id / vecs;
    const int y = blockIdx.y;
    const int frame = blockIdx.z;  // b * frames_out + f
    const int b = frame / p.frames_out;
    const int f = frame - b * p.frames_out;
    const int a = y & 1, i = y >> 1, c2 = x & 1, j = x >> 1;
    const int ch = cv * 8;

    const __nv_bfloat16* src = p.phases +
        ((int64_t(frame) * (p.height + 1) + (i + a)) * (p.width + 1) + (j + c2)) * (4 * int64_t(p.channels)) +
        (2 * a + c2) * p.channels + ch;
    float acc[8];
    {
        const uint4 raw = *reinterpret_cast<const uint4*>(src);
        const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
        const float4 b0 = *reinterpret_cast<const float4*>(p.bias + ch);
        const float4 b1 = *reinterpret_cast<const float4*>(p.bias + ch + 4);
        const float bias[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            float2 v = __bfloat1622float2(h2[k]);
            acc[2 * k] = v.x + bias[2 * k];
            acc[2 * k + 1] = v.y + bias[2 * k + 1];
        }
    }
    if (p.shortcut != nullptr) {
        // DupUp3D: repeat-interleave the input channels, then channel -> (t, h, w) shuffle.
        const int g = f + p.frame_offset;
        const int t_src = g / p.factor_t, a_t = g - t_src * p.factor_t;
        const __nv_bfloat16* s = p.shortcut +
            (((int64_t(b) * p.frames_in + t_src) * p.height + i) * p.width + j) * p.shortcut_channels;
        const int first = (((ch * p.factor_t + a_t) * 2 + a) * 2 + c2) / p.repeats;
        const int last = ((((ch + 7) * p.factor_t + a_t) * 2 + a) * 2 + c2) / p.repeats;
        if (last - first == 7 && (first & 7) == 0) {
            // Eight consecutive input channels (plain duplication): one 16-byte load.
            const uint4 raw = *reinterpret_cast<const uint4*>(s + first);
            const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                float2 v = __bfloat1622float2(h2[k]);
                acc[2 * k] += v.x;
                acc[2 * k + 1] += v.y;
            }
        } else {
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const int c = ch + k;
                acc[k] += __bfloat162float(s[(((c * p.factor_t + a_t) * 2 + a) * 2 + c2) / p.repeats]);
            }
        }
    }
    uint4 packed;
    __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
    for (int k = 0; k < 4; ++k) o2[k] = __floats2bfloat162_rn(acc[2 * k], acc[2 * k + 1]);
    *reinterpret_cast<uint4*>(p.out + ((int64_t(frame) * 2 * p.height + y) * out_w + x) * p.channels + ch) = packed;
}

}  // namespace

void phase_interleave(const PhaseInterleaveParams& p, cudaStream_t stream) {
    const int threads = 256;
    const int per_row = 2 * p.width * (p.channels / 8);
    const dim3 grid((per_row + threads - 1) / threads, 2 * p.height, p.batch * p.frames_out);
    phase_interleave_kernel<<<grid, threads, 0, stream>>>(p);
}

}  // namespace wan22
