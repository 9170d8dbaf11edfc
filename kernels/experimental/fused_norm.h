// Launchers of the fused-norm prototype (this folder; its extension's binding is binding.cpp), for the binding.
#pragma once

#include "../wan22_vae_decode/decode_kernels.h"

namespace wan22 {

// inv_rms[pixel] = 1 / max(||x[pixel, :]||_2, 1e-12) (F.normalize's eps), fp32 statistics; x dense
// [pixels, C] bf16 (C a multiple of 8), inv_rms dense [pixels] fp32.
void rms_inv(const __nv_bfloat16* x, int64_t pixels, int c, float* inv_rms, cudaStream_t stream);

// conv(SiLU(x · inv_rms[pixel] · gamma[c])) + bias: `p` as for conv_cutlass with x dense, inv_rms dense over
// x's pixels, gamma [C] fp32 (γ · sqrt(C)). sm_90a builds only; nullptr on success, else why not.
const char* conv_cutlass_norm(const ConvParams& p, const float* inv_rms, const float* gamma, cudaStream_t stream);

}  // namespace wan22
