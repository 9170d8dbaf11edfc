// Four-phase resampler epilogue: interleave the four output-parity phases of the low-resolution 2x2
// convolution into the 2x upsampled frame, adding the conv bias and the DupUp3D shortcut.
//
// A block writes whole 8-channel vectors of one output row: threadIdx.x is the vector (C / 8 of them),
// threadIdx.y a column, and each thread takes kColumns columns, loading all of them before it adds and
// stores (loads in flight decide the speed of this kernel, as of the norm's). Everything that depends on the
// row and frame only is computed once per thread, and there is no division per vector.
#include "decode_kernels.h"

namespace wan22 {
namespace {

constexpr int kThreads = 256;
constexpr int kColumns = 4;

__device__ __forceinline__ void add_bf16x8(const uint4& raw, float acc[8]) {
    const __nv_bfloat162* h2 = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
    for (int k = 0; k < 4; ++k) {
        const float2 v = __bfloat1622float2(h2[k]);
        acc[2 * k] += v.x;
        acc[2 * k + 1] += v.y;
    }
}

// kStep: shortcut channels per output channel when the DupUp3D index of output channel c is
// kStep * c + offset, the offset a constant per row and column parity (0 for kStep 1, 0 or 1 for kStep 2):
// 1 (every decoder upsampler but up_blocks.2's) or 2 (up_blocks.2: twice the input channels); 0 for any
// other shape (an index and a 2-byte load per value).
template <int kStep>
__global__ void __launch_bounds__(kThreads) phase_interleave_kernel(PhaseInterleaveParams p) {
    constexpr int kWindow = kStep > 0 ? kStep : 1;  // 16-byte shortcut loads per column (none read for kStep 0)
    const int ch = threadIdx.x * 8;
    const int y = blockIdx.y;
    const int frame = blockIdx.z;  // b * frames_out + f
    const int b = frame / p.frames_out;
    const int f = frame - b * p.frames_out;
    const int a = y & 1, i = y >> 1;
    const int out_w = 2 * p.width;
    const int64_t C = p.channels;

    // Phase 2a + c' of input pixel (i + a, j + c') lands on output (2i + a, 2j + c').
    const __nv_bfloat16* phase_row =
        p.phases + (int64_t(frame) * (p.height + 1) + i + a) * (p.width + 1) * 4 * C + 2 * a * C + ch;
    const __nv_bfloat16* shortcut_row = nullptr;
    int a_t = 0;
    if (p.shortcut != nullptr) {
        const int g = f + p.frame_offset;
        const int t_src = g / p.factor_t;
        a_t = g - t_src * p.factor_t;
        shortcut_row = p.shortcut + ((int64_t(b) * p.frames_in + t_src) * p.height + i) * p.width * p.shortcut_channels;
    }
    // DupUp3D: output channel c at (a_t, a, c') reads input channel (((c f_t + a_t) 2 + a) 2 + c') / repeats,
    // i.e. kStep * c + (offset_even or offset_odd by c') when repeats * kStep = 4 f_t.
    const int offset_even = (4 * a_t + 2 * a) / p.repeats, offset_odd = (4 * a_t + 2 * a + 1) / p.repeats;

    uint4 phase[kColumns];
    uint4 shortcut[kColumns][kWindow];
    bool valid[kColumns];
#pragma unroll
    for (int u = 0; u < kColumns; ++u) {
        const int x = (blockIdx.x * kColumns + u) * blockDim.y + threadIdx.y;
        valid[u] = x < out_w;
        if (!valid[u]) continue;
        const int c2 = x & 1, j = x >> 1;
        phase[u] = *reinterpret_cast<const uint4*>(phase_row + (int64_t(j + c2) * 4 + c2) * C);
        if (kStep > 0 && shortcut_row != nullptr) {
            // kStep * 8 consecutive channels from an aligned start (for kStep 1 the offset is 0): every
            // kStep-th of them is ours (below).
            const uint4* s4 =
                reinterpret_cast<const uint4*>(shortcut_row + int64_t(j) * p.shortcut_channels + kStep * ch);
#pragma unroll
            for (int v = 0; v < kWindow; ++v) shortcut[u][v] = s4[v];
        }
    }

    const float4 b0 = *reinterpret_cast<const float4*>(p.bias + ch);
    const float4 b1 = *reinterpret_cast<const float4*>(p.bias + ch + 4);
#pragma unroll
    for (int u = 0; u < kColumns; ++u) {
        if (!valid[u]) continue;
        const int x = (blockIdx.x * kColumns + u) * blockDim.y + threadIdx.y;
        const int c2 = x & 1, j = x >> 1;
        float acc[8] = {b0.x, b0.y, b0.z, b0.w, b1.x, b1.y, b1.z, b1.w};
        add_bf16x8(phase[u], acc);  // bias + phase: fp32, as the conv's epilogue would add it
        if (shortcut_row != nullptr) {
            if (kStep == 1) {
                add_bf16x8(shortcut[u][0], acc);
            } else if (kStep == 2) {
                // channels 2k and 2k + 1 of the window are one bf16 pair: the offset (0 or 1) picks one
                const bool odd = (c2 ? offset_odd : offset_even) != 0;
                const __nv_bfloat162* pairs = reinterpret_cast<const __nv_bfloat162*>(shortcut[u]);
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    const float2 v = __bfloat1622float2(pairs[k]);
                    acc[k] += odd ? v.y : v.x;
                }
            } else {
                const __nv_bfloat16* s = shortcut_row + int64_t(j) * p.shortcut_channels;
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
        *reinterpret_cast<uint4*>(p.out + ((int64_t(frame) * 2 * p.height + y) * out_w + x) * C + ch) = packed;
    }
}

}  // namespace

void phase_interleave(const PhaseInterleaveParams& p, cudaStream_t stream) {
    const int vecs = p.channels / 8;  // at most kThreads (binding.cpp checks C <= 2048)
    const dim3 block(vecs, kThreads / vecs > 0 ? kThreads / vecs : 1);
    const int columns_per_block = block.y * kColumns;
    const dim3 grid((2 * p.width + columns_per_block - 1) / columns_per_block, 2 * p.height, p.batch * p.frames_out);
    // The DupUp3D index is kStep * c + offset when repeats * kStep = 4 * factor_t.
    const int step = (4 * p.factor_t) % p.repeats == 0 ? 4 * p.factor_t / p.repeats : 0;
    if (p.shortcut != nullptr && step == 2)
        phase_interleave_kernel<2><<<grid, block, 0, stream>>>(p);
    else if (p.shortcut == nullptr || step == 1)
        phase_interleave_kernel<1><<<grid, block, 0, stream>>>(p);
    else
        phase_interleave_kernel<0><<<grid, block, 0, stream>>>(p);
}

}  // namespace wan22
