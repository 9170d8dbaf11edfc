// RMS norm + SiLU applied to the conv's activation operand in shared memory (the fused norm; a PROTOTYPE,
// measured 2.7-3x slower than the two passes (docs/KERNEL_NOTES.md), not in the decode build. Its
// translation unit is conv_cutlass_norm_256x128p_1x2.cu, its extension this folder's binding.cpp).
//
// The conv reads the block's raw input x (bf16, channels last) and computes conv(SiLU(x · inv_rms · γ)):
// after the TMA has written an activation tile [TileM pixels x 64 channels of one tap] into shared
// memory, the two MMA warp groups rewrite it in place as
//
//     y = SiLU(x · (inv_rms[input pixel] · γ[c])),   SiLU(v) = v/2 · (1 + tanh(v/2))   (fp32, one MUFU op)
//
// rounded once to bf16 (round to nearest even), make the writes visible to the tensor cores' async proxy
// (fence.proxy.async), meet at a named barrier, and only then issue the tile's wgmma. The rewrite of
// stage k runs while the MMAs of stage k-1 are in flight (wgmma is asynchronous), the FA3 pattern.
// Zeros stay zeros (SiLU(0) = 0): the TMA's out-of-bounds fill (the width padding) needs no mask, and
// pixels with no input (past the last output row, or in the padding) take inv_rms = 0.
//
// inv_rms: one fp32 per input pixel, 1 / max(||x[pixel, :]||, eps), laid out like x's pixels (x's strides
// divided by C); γ: fp32 [C], the norm's γ times sqrt(C) (as the decoder keeps it). The order of every
// sum is the plain conv's: the transform changes operands, not the K loop.
//
// Budget (docs/KERNEL_NOTES.md): 8 values per clock per SM at full MMA rate, one tanh.approx each
// (the MUFU does 16 per clock), about half the consumer warps' issue slots.
#pragma once

#include "../wan22_vae_decode/conv_cutlass_persistent.cuh"

#if defined(PAN2_CUTLASS_CONV) && PAN2_CUTLASS_CONV == 90

#include <cuda_bf16.h>

#include "cutlass/arch/barrier.h"

namespace wan22::cutlass_conv {

struct NormSiluOperand {
    static constexpr bool kEnabled = true;
    static constexpr int kMmaThreads = 2 * cutlass::NumThreadsPerWarpGroup;
    static constexpr int kChunks = 8;  // 16-byte chunks of 8 channels in a 64-channel row

    struct Params {
        const float* inv_rms;  // per input pixel, at x's pixel strides
        const float* gamma;    // [C]
        int64_t pixel_stride_n, pixel_stride_d, pixel_stride_h;  // x's strides / C (width stride 1)
        int w;                                                    // input width (the conv pads it)
        int out_d, out_h, out_w;                                  // output frames, rows, columns
        int kh, kw, pad_w;
        int c_blocks;     // C / 64: K steps per tap
        int64_t m_total;  // output pixels
    };

    // The pixels a thread rewrites in every K step of a tile: rows (thread / 8) + 32 i of the tile, each
    // as the input pixel under tap (0, 0, 0) (without the width padding) and its output column.
    template <int TileM>
    struct Rows {
        static constexpr int kCount = TileM * kChunks / kMmaThreads;
        int64_t base[kCount];
        int column[kCount];  // -1: past the last output pixel
    };

    template <int TileM>
    CUTLASS_DEVICE static void tile_rows(Params const& p, int64_t tile_m, int thread, Rows<TileM>& rows) {
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < Rows<TileM>::kCount; ++i) {
            const int64_t m = tile_m * TileM + thread / kChunks + (kMmaThreads / kChunks) * i;
            if (m >= p.m_total) {
                rows.base[i] = 0;
                rows.column[i] = -1;
                continue;
            }
            const int q = int(m % p.out_w);
            int64_t rest = m / p.out_w;
            const int row = int(rest % p.out_h);
            rest /= p.out_h;
            const int frame = int(rest % p.out_d);
            const int64_t n = rest / p.out_d;
            rows.base[i] = n * p.pixel_stride_n + frame * p.pixel_stride_d + row * p.pixel_stride_h + q;
            rows.column[i] = q;
        }
    }

    CUTLASS_DEVICE static float silu(float v) {
        const float half = 0.5f * v;
        float t;
        asm("tanh.approx.f32 %0, %1;" : "=f"(t) : "f"(half));
        return fmaf(half, t, half);
    }

