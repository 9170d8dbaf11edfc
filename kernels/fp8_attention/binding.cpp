// The fp8 attention's extension (`pan2cli.dit.cuda_fp8_attention`): the only file of it that includes torch.
// Checks the tensors (device, dtype, layout, shape) with messages naming them and launches on the current
// stream of their device.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include <utility>

#include "fp8_attention.h"

namespace {

using at::Tensor;

// softmax(Q·Kᵀ/√128)·V into `out`: q, k [B, S, H, 128] e4m3, v_t [B, H, 128, S_pad] e4m3 (keys in the wgmma
// order with `tma`), qk_descale [1] and v_descale [H] fp32, out [B, S, H, 128] bf16; `key_tile` 128 or 224;
// v_mean [B, H·128] fp32 or None, added to out (V smoothed).
void fp8_attention(const Tensor& q, const Tensor& k, const Tensor& v_t, const Tensor& qk_descale,
                   const Tensor& v_descale, Tensor out, double sm_scale_log2, double p_shift, int64_t stages,
                   bool ping_pong, bool tma, int64_t key_tile, const c10::optional<Tensor>& v_mean) {
    const auto fp8 = at::ScalarType::Float8_e4m3fn;
    for (const auto& [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v_t, "v_t"}}) {
        TORCH_CHECK(t->is_cuda() && t->scalar_type() == fp8 && t->is_contiguous(), name,
                    " must be a contiguous float8_e4m3fn CUDA tensor, got ", t->scalar_type(), " on ", t->device());
    }
    TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kBFloat16 && out.is_contiguous(),
                "out must be a contiguous bfloat16 CUDA tensor");
    TORCH_CHECK(q.dim() == 4 && q.size(3) == 128, "q must be [B, S, H, 128], got ", q.sizes());
    TORCH_CHECK(k.sizes() == q.sizes() && out.sizes() == q.sizes(), "k ", k.sizes(), " and out ", out.sizes(),
                " must have q's shape ", q.sizes());
    const int64_t batch = q.size(0), tokens = q.size(1), heads = q.size(2);
    TORCH_CHECK(v_t.dim() == 4 && v_t.size(0) == batch && v_t.size(1) == heads && v_t.size(2) == 128 &&
                    v_t.size(3) >= tokens && v_t.size(3) % 16 == 0,
                "v_t must be [B, H, 128, S_pad] with S_pad >= S a multiple of 16, got ", v_t.sizes());
    for (const Tensor* t : std::initializer_list<const Tensor*>{&k, &v_t, &out, &qk_descale, &v_descale}) {
        TORCH_CHECK(t->device() == q.device(), "every tensor must be on q's device ", q.device());
    }
    TORCH_CHECK(qk_descale.scalar_type() == at::kFloat && qk_descale.numel() == 1,
                "qk_descale must be one float32 on the GPU");
    TORCH_CHECK(v_descale.scalar_type() == at::kFloat && v_descale.dim() == 1 && v_descale.size(0) == heads &&
                    v_descale.is_contiguous(),
                "v_descale must be a contiguous float32 vector of ", heads, " values (one per head)");
    if (v_mean.has_value()) {
        TORCH_CHECK(v_mean->device() == q.device() && v_mean->scalar_type() == at::kFloat && v_mean->is_contiguous() &&
                        v_mean->dim() == 2 && v_mean->size(0) == batch && v_mean->size(1) == heads * 128,
                    "v_mean must be a contiguous float32 [B, H*128] tensor on q's device, got ", v_mean->sizes());
    }
    TORCH_CHECK(batch * heads <= 65535, "batch x heads must be at most 65535, got ", batch * heads);
    if (tokens == 0) return;
    const c10::cuda::CUDAGuard guard(q.device());
    int major = 0, minor = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, q.get_device()));
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, q.get_device()));
    TORCH_CHECK(major == 9 && minor == 0, "pan2's CUDA fp8 attention runs on sm_90 only, not sm_", major, minor);
    const cudaError_t error = pan2_fp8_attention_launch(
        reinterpret_cast<const uint8_t*>(q.data_ptr()), reinterpret_cast<const uint8_t*>(k.data_ptr()),
        reinterpret_cast<const uint8_t*>(v_t.data_ptr()), qk_descale.data_ptr<float>(), v_descale.data_ptr<float>(),
        v_mean.has_value() ? v_mean->data_ptr<float>() : nullptr,
        reinterpret_cast<__nv_bfloat16*>(out.data_ptr()), static_cast<int>(batch), static_cast<int>(tokens),
        static_cast<int>(heads), static_cast<int>(v_t.size(3)), static_cast<float>(sm_scale_log2),
        static_cast<float>(p_shift), static_cast<int>(stages), ping_pong, tma, static_cast<int>(key_tile),
        c10::cuda::getCurrentCUDAStream());
    TORCH_CHECK(error == cudaSuccess, "fp8_attention (", q.sizes(), ", stages ", stages, ", key tile ", key_tile, "): ",
                cudaGetErrorString(error));
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "pan2's fp8 attention for Hopper (sm_90a): warp-specialised wgmma, e4m3 in, bf16 out";
    m.def("fp8_attention", &fp8_attention, "softmax(Q K^T / sqrt(128)) V, e4m3 in, bf16 `out`", py::arg("q"),
          py::arg("k"), py::arg("v_t"), py::arg("qk_descale"), py::arg("v_descale"), py::arg("out"),
          py::arg("sm_scale_log2"), py::arg("p_shift"), py::arg("stages"), py::arg("ping_pong"), py::arg("tma"),
          py::arg("key_tile"), py::arg("v_mean") = py::none());
}
