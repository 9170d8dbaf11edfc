// Plain parameter structs and launchers of the Wan2.2 decode kernels. No torch here: binding.cpp is
// the only file that sees at::Tensor. Layout everywhere: channels-last bf16, rows of C contiguous
// channels; a "frame" is H*W rows.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

namespace wan22 {

// y = SiLU?(RMS(x [+ bias] [+ residual]) * gamma), RMS = x / max(||x||_2, 1e-12) over the C channels.
// Statistics and math in fp32; one bf16 rounding of the sum (if stored) and of the output.
// With normalize = false the kernel only adds: y = x [+ bias] [+ residual] (a block output written
// straight into the next conv's input buffer).
struct RmsNormParams {
    const __nv_bfloat16* x;         // rows of C; frame f at x + f * x_frame_stride
    const __nv_bfloat16* residual;  // optional, same layout as x
    const float* bias;              // optional [C], added before the norm (a conv bias)
    const float* gamma;             // [C], already multiplied by sqrt(C)
    __nv_bfloat16* sum_out;         // optional: x + bias + residual (bf16), same layout as x
    __nv_bfloat16* out;             // frame f = (b, t) at out + b * out_batch_stride + t * out_frame_stride
    // Optional: the last two frames of `out` (t >= frames_per_batch - 2) are also written to the conv's
    // causal history, frame t - (T - 2), so the history needs no copy after the conv.
    __nv_bfloat16* history;
    int64_t history_batch_stride;
    int64_t history_frame_stride;
    int64_t x_frame_stride;
    int64_t out_batch_stride;
    int64_t out_frame_stride;
    int64_t rows_per_frame;  // H * W
    int frames_per_batch;    // T
    int num_frames;          // B * T
    int channels;            // C, a multiple of 8, at most 1024
    bool silu;
    bool normalize;
};
void rms_norm_silu(const RmsNormParams& p, cudaStream_t stream);

// Four-phase resampler epilogue: out[b, f, 2i+a, 2j+c', ch] = phases[b*T+f, i+a, j+c', (2a+c')*C + ch]
// + bias[ch] + DupUp3D(shortcut)[b, f, 2i+a, 2j+c', ch]; phases is the 2x2 conv (padding 1) of the
// low-resolution frame, whose four output-parity kernels are stacked along the output channels.
struct PhaseInterleaveParams {
    const __nv_bfloat16* phases;    // [B*T_out, h+1, w+1, 4C]
    const float* bias;              // [C]
    const __nv_bfloat16* shortcut;  // optional: block input [B, T_in, h, w, C_in]
    __nv_bfloat16* out;             // [B, T_out, 2h, 2w, C]
    int batch, frames_out, frames_in, height, width, channels, shortcut_channels;
    int factor_t;      // DupUp3D temporal factor (2 for upsample3d blocks, 1 for upsample2d)
    int repeats;       // DupUp3D channel repeats = C * factor_t * 4 / C_in
    int frame_offset;  // factor_t - 1 on the first chunk (DupUp3D keeps its last frame), else 0
};
void phase_interleave(const PhaseInterleaveParams& p, cudaStream_t stream);

// Head: conv_out as three time partials -> y(f) = P_2(f) + P_1(f-1) + P_0(f-2) + bias in fp32, unpatchify
// (channel c*4 + r*2 + q -> colour c, row offset q, column offset r), clamp to [-1, 1],
// uint8 = round_half_even((y + 1) * 127.5). P_k(f) is the 2-D conv of frame f with conv_out's time tap k
// (fp32, not rounded); a pixel's 36 partial channels are k*12 + output channel.
struct HeadParams {
    const float* current;   // [N, H, W, 36]: the partials of frame f
    const float* previous;  // same, of frame f - 1; nullptr: zeros (the decode's first frame)
    const float* before;    // same, of frame f - 2; nullptr: zeros
    const float* bias;      // [12]
    uint8_t* out;           // [N, 2H, 2W, 3]
    int frames, height, width;
};
void head_to_uint8(const HeadParams& p, cudaStream_t stream);

// Implicit-GEMM convolution (conv_cutlass*.cu): y = conv(x, weight) + bias, fp32 accumulation in one fixed
// order per layer and configuration, one bf16 rounding. Channels-last bf16; H of x already holds the
// halo rows, only W is zero-padded (pad_w columns each side); stride 1, no dilation.
struct ConvParams {
    const __nv_bfloat16* x;  // [N, D, H, W, C], strides in elements (C contiguous, a multiple of 64)
    int64_t x_strides[4];    // N, D, H, W strides
    int n, d, h, w, c;
    const __nv_bfloat16* weight;  // [K, KT, KH, KW, C] dense
    int k, kt, kh, kw;
    const float* bias;   // [K] fp32; zeros for a layer without bias (acc + 0 is acc)
    __nv_bfloat16* out;  // [N, D - KT + 1, H - KH + 1, W + 2 pad_w - KW + 1, K] dense
    int pad_w;
};
// The tile configurations compiled into this build ("128x128", ...), in the order of `config` below;
// empty where the build had no CUTLASS (then conv_cutlass returns an error).
const char* const* cutlass_conv_configs(int* count);
// nullptr on success, else the reason the configuration cannot run the problem.
const char* conv_cutlass(const ConvParams& p, int config, void* workspace, size_t workspace_bytes,
                         cudaStream_t stream);
size_t conv_cutlass_workspace(const ConvParams& p, int config);

}  // namespace wan22
