// PROTOTYPE of the fused norm: conv(SiLU(RMS-norm(x))) with the norm applied to the activation tile in
// shared memory (conv_cutlass_norm.cuh), on the decode's 256x128 tiles in clusters of 1x2. Its own extension
// (this folder's binding.cpp, `pan2cli.vae.kernel.prototypes`), never the decode's, and not in the wheel;
// `pytest -m slow` compiles it for sm_90a (tests/vae/kernel/test_conv_cutlass.py) so that it keeps building.
// Measured 2.7-3.0x slower than the two passes (docs/KERNEL_NOTES.md says why and what a next version needs).
#include "fused_norm.h"
#include "conv_cutlass_norm.cuh"

namespace wan22 {
#if defined(PAN2_CUTLASS_CONV) && PAN2_CUTLASS_CONV == 90

// inv_rms is indexed at x's pixel strides (x's strides / C), so a dense inv_rms needs a dense x.
const char* conv_cutlass_norm(const ConvParams& p, const float* inv_rms, const float* gamma, cudaStream_t stream) {
    using namespace cutlass_conv;
    if (p.c % 64 != 0) return "the fused norm needs whole 64-channel steps";
    for (int i = 0; i < 3; ++i) {
        if (p.x_strides[i] % p.c != 0) return "x's strides must be whole pixels";
    }
    NormSiluOperand::Params norm{};
    norm.inv_rms = inv_rms;
    norm.gamma = gamma;
    norm.pixel_stride_n = p.x_strides[0] / p.c;
    norm.pixel_stride_d = p.x_strides[1] / p.c;
    norm.pixel_stride_h = p.x_strides[2] / p.c;
    norm.w = p.w;
    norm.out_d = p.d - p.kt + 1;
    norm.out_h = p.h - p.kh + 1;
    norm.out_w = p.w + 2 * p.pad_w - p.kw + 1;
    norm.kh = p.kh;
    norm.kw = p.kw;
    norm.pad_w = p.pad_w;
    norm.c_blocks = p.c / 64;
    norm.m_total = int64_t(p.n) * norm.out_d * norm.out_h * norm.out_w;
    return run_persistent<PersistentConfig<256, 128, 1, 2, NormSiluOperand>>(p, stream, norm);
}

#else
const char* conv_cutlass_norm(const ConvParams&, const float*, const float*, cudaStream_t) {
    return "the fused-norm conv is built for sm_90a only";
}
#endif
}  // namespace wan22
