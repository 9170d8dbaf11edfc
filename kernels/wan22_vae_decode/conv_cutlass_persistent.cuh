// Persistent, cooperative implicit-GEMM conv for sm90 (included by conv_cutlass_*p.cu).
//
// CUTLASS 4.2 drives its sm90 conv collectives with a non-persistent kernel only (one CTA per output
// tile: the next tile's loads cannot start before this tile's epilogue ends, and its prologue is paid
// per tile). This kernel runs the same collectives persistently: one CTA per SM walks output tiles;
// warp group 0 (one warp) issues the TMA loads (activation tiles through im2col TMA, filter tiles)
// into a ring of shared-memory stages, running ahead into the next tile while warp groups 1 and 2
// (64 rows each of the 128-row tile, or 128 of 256) multiply with wgmma and then store through the
// TMA epilogue (acc + bias in fp32, one bf16 rounding).
//
// Tile order: a tile group is cluster_m x cluster_n tiles: group g covers row tiles
// (g / n_groups) * cluster_m + rank_m and channel tiles (g % n_groups) * cluster_n + rank_n. CTAs of a
// cluster along M take vertically adjacent tiles of the same channels and share the filter tile by TMA
// multicast; along N they take the same pixels and share the activation (im2col) tile: each CTA loads
// its share of the shared tile and the TMA writes it into both CTAs' shared memory, so L2 serves it
// once (less L2 traffic: what separates cuDNN's 256x128 kernel, which runs in clusters of two, from
// ours at boost clocks; docs/KERNEL_NOTES.md). Cluster c takes groups c, c + clusters, ... The order
// only decides which SM computes a tile, never how an output is summed (the K loop is the collective's).
#pragma once

#include "conv_cutlass.cuh"

#if defined(PAN2_CUTLASS_CONV) && PAN2_CUTLASS_CONV == 90

#include "cutlass/arch/reg_reconfig.h"
#include "cutlass/pipeline/pipeline.hpp"

namespace wan22::cutlass_conv {

// An operand transform: applied by the MMA warp groups to each activation tile in shared memory before
// their MMAs read it (the fused-norm prototype's NormSiluOperand, kernels/experimental/conv_cutlass_norm.cuh: RMS norm + SiLU). A plain conv has none,
// and its kernel is the same code as without this parameter (the transform's branch is discarded).
struct NoOperandTransform {
    static constexpr bool kEnabled = false;
    struct Params {};
};

template <class Mainloop_, class Epilogue_, class Transform_ = NoOperandTransform>
struct PersistentConvKernel {
    using Transform = Transform_;
    using Mainloop = Mainloop_;
    using Epilogue = Epilogue_;
    using TileShape = typename Mainloop::TileShape;
    using TiledMma = typename Mainloop::TiledMma;
    using ClusterShape = typename Mainloop::DispatchPolicy::ClusterShape;
    // A cluster's CTAs take adjacent tiles: along M they share the filter tile, along N the activation tile.
    static constexpr int kClusterM = cute::size<0>(ClusterShape{});
    static constexpr int kClusterN = cute::size<1>(ClusterShape{});
    static constexpr int kClusterSize = kClusterM * kClusterN;
    static_assert(cute::size<2>(ClusterShape{}) == 1);
    using Problem = cutlass::conv::ConvProblemShape<kFprop, Mainloop::DispatchPolicy::NumSpatialDimensions>;
    using ProblemMNKL = decltype(cutlass::conv::detail::get_problem_shape_MNKL_helper<Mainloop>(
        Problem{}, cute::true_type{}));
    static constexpr int kConsumerGroups = 2;
    static constexpr int kThreads = (1 + kConsumerGroups) * cutlass::NumThreadsPerWarpGroup;
    static_assert(cute::size(TiledMma{}) == kConsumerGroups * cutlass::NumThreadsPerWarpGroup,
                  "the mainloop must be built for two consumer warp groups (the cooperative schedule)");
    // The load warp group keeps few registers; the two MMA warp groups take the rest (accumulators).
    static constexpr int kLoadRegisters = 40;
    static constexpr int kMmaRegisters = 232;

