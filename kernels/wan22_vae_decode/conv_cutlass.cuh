// Warp-specialised implicit-GEMM convolution of the decoder (CUTLASS 3.x collectives; headers from the
// pinned `nvidia-cutlass` wheel). Included by the conv_cutlass_*.cu files, one tile configuration each,
// so that ninja compiles them in parallel.
//
// Problem: channels-last bf16 activations [N, D, H, W, C] (H already holds the halo rows, so only W is
// padded, by pad_w zero columns), filters [K, KT, KH, KW, C], output [N, D-KT+1, H-KH+1, W', K]
// (W' = W + 2 pad_w - KW + 1), fp32 accumulation, + bias [K] in fp32, one bf16 rounding.
//
// sm_90a: TMA im2col loads of the activation tile and TMA loads of the filter tile by a producer warp
// group, wgmma by the consumer warp group(s), TMA-store epilogue (`KernelImplicitTmaWarpSpecializedSm90`).
// sm_100a: the same problem through CUTLASS's sm100 (tcgen05/UMMA) conv collectives.
//
// Summation order: every output is the dot product over K = (C, KW, KH, KT) walked in the collective's
// fixed order in BLOCK_K steps, one tile shape per configuration, no split-K and no stream-K, so it
// depends on the layer and the configuration only, never on N, D, H or W: a row band (one GPU of
// several) or a chunk of frames gets the same bits as the whole problem.
#pragma once

#include "decode_kernels.h"

#if defined(PAN2_CUTLASS_CONV)

#include <cute/tensor.hpp>

#include "cutlass/cutlass.h"
#include "cutlass/kernel_hardware_info.hpp"
#include "cutlass/conv/convnd_problem_shape.hpp"
#include "cutlass/conv/dispatch_policy.hpp"
#include "cutlass/conv/collective/collective_builder.hpp"
#include "cutlass/epilogue/collective/collective_builder.hpp"
#include "cutlass/epilogue/fusion/operations.hpp"
#include "cutlass/conv/device/conv_universal_adapter.hpp"
#include "cutlass/conv/kernel/conv_universal.hpp"

