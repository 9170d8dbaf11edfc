// The implicit-GEMM conv's configurations (one translation unit each: conv_cutlass_<tile>.cu) and the
// dispatch between them: "128x128" is CUTLASS's own (non-persistent) conv kernel; the "...p" ones are our
// persistent cooperative kernel over the same collectives (conv_cutlass_persistent.cuh; sm90 only), "-MxN"
// naming a cluster of M x N CTAs that share tiles by TMA multicast. The decode's default is 256x128p-1x2
// (cuDNN's tile and cluster on these layers); the others stay for benchmarks (docs/KERNEL_NOTES.md).
// Clusters along M (the filter tile shared: 256x128p-2x1, 128x256p-2x1) ran slower on an H200 and are not
// built; a translation unit of one PAN2_DEFINE_PERSISTENT_CONV line and an entry here bring one back.
// Which configuration a layer uses is the caller's choice, fixed per layer (pan2cli/vae/kernel/conv.py),
// never by the problem's size; all of them sum every output in the same order (measured bit for bit).
#include "conv_cutlass.cuh"

namespace wan22 {

#if defined(PAN2_CUTLASS_CONV)
#define PAN2_DECLARE(NAME)                                                                       \
    const char* NAME(const ConvParams& p, void* workspace, size_t bytes, cudaStream_t stream); \
    size_t NAME##_workspace(const ConvParams& p);
PAN2_DECLARE(conv_cutlass_128x128)
#if PAN2_CUTLASS_CONV == 90
PAN2_DECLARE(conv_cutlass_128x256p)
PAN2_DECLARE(conv_cutlass_256x128p)
PAN2_DECLARE(conv_cutlass_256x128p_1x2)
#endif
#undef PAN2_DECLARE

namespace {
struct Entry {
    const char* name;
    const char* (*run)(const ConvParams&, void*, size_t, cudaStream_t);
    size_t (*workspace)(const ConvParams&);
};
const Entry kConfigs[] = {
    {"128x128", conv_cutlass_128x128, conv_cutlass_128x128_workspace},
#if PAN2_CUTLASS_CONV == 90
    {"128x256p", conv_cutlass_128x256p, conv_cutlass_128x256p_workspace},
    {"256x128p", conv_cutlass_256x128p, conv_cutlass_256x128p_workspace},
    {"256x128p-1x2", conv_cutlass_256x128p_1x2, conv_cutlass_256x128p_1x2_workspace},
#endif
};
constexpr int kCount = sizeof(kConfigs) / sizeof(kConfigs[0]);
}  // namespace

const char* const* cutlass_conv_configs(int* count) {
    static const char* names[kCount];  // the entries' names, in `config` order
    for (int i = 0; i < kCount; ++i) names[i] = kConfigs[i].name;
    *count = kCount;
    return names;
}

const char* conv_cutlass(const ConvParams& p, int config, void* workspace, size_t bytes, cudaStream_t stream) {
    if (config < 0 || config >= kCount) return "no such tile configuration";
    return kConfigs[config].run(p, workspace, bytes, stream);
}

size_t conv_cutlass_workspace(const ConvParams& p, int config) {
    return (config < 0 || config >= kCount) ? 0 : kConfigs[config].workspace(p);
}
#else
const char* const* cutlass_conv_configs(int* count) {
    *count = 0;
    return nullptr;
}
const char* conv_cutlass(const ConvParams&, int, void*, size_t, cudaStream_t) {
    return "this build has no CUTLASS convolution (the nvidia-cutlass headers were not found)";
}
size_t conv_cutlass_workspace(const ConvParams&, int) { return 0; }
#endif

}  // namespace wan22
