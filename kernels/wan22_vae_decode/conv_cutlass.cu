// The implicit-GEMM conv's configurations (one translation unit each: conv_cutlass_<tile>.cu) and the
// dispatch between them: "128x128" is CUTLASS's own (non-persistent) conv kernel, "128x256p" our
// persistent cooperative kernel over the same collectives (conv_cutlass_persistent.cuh; sm90 only), the
// decode's default. Measured on an H200 (docs/KERNEL_NOTES.md): 256x128p and 128x256 with clusters of
// two (filter multicast) ran the decode no faster, so they are not built (PersistentConfig takes them).
// Which configuration a layer uses is the caller's choice, fixed per layer (pan2cli/vae/kernel/conv.py),
// never by the problem's size: that is what keeps its summation order.
#include "conv_cutlass.cuh"

namespace wan22 {

#if defined(PAN2_CUTLASS_CONV)
#define PAN2_DECLARE(NAME)                                                                       \
    const char* NAME(const ConvParams& p, void* workspace, size_t bytes, cudaStream_t stream); \
    size_t NAME##_workspace(const ConvParams& p);
PAN2_DECLARE(conv_cutlass_128x128)
#if PAN2_CUTLASS_CONV == 90
PAN2_DECLARE(conv_cutlass_128x256p)
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
