// The fp8 attention's launcher (fp8_attention.cu), for the binding. No torch here.
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

// out = softmax(Q·Kᵀ/√128)·V on the current device's `stream`: q, k [B, S, H, 128] e4m3; v_t [B, H, 128, S_pad]
// e4m3 (S_pad a multiple of 16, zero past S); real Q·K = q·k · qk_descale[0]; real V[h] = v · v_descale[h];
// out [B, S, H, 128] bf16. `sm_scale_log2` = log2(e)/√128; P is cast to e4m3 as P · 2^p_shift. `stages`
// (3, 4 or 5) K/V stages in shared memory; `ping_pong` the two consumer warpgroups take turns at the MMAs;
// `tma` the tiles come by TMA, and then v_t's keys must be in wgmma order (column key_of_row(c) of each
// 32-key block holds key c: values_fp8(..., key_order="wgmma")), else by cp.async with v_t in key order.
// `key_tile` keys a tile: 128, or 224 (with TMA and three stages only). `v_mean` [B, H·128] float32 or null:
// added to out (V was quantised less its mean over the tokens).
// Returns the launch's error (cudaErrorInvalidValue for another stage count or key tile, or a tensor map the
// driver refuses); sm_90a only (the binding checks).
cudaError_t pan2_fp8_attention_launch(const uint8_t* q, const uint8_t* k, const uint8_t* v_t, const float* qk_descale,
                                      const float* v_descale, const float* v_mean, __nv_bfloat16* out, int batch,
                                      int n_tokens, int n_heads, int s_pad, float sm_scale_log2, float p_shift,
                                      int stages, bool ping_pong, bool tma, int key_tile, cudaStream_t stream);
