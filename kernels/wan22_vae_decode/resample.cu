// Four-phase resampler epilogue: interleave the four output-parity phases of the low-resolution 2x2
// convolution into the 2x upsampled frame, adding the conv bias and the DupUp3D shortcut.
// Each thread writes 8 consecutive channels of one output pixel (16-byte loads and stores).
#include "decode_kernels.h"

namespace wan22 {
namespace {

__global__ void phase_interleave_kernel(PhaseInterleaveParams p) {
    const int vecs = p.channels / 8;
    const int64_t out_w = 2 * int64_t(p.width), out_h = 2 * int64_t(p.height);
    const int64_t total = int64_t(p.batch) * p.frames_out * out_h * out_w * vecs;
    for (int64_t idx = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; idx < total;
         idx += int64_t(gridDim.x) * blockDim.x) {
        int64_t rest = idx;
        const int cv = int(rest % vecs);
        rest /= vecs;
        const int x = int(rest % out_w);
        rest /= out_w;
        const int y = int(rest % out_h);
        rest /= out_h;
        const int f = int(rest % p.frames_out);
        const int b = int(rest / p.frames_out);
        const int a = y & 1, i = y >> 1, c2 = x & 1, j = x >> 1;
        const int ch = cv * 8;

        const int64_t phase_frame = int64_t(b) * p.frames_out + f;
        const __nv_bfloat16* src = p.phases +
            ((phase_frame * (p.height + 1) + (i + a)) * (p.width + 1) + (j + c2)) * (4 * int64_t(p.channels)) +
            (2 * a + c2) * p.channels + ch;
        float acc[8];
        {
            const uint4 raw = *reinterpret_cast<const uint4*>(src);
            const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                float2 v = __bfloat1622float2(h2[k]);
                acc[2 * k] = v.x + p.bias[ch + 2 * k];
                acc[2 * k + 1] = v.y + p.bias[ch + 2 * k + 1];
            }
        }
        if (p.shortcut != nullptr) {
            // DupUp3D: repeat-interleave the input channels, then channel -> (t, h, w) shuffle.
            const int g = f + p.frame_offset;
            const int t_src = g / p.factor_t, a_t = g - t_src * p.factor_t;
            const __nv_bfloat16* s = p.shortcut +
                (((int64_t(b) * p.frames_in + t_src) * p.height + i) * p.width + j) * p.shortcut_channels;
#pragma unroll
            for (int k = 0; k < 8; ++k) {
                const int c = ch + k;
                const int src_c = (((c * p.factor_t + a_t) * 2 + a) * 2 + c2) / p.repeats;
                acc[k] += __bfloat162float(s[src_c]);
            }
        }
        uint4 packed;
        __nv_bfloat162* o2 = reinterpret_cast<__nv_bfloat162*>(&packed);
#pragma unroll
        for (int k = 0; k < 4; ++k) o2[k] = __floats2bfloat162_rn(acc[2 * k], acc[2 * k + 1]);
        *reinterpret_cast<uint4*>(p.out + (((int64_t(b) * p.frames_out + f) * out_h + y) * out_w + x) * p.channels + ch) =
            packed;
    }
}

}  // namespace

void phase_interleave(const PhaseInterleaveParams& p, cudaStream_t stream) {
    const int64_t total = int64_t(p.batch) * p.frames_out * 4 * int64_t(p.height) * p.width * (p.channels / 8);
    const int threads = 256;
    const int64_t blocks = (total + threads - 1) / threads;
    const unsigned grid = static_cast<unsigned>(blocks < (1 << 30) ? blocks : (1 << 30));
    phase_interleave_kernel<<<grid, threads, 0, stream>>>(p);
}

}  // namespace wan22