    // Rewrite K step `k_tile` (64 channels of one tap; the collective walks channels fastest, then the
    // taps in (kw, kh, kt) order) of the activation tile `stage` of sA in place.
    template <int TileM, class TensorA>
    CUTLASS_DEVICE static void transform(Params const& p, TensorA& sA, int stage, int k_tile, int thread,
                                         Rows<TileM> const& rows) {
        const int c_block = k_tile % p.c_blocks;
        const int tap = k_tile / p.c_blocks;
        const int s = tap % p.kw, r = (tap / p.kw) % p.kh, t = tap / (p.kw * p.kh);
        const int chunk = thread % kChunks;
        const float4* gamma = reinterpret_cast<const float4*>(p.gamma + c_block * 64 + chunk * 8);
        const float4 g0 = __ldg(gamma), g1 = __ldg(gamma + 1);
        const float g[8] = {g0.x, g0.y, g0.z, g0.w, g1.x, g1.y, g1.z, g1.w};
        const int64_t tap_offset = t * p.pixel_stride_d + r * p.pixel_stride_h + (s - p.pad_w);
        CUTLASS_PRAGMA_UNROLL
        for (int i = 0; i < Rows<TileM>::kCount; ++i) {
            const int row = thread / kChunks + (kMmaThreads / kChunks) * i;
            const int column = rows.column[i] + s - p.pad_w;
            const float inv = rows.column[i] >= 0 && column >= 0 && column < p.w
                                  ? __ldg(p.inv_rms + rows.base[i] + tap_offset)
                                  : 0.0f;
            // 8 consecutive channels stay one 16-byte chunk under the 128-byte swizzle.
            uint4* where = reinterpret_cast<uint4*>(&sA(row, chunk * 8, stage));
            uint4 packed = *where;
            __nv_bfloat162* pairs = reinterpret_cast<__nv_bfloat162*>(&packed);
            CUTLASS_PRAGMA_UNROLL
            for (int j = 0; j < 4; ++j) {
                const float2 x = __bfloat1622float2(pairs[j]);
                pairs[j] = __floats2bfloat162_rn(silu(x.x * (inv * g[2 * j])), silu(x.y * (inv * g[2 * j + 1])));
            }
            *where = packed;
        }
    }

    // The MMA warp groups' K loop of one tile: the collective's (one MMA batch in flight, stages released
    // as their MMAs retire), with each stage rewritten before its MMAs. Releases every stage it reads.
    template <class Mainloop, class TiledMma, class Accumulators>
    CUTLASS_DEVICE static void mma(Params const& p, int64_t tile_m, typename Mainloop::MainloopPipeline pipeline,
                                   typename Mainloop::PipelineState state, Accumulators& accum, int k_tiles,
                                   int thread, typename Mainloop::TensorStorage& shared) {
        using namespace cute;
        constexpr int TileM = size<0>(typename Mainloop::TileShape{});
        static_assert(size(TiledMma{}) == kMmaThreads);
        Rows<TileM> rows;
        tile_rows<TileM>(p, tile_m, thread, rows);

        Tensor sA = make_tensor(make_smem_ptr(shared.smem_A.data()), typename Mainloop::SmemLayoutA{});
        Tensor sB = make_tensor(make_smem_ptr(shared.smem_B.data()), typename Mainloop::SmemLayoutB{});
        TiledMma tiled_mma;
        auto thread_mma = tiled_mma.get_thread_slice(thread);
        Tensor tCrA = thread_mma.make_fragment_A(thread_mma.partition_A(sA));  // (MMA, MMA_M, MMA_K, PIPE)
        Tensor tCrB = thread_mma.make_fragment_B(thread_mma.partition_B(sB));  // (MMA, MMA_N, MMA_K, PIPE)

        auto release = state;
        tiled_mma.accumulate_ = GMMA::ScaleOut::Zero;
        warpgroup_fence_operand(accum);
        for (int k_tile = 0; k_tile < k_tiles; ++k_tile) {
            pipeline.consumer_wait(state);
            const int stage = state.index();
            transform<TileM>(p, sA, stage, k_tile, thread, rows);
            cutlass::arch::fence_view_async_shared();  // generic-proxy writes, then wgmma's reads
            cutlass::arch::NamedBarrier::sync(kMmaThreads, cutlass::arch::ReservedNamedBarriers::TransformBarrier);
            warpgroup_fence_operand(accum);
            warpgroup_arrive();
            CUTLASS_PRAGMA_UNROLL
            for (int k_block = 0; k_block < size<2>(tCrA); ++k_block) {
                cute::gemm(tiled_mma, tCrA(_, _, k_block, stage), tCrB(_, _, k_block, stage), accum);
                tiled_mma.accumulate_ = GMMA::ScaleOut::One;
            }
            warpgroup_commit_batch();
            warpgroup_wait<1>();  // the previous step's MMAs are done: its stage goes back to the producer
            warpgroup_fence_operand(accum);
            if (k_tile > 0) {
                pipeline.consumer_release(release);
                ++release;
            }
            ++state;
        }
        warpgroup_wait<0>();
        warpgroup_fence_operand(accum);
        if (k_tiles > 0) pipeline.consumer_release(release);
    }
};

}  // namespace wan22::cutlass_conv

#endif