    struct SharedStorage {
        // Loads of the next tile overlap this tile's epilogue: both live at once, no union.
        struct Tensors : cute::aligned_struct<128, cute::_1> {
            typename Mainloop::TensorStorage mainloop;
            typename Epilogue::TensorStorage epilogue;
        } tensors;
        struct Pipelines : cute::aligned_struct<16, cute::_1> {
            alignas(16) typename Mainloop::PipelineStorage mainloop;
            alignas(16) typename Epilogue::PipelineStorage epi_load;
        } pipelines;
    };

    struct Params {
        ProblemMNKL problem;
        typename Mainloop::Params mainloop;
        typename Epilogue::Params epilogue;
        int m_tiles;
        int n_tiles;
        typename Transform::Params transform;
    };

    CUTLASS_DEVICE void operator()(Params const& params, char* smem) const {
        using namespace cute;
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
        auto& shared = *reinterpret_cast<SharedStorage*>(smem);
        const int thread = int(threadIdx.x);
        const int warp_group = cutlass::canonical_warp_group_idx();
        const int warp_in_group = cutlass::canonical_warp_idx_sync() % cutlass::NumWarpsPerWarpGroup;
        const int thread_in_group = thread % cutlass::NumThreadsPerWarpGroup;
        const bool is_loader = warp_group == 0 && warp_in_group == 0;
        const bool is_mma = warp_group > 0;
        if (thread == 0) {
            Mainloop::prefetch_tma_descriptors(params.mainloop);
            Epilogue::prefetch_tma_descriptors(params.epilogue);
        }

        using MainloopPipeline = typename Mainloop::MainloopPipeline;
        typename MainloopPipeline::Params mainloop_pipe{};
        if (is_loader) mainloop_pipe.role = MainloopPipeline::ThreadCategory::Producer;
        if (is_mma) mainloop_pipe.role = MainloopPipeline::ThreadCategory::Consumer;
        mainloop_pipe.is_leader = thread_in_group == 0;
        mainloop_pipe.num_consumers = kConsumerGroups * cutlass::NumThreadsPerWarpGroup;
        mainloop_pipe.transaction_bytes = params.mainloop.tma_transaction_bytes;
        MainloopPipeline mainloop_pipeline(shared.pipelines.mainloop, mainloop_pipe, ClusterShape{});

        // The epilogue reads no source tensor, but its collective still takes a load pipeline.
        using EpiLoadPipeline = typename Epilogue::LoadPipeline;
        typename EpiLoadPipeline::Params epi_load_pipe{};
        if (is_loader) epi_load_pipe.role = EpiLoadPipeline::ThreadCategory::Producer;
        if (is_mma) epi_load_pipe.role = EpiLoadPipeline::ThreadCategory::Consumer;
        epi_load_pipe.dst_blockid = cute::block_rank_in_cluster();
        epi_load_pipe.producer_arv_count = cutlass::NumThreadsPerWarp;
        epi_load_pipe.consumer_arv_count = kConsumerGroups * cutlass::NumThreadsPerWarpGroup;
        if constexpr (Epilogue::RequiresTransactionBytes) {
            epi_load_pipe.transaction_bytes = params.epilogue.tma_transaction_bytes;
        }
        EpiLoadPipeline epi_load_pipeline(shared.pipelines.epi_load, epi_load_pipe);
        using EpiStorePipeline = typename Epilogue::StorePipeline;
        typename EpiStorePipeline::Params epi_store_pipe{};
        epi_store_pipe.always_wait = true;
        EpiStorePipeline epi_store_pipeline(epi_store_pipe);

        // The barriers' initialisation is visible to every warp (of the cluster: multicast loads and
        // consumer releases cross CTAs).
        if constexpr (kClusterSize > 1) {
            cute::cluster_arrive_relaxed();
            cute::cluster_wait();
        } else {
            __syncthreads();
        }
        const int rank = int(cute::block_rank_in_cluster());
        // The launch's cluster is (kClusterM, kClusterN, 1) CTAs, as the collective and the pipeline take it
        // (the pipeline signals by the CTA's (x, y) in its cluster); grid (clusters * kClusterM, kClusterN).
        const int rank_m = rank % kClusterM, rank_n = rank / kClusterM;  // = blockIdx.x % kClusterM, blockIdx.y
        const int cluster = int(blockIdx.x) / kClusterM;
        const int clusters = int(gridDim.x) / kClusterM;

        auto problem = append<4>(params.problem, Int<1>{});
        Mainloop mainloop;
        Epilogue epilogue(params.epilogue, shared.tensors.epilogue);
        auto load_inputs = mainloop.load_init(problem, params.mainloop);
        Tensor gA = get<0>(load_inputs);  // (BLK_M, BLK_K, m, k)
        const int k_tiles = size<3>(gA);
        // A cluster walks tile groups (kClusterM x kClusterN adjacent tiles); every CTA of it runs the same
        // number of tiles (a tile past the last row loads zeros and stores nothing; n_tiles is a multiple of
        // kClusterN, checked at launch).
        const int n_groups = params.n_tiles / kClusterN;
        const int groups = (params.m_tiles + kClusterM - 1) / kClusterM * n_groups;
        auto tile_of = [&](int group) {
            auto m = idx2crd(group / n_groups * kClusterM + rank_m, shape<2>(gA));
            return make_coord(m, group % n_groups * kClusterN + rank_n, _, Int<0>{});
        };

        if (warp_group == 0) {
            cutlass::arch::warpgroup_reg_dealloc<kLoadRegisters>();
            if (is_loader) {
                auto state = cutlass::make_producer_start_state<MainloopPipeline>();
                for (int group = cluster; group < groups; group += clusters) {
                    auto coord = tile_of(group);
                    mainloop.load(params.mainloop, mainloop_pipeline, state, load_inputs, coord,
                                  cute::make_coord_iterator(shape<3>(gA)), k_tiles, cutlass::canonical_lane_idx(), rank,
                                  shared.tensors.mainloop);
                    state.advance(k_tiles);
                }
                mainloop.load_tail(mainloop_pipeline, state);
            }
        } else {
            cutlass::arch::warpgroup_reg_alloc<kMmaRegisters>();
            const int mma_thread = thread - cutlass::NumThreadsPerWarpGroup;
            TiledMma tiled_mma;
            typename Mainloop::PipelineState mainloop_state;
            typename Epilogue::LoadPipelineState epi_load_state;
            auto epi_store_state = cutlass::make_producer_start_state<EpiStorePipeline>();
            for (int group = cluster; group < groups; group += clusters) {
                auto coord = tile_of(group);
                Tensor accumulators = partition_fragment_C(tiled_mma, take<0, 2>(TileShape{}));
                if constexpr (Transform::kEnabled) {
                    const int64_t tile_m = int64_t(group / n_groups) * kClusterM + rank_m;
                    Transform::template mma<Mainloop, TiledMma>(params.transform, tile_m, mainloop_pipeline,
                                                                mainloop_state, accumulators, k_tiles, mma_thread,
                                                                shared.tensors.mainloop);
                } else {
                    mainloop.mma(mainloop_pipeline, mainloop_state, accumulators, k_tiles, mma_thread,
                                 shared.tensors.mainloop, params.mainloop);
                    mainloop.mma_tail(mainloop_pipeline, mainloop_state, k_tiles);
                }
                mainloop_state.advance(k_tiles);
                auto [load_next, store_next] =
                    epilogue.store(epi_load_pipeline, epi_load_state, epi_store_pipeline, epi_store_state, problem,
                                   TileShape{}, coord, accumulators, tiled_mma, mma_thread, shared.tensors.epilogue);
                epi_load_state = load_next;
                epi_store_state = store_next;
            }
            epilogue.store_tail(epi_load_pipeline, epi_load_state, epi_store_pipeline, epi_store_state);
        }
#endif
    }
};

template <class Kernel>
__global__ void __launch_bounds__(Kernel::kThreads, 1)
    persistent_conv(CUTLASS_GRID_CONSTANT typename Kernel::Params const params) {
    extern __shared__ __align__(128) char smem[];
    Kernel{}(params, smem);
}

template <int TileM, int TileN, int ClusterM, int ClusterN = 1, class Transform = NoOperandTransform>
struct PersistentConfig {
    using Tile = cute::Shape<cute::Int<TileM>, cute::Int<TileN>, cute::Shape<cute::_64>>;
    using Cluster = cute::Shape<cute::Int<ClusterM>, cute::Int<ClusterN>, cute::_1>;
    // The cooperative epilogue stores 128-row sub-tiles with both MMA warp groups.
    using Epilogue = typename cutlass::epilogue::collective::CollectiveBuilder<
        Arch, cutlass::arch::OpClassTensorOp, Tile, Cluster, cute::Shape<cute::_128, cute::_32>, float, float, void,
        Layout, kAlignment, Element, Layout, kAlignment, cutlass::epilogue::TmaWarpSpecializedCooperative,
        BiasEpilogue>::CollectiveOp;
    // CUTLASS 4.2's conv dispatch policy refuses its cooperative schedule, so the collective is the one its
    // builder makes for the plain schedule (TMA copies, shared-memory layouts, stage count), given a
    // tiled MMA over two warp groups: the collective is written for any tiled MMA.
    using Single = typename cutlass::conv::collective::CollectiveBuilder<
        Arch, cutlass::arch::OpClassTensorOp, kFprop, Element, Layout, kAlignment, Element, Layout, kAlignment,
        float, Tile, Cluster,
        cutlass::conv::collective::StageCountAutoCarveout<static_cast<int>(sizeof(typename Epilogue::SharedStorage))>,
        cutlass::conv::KernelImplicitTmaWarpSpecializedSm90>::CollectiveOp;
    using TiledMma = decltype(cute::make_tiled_mma(
        cute::GMMA::ss_op_selector<Element, Element, float, Tile, cute::GMMA::Major::K, cute::GMMA::Major::K>(),
        cute::Layout<cute::Shape<cute::_2, cute::_1, cute::_1>>{}));
    using Mainloop = cutlass::conv::collective::CollectiveConv<
        typename Single::DispatchPolicy, Tile, Element, Element, TiledMma,
        cutlass::conv::collective::detail::Sm90ImplicitGemmTileTraits<typename Single::GmemTiledCopyA,
                                                                       typename Single::SmemLayoutA>,
        cutlass::conv::collective::detail::Sm90ImplicitGemmTileTraits<typename Single::GmemTiledCopyB,
                                                                       typename Single::SmemLayoutB>>;
    using Kernel = PersistentConvKernel<Mainloop, Epilogue, Transform>;
    using Problem = typename Kernel::Problem;
};

inline int multiprocessors() {
    static int count = 0;  // the process's GPUs are one kind (the build is for one arch)
    if (count == 0) {
        int device = 0;
        cudaGetDevice(&device);
        cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
    }
    return count;
}

template <class Cfg>
const char* run_persistent(const ConvParams& p, cudaStream_t stream,
                           typename Cfg::Kernel::Transform::Params const& transform = {}) {
    using Kernel = typename Cfg::Kernel;
    using Mainloop = typename Cfg::Mainloop;
    using Epilogue = typename Cfg::Epilogue;
    using Problem = typename Cfg::Problem;
    const auto problem = conv_problem<Problem>(p);
    typename Mainloop::Arguments mainloop_args{reinterpret_cast<const Element*>(p.x),
                                               reinterpret_cast<const Element*>(p.weight)};
    const auto epilogue_args = epilogue_arguments<Epilogue>(p, problem);
    const auto transformed = cutlass::conv::detail::get_transformed_problem_shape_MNKL(problem);
    if (!Mainloop::can_implement(problem, mainloop_args) || !Epilogue::can_implement(transformed, epilogue_args)) {
        return "the problem is not supported by this tile configuration";
    }
    typename Kernel::Params params{
        cutlass::conv::detail::get_problem_shape_MNKL_helper<Mainloop>(problem, cute::true_type{}),
        Mainloop::to_underlying_arguments(problem, mainloop_args, nullptr),
        Epilogue::to_underlying_arguments(transformed, epilogue_args, nullptr), 0, 0, transform};
    const int64_t rows = int64_t(p.n) * (p.d - p.kt + 1) * (p.h - p.kh + 1) * (p.w + 2 * p.pad_w - p.kw + 1);
    params.m_tiles = int((rows + cute::size<0>(typename Cfg::Tile{}) - 1) / cute::size<0>(typename Cfg::Tile{}));
    params.n_tiles = (p.k + cute::size<1>(typename Cfg::Tile{}) - 1) / cute::size<1>(typename Cfg::Tile{});
    constexpr int cluster_m = Kernel::kClusterM, cluster_n = Kernel::kClusterN;
    constexpr int cluster_size = Kernel::kClusterSize;
    if (params.n_tiles % cluster_n != 0) return "the output channels are not a whole number of tile clusters";
    const int groups = (params.m_tiles + cluster_m - 1) / cluster_m * (params.n_tiles / cluster_n);
    if (groups == 0) return nullptr;
    constexpr int smem = int(sizeof(typename Kernel::SharedStorage));
    cudaLaunchConfig_t launch{};
    cudaLaunchAttribute cluster_dim[1];
    cluster_dim[0].id = cudaLaunchAttributeClusterDimension;
    cluster_dim[0].val.clusterDim.x = cluster_m;
    cluster_dim[0].val.clusterDim.y = cluster_n;
    cluster_dim[0].val.clusterDim.z = 1;
    launch.blockDim = dim3(Kernel::kThreads, 1, 1);
    launch.dynamicSmemBytes = smem;
    launch.stream = stream;
    launch.attrs = cluster_dim;
    launch.numAttrs = 1;
    // One cluster per (cluster_size SMs) that can hold one at once, found once per process.
    static int resident_clusters = 0;
    if (resident_clusters == 0) {
        cudaError_t error = cudaFuncSetAttribute(persistent_conv<Kernel>,
                                                 cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        if (error != cudaSuccess) return cudaGetErrorString(error);
        launch.gridDim = dim3(multiprocessors() / cluster_size * cluster_m, cluster_n, 1);
        error = cudaOccupancyMaxActiveClusters(&resident_clusters, persistent_conv<Kernel>, &launch);
        if (error != cudaSuccess || resident_clusters <= 0) resident_clusters = multiprocessors() / cluster_size;
    }
    launch.gridDim = dim3((groups < resident_clusters ? groups : resident_clusters) * cluster_m, cluster_n, 1);
    const cudaError_t error = cudaLaunchKernelEx(&launch, persistent_conv<Kernel>, params);
    return error == cudaSuccess ? nullptr : cudaGetErrorString(error);
}

}  // namespace wan22::cutlass_conv

#define PAN2_DEFINE_PERSISTENT_CONV(NAME, TILE_M, TILE_N, CLUSTER_M, CLUSTER_N)                                 \
    namespace wan22 {                                                                                            \
    const char* NAME(const ConvParams& p, void*, size_t, cudaStream_t stream) {                                  \
        return cutlass_conv::run_persistent<                                                                     \
            cutlass_conv::PersistentConfig<TILE_M, TILE_N, CLUSTER_M, CLUSTER_N>>(p, stream);                    \
    }                                                                                                            \
    size_t NAME##_workspace(const ConvParams&) { return 0; }                                                     \
    }

#endif
