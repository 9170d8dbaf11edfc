// The fused-norm prototype's extension (`pan2cli.vae.kernel.prototypes`; never the decode's): the only file
// of it that includes torch. Checks tensors with messages naming them and launches on the current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/extension.h>

#include "fused_norm.h"

namespace {

using at::Tensor;

void check_bf16_cuda(const Tensor& t, const char* name) {
    TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor");
    TORCH_CHECK(t.scalar_type() == at::kBFloat16, name, " must be bfloat16, got ", t.scalar_type());
}

void check_f32_vector(const Tensor& t, const char* name, int64_t n) {
    TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kFloat && t.dim() == 1 && t.size(0) == n && t.is_contiguous(),
                name, " must be a contiguous float32 CUDA vector of ", n, " values");
}

void check_inv_rms(const Tensor& inv_rms, const Tensor& x) {
    TORCH_CHECK(inv_rms.is_cuda() && inv_rms.scalar_type() == at::kFloat && inv_rms.is_contiguous() &&
                    inv_rms.numel() * x.size(-1) == x.numel(),
                "inv_rms must be a dense fp32 tensor of one value per pixel of x");
}

// inv_rms [N, D, H, W] fp32 = 1 / max(||x[pixel]||, 1e-12) of a dense x [N, D, H, W, C] bf16.
void rms_inv(const Tensor& x, Tensor inv_rms) {
    check_bf16_cuda(x, "x");
    TORCH_CHECK(x.is_contiguous() && x.size(-1) % 8 == 0, "x must be dense with channels a multiple of 8");
    check_inv_rms(inv_rms, x);
    if (x.numel() == 0) return;
    const c10::cuda::CUDAGuard guard(x.device());
    wan22::rms_inv(reinterpret_cast<const __nv_bfloat16*>(x.data_ptr()), inv_rms.numel(),
                   static_cast<int>(x.size(-1)), inv_rms.data_ptr<float>(), c10::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// out [N, D-KT+1, H-KH+1, W+2*pad_w-KW+1, K] bf16 = conv(SiLU(x · inv_rms · gamma)) + bias: x [N, D, H, W, C]
// bf16 dense, weight [K, C, KT, KH, KW] bf16 channels-last, gamma [C] and bias [K] fp32.
void conv_cutlass_norm(const Tensor& x, const Tensor& inv_rms, const Tensor& gamma, const Tensor& weight,
                       const Tensor& bias, Tensor out, int64_t pad_w) {
    check_bf16_cuda(x, "x");
    check_bf16_cuda(weight, "weight");
    check_bf16_cuda(out, "out");
    TORCH_CHECK(x.dim() == 5 && weight.dim() == 5 && out.dim() == 5, "x, weight and out must be 5-D");
    TORCH_CHECK(x.is_contiguous(), "the fused-norm conv reads a dense x");
    const int64_t C = x.size(4), K = weight.size(0);
    TORCH_CHECK(C % 64 == 0 && K % 8 == 0, "channels: C must be a multiple of 64 and K of 8, got ", C, ", ", K);
    TORCH_CHECK(weight.size(1) == C, "weight has ", weight.size(1), " input channels, x has ", C);
    const Tensor w = weight.permute({0, 2, 3, 4, 1});
    TORCH_CHECK(w.is_contiguous(), "weight must be channels-last");
    const int64_t KT = weight.size(2), KH = weight.size(3), KW = weight.size(4);
    TORCH_CHECK(out.is_contiguous() && out.size(0) == x.size(0) && out.size(1) == x.size(1) - KT + 1 &&
                    out.size(2) == x.size(2) - KH + 1 && out.size(3) == x.size(3) + 2 * pad_w - KW + 1 &&
                    out.size(4) == K,
                "out ", out.sizes(), " does not match the conv of x ", x.sizes(), " and weight ", weight.sizes());
    check_inv_rms(inv_rms, x);
    check_f32_vector(gamma, "gamma", C);
    check_f32_vector(bias, "bias", K);
    wan22::ConvParams p{};
    p.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
    for (int i = 0; i < 4; ++i) p.x_strides[i] = x.stride(i);
    p.n = static_cast<int>(x.size(0));
    p.d = static_cast<int>(x.size(1));
    p.h = static_cast<int>(x.size(2));
    p.w = static_cast<int>(x.size(3));
    p.c = static_cast<int>(C);
    p.weight = reinterpret_cast<const __nv_bfloat16*>(w.data_ptr());
    p.k = static_cast<int>(K);
    p.kt = static_cast<int>(KT);
    p.kh = static_cast<int>(KH);
    p.kw = static_cast<int>(KW);
    p.bias = bias.data_ptr<float>();
    p.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
    p.pad_w = static_cast<int>(pad_w);
    if (out.numel() == 0) return;
    const c10::cuda::CUDAGuard guard(x.device());
    const char* error = wan22::conv_cutlass_norm(p, inv_rms.data_ptr<float>(), gamma.data_ptr<float>(),
                                                 c10::cuda::getCurrentCUDAStream());
    TORCH_CHECK(error == nullptr, "conv_cutlass_norm (", x.sizes(), " * ", weight.sizes(), "): ", error);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "The fused-norm conv prototype of the Wan2.2 VAE decoder (not used by the decode)";
    m.def("rms_inv", &rms_inv, "1 / max(||x[pixel]||, 1e-12) per pixel", py::arg("x"), py::arg("inv_rms"));
    m.def("conv_cutlass_norm", &conv_cutlass_norm, "conv(SiLU(x * inv_rms * gamma)) + bias into `out`",
          py::arg("x"), py::arg("inv_rms"), py::arg("gamma"), py::arg("weight"), py::arg("bias"), py::arg("out"),
          py::arg("pad_w"));
}