namespace wan22::cutlass_conv {

using Element = cutlass::bfloat16_t;
using Layout = cutlass::layout::TensorNDHWC;
constexpr int kAlignment = 8;  // 16-byte TMA rows: channels are multiples of 8 bf16
constexpr auto kFprop = cutlass::conv::Operator::kFprop;
// acc (fp32) + bias (fp32, per output channel), rounded once to bf16 (round to nearest even).
using BiasEpilogue = cutlass::epilogue::fusion::LinCombPerColBias<Element, float, float, Element, float>;

#if PAN2_CUTLASS_CONV == 90
using Arch = cutlass::arch::Sm90;
template <class Tile, class Cluster>
using MainloopSchedule = cutlass::conv::KernelImplicitTmaWarpSpecializedSm90;
using EpilogueSchedule = cutlass::epilogue::TmaWarpSpecialized;
// The epilogue's sub-tile: the builder's automatic choice does not take a conv's nested K mode.
using EpilogueTile = cute::Shape<cute::_64, cute::_32>;
#else
using Arch = cutlass::arch::Sm100;
template <class Tile, class Cluster>
using MainloopSchedule = cutlass::conv::collective::KernelScheduleAuto;
using EpilogueSchedule = cutlass::epilogue::collective::EpilogueScheduleAuto;
using EpilogueTile = cutlass::epilogue::collective::EpilogueTileAuto;
#endif

template <int TileM, int TileN, int ClusterM>
struct Config {
    // The K mode of a conv tile is hierarchical (channels first): BLOCK_K = 64 channels of one tap.
    using Tile = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Shape<cute::_64>>;
    using Cluster = cute::Shape<cute::Int<ClusterM>, cute::_1, cute::_1>;
    using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        Arch, cutlass::arch::OpClassTensorOp, Tile, Cluster, EpilogueTile, float, float,
        void, Layout, kAlignment,  // no source tensor C
        Element, Layout, kAlignment, EpilogueSchedule, BiasEpilogue>::CollectiveOp;
    using Mainloop = typename cutlass::conv::collective::CollectiveBuilder<
        Arch, cutlass::arch::OpClassTensorOp, kFprop, Element, Layout, kAlignment, Element, Layout, kAlignment,
        float, Tile, Cluster,
        cutlass::conv::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
        MainloopSchedule<Tile, Cluster>>::CollectiveOp;
    using Problem = cutlass::conv::ConvProblemShape<kFprop, Mainloop::DispatchPolicy::NumSpatialDimensions>;
    using Kernel = cutlass::conv::kernel::ConvUniversal<Problem, Mainloop, Epilogue>;
    using Conv = cutlass::conv::device::ConvUniversalAdapter<Kernel>;
};

// The conv problem of `p` (the activation's strides as given, the filter dense, W padded only).
template <class Problem>
Problem conv_problem(const ConvParams& p) {
    const int64_t c = p.c;
    return Problem(cutlass::conv::Mode::kCrossCorrelation,
                   {p.n, p.d, p.h, p.w, p.c}, {p.x_strides[0], p.x_strides[1], p.x_strides[2], p.x_strides[3], 1},
                   {p.k, p.kt, p.kh, p.kw, p.c}, {p.kt * p.kh * p.kw * c, p.kh * p.kw * c, p.kw * c, c, 1},
                   {0, 0, p.pad_w}, {0, 0, p.pad_w}, {1, 1, 1}, {1, 1, 1}, 1);
}

// The epilogue's arguments: the dense output [N, D', H', W', K], whose M modes (W', H', D', N) take its
// strides innermost first, no source tensor, acc + bias.
template <class Epilogue, class Problem>
typename Epilogue::Arguments epilogue_arguments(const ConvParams& p, const Problem& problem) {
    typename Epilogue::StrideD stride_out{};
    cute::for_each(cute::make_seq<cute::rank<0>(typename Epilogue::StrideD{})>{}, [&](auto i) {
        cute::get<0, i>(stride_out) = problem.stride_C[Problem::RankT - 2 - i];
    });
    typename Epilogue::Arguments args{{}, nullptr, stride_out, reinterpret_cast<Element*>(p.out), stride_out};
    args.thread.alpha = 1.0f;
    args.thread.beta = 0.0f;
    args.thread.bias_ptr = p.bias;
    return args;
}

template <class Cfg>
typename Cfg::Conv::Arguments arguments(const ConvParams& p) {
    const auto problem = conv_problem<typename Cfg::Problem>(p);
    return {problem,
            {reinterpret_cast<const Element*>(p.x), reinterpret_cast<const Element*>(p.weight)},
            epilogue_arguments<typename Cfg::Epilogue>(p, problem)};
}

// nullptr on success, else what CUTLASS refused.
template <class Cfg>
const char* run(const ConvParams& p, void* workspace, size_t workspace_bytes, cudaStream_t stream) {
    auto args = arguments<Cfg>(p);
    typename Cfg::Conv conv;
    if (Cfg::Conv::get_workspace_size(args) > workspace_bytes) return "workspace too small";
    cutlass::Status status = conv.can_implement(args);
    if (status != cutlass::Status::kSuccess) return "the problem is not supported by this tile configuration";
    status = conv.initialize(args, workspace, stream);
    if (status != cutlass::Status::kSuccess) return cutlassGetStatusString(status);
    status = conv.run(stream);
    if (status != cutlass::Status::kSuccess) return cutlassGetStatusString(status);
    return nullptr;
}

template <class Cfg>
size_t workspace(const ConvParams& p) {
    return Cfg::Conv::get_workspace_size(arguments<Cfg>(p));
}

}  // namespace wan22::cutlass_conv

// One translation unit per tile configuration defines its two entry points with this.
#define PAN2_DEFINE_CUTLASS_CONV(NAME, TILE_M, TILE_N, CLUSTER_M)                                              \
    namespace wan22 {                                                                                          \
    const char* NAME(const ConvParams& p, void* workspace, size_t bytes, cudaStream_t stream) {                \
        return cutlass_conv::run<cutlass_conv::Config<TILE_M, TILE_N, CLUSTER_M>>(p, workspace, bytes, stream); \
    }                                                                                                          \
    size_t NAME##_workspace(const ConvParams& p) {                                                             \
        return cutlass_conv::workspace<cutlass_conv::Config<TILE_M, TILE_N, CLUSTER_M>>(p);                    \
    }                                                                                                          \
    }

#endif  // PAN2_CUTLASS_CONV
