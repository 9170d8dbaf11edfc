// The only file of the decode kernel that includes torch: checks tensors (device, dtype, layout,
// shape) with messages naming them, fills the plain params structs of decode_kernels.h, launches on
// the current stream and registers the ops with Python.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/extension.h>

#include <string>
#include <vector>

#include "decode_kernels.h"

namespace {

using at::Tensor;

#define CHECK_BF16_CUDA(t, name)                                                          \
    TORCH_CHECK((t).is_cuda(), name " must be a CUDA tensor");                           \
    TORCH_CHECK((t).scalar_type() == at::kBFloat16, name " must be bfloat16, got ", (t).scalar_type())
#define CHECK_F32_VECTOR(t, name, n)                                                      \
    TORCH_CHECK((t).is_cuda() && (t).scalar_type() == at::kFloat && (t).dim() == 1 &&      \
                    (t).size(0) == (n) && (t).is_contiguous(),                             \
                name " must be a contiguous float32 CUDA vector of ", (n), " values")

// A [B, T, H, W, C] view whose (H, W, C) part is dense: frames may sit anywhere (history buffers).
void check_frames(const Tensor& t, const char* name) {
    TORCH_CHECK(t.dim() == 5, name, " must be [B, T, H, W, C], got ", t.sizes());
    TORCH_CHECK(t.stride(4) == 1 && t.stride(3) == t.size(4) && t.stride(2) == t.size(3) * t.size(4),
                name, " must be dense over (H, W, C), got strides ", t.strides());
    TORCH_CHECK(t.size(0) == 1 || t.stride(0) == t.size(1) * t.stride(1) || t.size(1) == 1,
                name, " must have batch stride T * frame stride");
}

void rms_norm_silu(const Tensor& x, const Tensor& gamma, const c10::optional<Tensor>& bias,
                   const c10::optional<Tensor>& residual, const c10::optional<Tensor>& sum_out, Tensor out,
                   bool silu, const c10::optional<Tensor>& history, bool normalize) {
    CHECK_BF16_CUDA(x, "x");
    CHECK_BF16_CUDA(out, "out");
    check_frames(x, "x");
    check_frames(out, "out");
    const int64_t C = x.size(4);
    TORCH_CHECK(C % 8 == 0 && C <= 1024, "x: channels must be a multiple of 8 and at most 1024, got ", C);
    TORCH_CHECK(out.sizes() == x.sizes(), "out must have the shape of x: ", out.sizes(), " vs ", x.sizes());
    CHECK_F32_VECTOR(gamma, "gamma", C);
    TORCH_CHECK(x.size(1) == 1 || x.stride(0) == x.size(1) * x.stride(1) || x.size(0) == 1, "x: frames");
    wan22::RmsNormParams p{};
    p.x = reinterpret_cast<const __nv_bfloat16*>(x.data_ptr());
    p.gamma = gamma.data_ptr<float>();
    if (bias) {
        CHECK_F32_VECTOR(*bias, "bias", C);
        p.bias = bias->data_ptr<float>();
    }
    if (residual) {
        CHECK_BF16_CUDA(*residual, "residual");
        TORCH_CHECK(residual->sizes() == x.sizes() && residual->strides() == x.strides(),
                    "residual must have the shape and strides of x");
        p.residual = reinterpret_cast<const __nv_bfloat16*>(residual->data_ptr());
    }
    if (sum_out) {
        CHECK_BF16_CUDA(*sum_out, "sum_out");
        TORCH_CHECK(sum_out->sizes() == x.sizes() && sum_out->strides() == x.strides(),
                    "sum_out must have the shape and strides of x");
        p.sum_out = reinterpret_cast<__nv_bfloat16*>(sum_out->data_ptr());
    }
    p.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
    if (history) {
        CHECK_BF16_CUDA(*history, "history");
        check_frames(*history, "history");
        TORCH_CHECK(x.size(1) >= 2 && history->size(1) == 2 && history->size(0) == x.size(0) &&
                        history->size(2) == x.size(2) && history->size(3) == x.size(3) && history->size(4) == C,
                    "history must be [B, 2, H, W, C] matching x ", x.sizes(), " (and x must hold >= 2 frames), got ",
                    history->sizes());
        p.history = reinterpret_cast<__nv_bfloat16*>(history->data_ptr());
        p.history_batch_stride = history->stride(0);
        p.history_frame_stride = history->stride(1);
    }
    p.x_frame_stride = x.stride(1);
    p.out_batch_stride = out.stride(0);
    p.out_frame_stride = out.stride(1);
    p.rows_per_frame = x.size(2) * x.size(3);
    p.frames_per_batch = static_cast<int>(x.size(1));
    p.num_frames = static_cast<int>(x.size(0) * x.size(1));
    p.channels = static_cast<int>(C);
    p.silu = silu;
    p.normalize = normalize;
    if (x.numel() == 0) return;
    const c10::cuda::CUDAGuard guard(x.device());
    wan22::rms_norm_silu(p, c10::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void phase_interleave(const Tensor& phases, const Tensor& bias, const c10::optional<Tensor>& shortcut, Tensor out,
                      int64_t factor_t, int64_t frame_offset) {
    CHECK_BF16_CUDA(phases, "phases");
    CHECK_BF16_CUDA(out, "out");
    TORCH_CHECK(phases.dim() == 4 && phases.is_contiguous(), "phases must be a contiguous [N, h+1, w+1, 4C] tensor");
    TORCH_CHECK(out.dim() == 5 && out.is_contiguous(), "out must be a contiguous [B, T, 2h, 2w, C] tensor");
    const int64_t B = out.size(0), T = out.size(1), C = out.size(4);
    const int64_t h = phases.size(1) - 1, w = phases.size(2) - 1;
    TORCH_CHECK(C % 8 == 0 && C <= 2048, "out: channels must be a multiple of 8 and at most 2048, got ", C);
    TORCH_CHECK(phases.size(0) == B * T && phases.size(3) == 4 * C && out.size(2) == 2 * h && out.size(3) == 2 * w,
                "phases ", phases.sizes(), " do not match out ", out.sizes());
    CHECK_F32_VECTOR(bias, "bias", C);
    wan22::PhaseInterleaveParams p{};
    p.phases = reinterpret_cast<const __nv_bfloat16*>(phases.data_ptr());
    p.bias = bias.data_ptr<float>();
    p.out = reinterpret_cast<__nv_bfloat16*>(out.data_ptr());
    p.batch = static_cast<int>(B);
    p.frames_out = static_cast<int>(T);
    p.height = static_cast<int>(h);
    p.width = static_cast<int>(w);
    p.channels = static_cast<int>(C);
    p.factor_t = static_cast<int>(factor_t);
    p.frame_offset = static_cast<int>(frame_offset);
    p.frames_in = 1;
    p.shortcut_channels = static_cast<int>(C);
    p.repeats = 1;
    if (shortcut) {
        CHECK_BF16_CUDA(*shortcut, "shortcut");
        TORCH_CHECK(shortcut->dim() == 5 && shortcut->is_contiguous() && shortcut->size(0) == B &&
                        shortcut->size(2) == h && shortcut->size(3) == w,
                    "shortcut must be a contiguous [B, T_in, h, w, C_in] tensor, got ", shortcut->sizes());
        const int64_t c_in = shortcut->size(4);
        TORCH_CHECK((C * factor_t * 4) % c_in == 0, "shortcut channels ", c_in, " do not divide ", C * factor_t * 4);
        TORCH_CHECK((T - 1 + frame_offset) / factor_t < shortcut->size(1), "shortcut has too few frames");
        p.shortcut = reinterpret_cast<const __nv_bfloat16*>(shortcut->data_ptr());
        p.frames_in = static_cast<int>(shortcut->size(1));
        p.shortcut_channels = static_cast<int>(c_in);
        p.repeats = static_cast<int>(C * factor_t * 4 / c_in);
    }
    if (out.numel() == 0) return;
    const c10::cuda::CUDAGuard guard(out.device());
    wan22::phase_interleave(p, c10::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// conv_out's time partials of frames f, f - 1, f - 2 ([N, H, W, 36] fp32; the older two optional) -> frames.
void head_to_uint8(const Tensor& current, const c10::optional<Tensor>& previous, const c10::optional<Tensor>& before,
                   const Tensor& bias, Tensor out) {
    auto check_partials = [&](const Tensor& t, const char* name) {
        TORCH_CHECK(t.is_cuda() && t.scalar_type() == at::kFloat && t.dim() == 4 && t.size(3) == 36 &&
                        t.is_contiguous(),
                    name, " must be a contiguous float32 [N, H, W, 36] CUDA tensor, got ", t.sizes());
        TORCH_CHECK(t.sizes() == current.sizes(), name, " ", t.sizes(), " does not match current ", current.sizes());
    };
    check_partials(current, "current");
    if (previous) check_partials(*previous, "previous");
    if (before) check_partials(*before, "before");
    CHECK_F32_VECTOR(bias, "bias", 12);
    TORCH_CHECK(out.is_cuda() && out.scalar_type() == at::kByte && out.is_contiguous() && out.dim() == 4 &&
                    out.size(0) == current.size(0) && out.size(1) == 2 * current.size(1) &&
                    out.size(2) == 2 * current.size(2) && out.size(3) == 3,
                "out must be a contiguous uint8 [N, 2H, 2W, 3] CUDA tensor");
    wan22::HeadParams p{};
    p.current = current.data_ptr<float>();
    p.previous = previous ? previous->data_ptr<float>() : nullptr;
    p.before = before ? before->data_ptr<float>() : nullptr;
    p.bias = bias.data_ptr<float>();
    p.out = out.data_ptr<uint8_t>();
    p.frames = static_cast<int>(current.size(0));
    p.height = static_cast<int>(current.size(1));
    p.width = static_cast<int>(current.size(2));
    if (current.numel() == 0) return;
    const c10::cuda::CUDAGuard guard(current.device());
    wan22::head_to_uint8(p, c10::cuda::getCurrentCUDAStream());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// The implicit-GEMM conv's problem (conv_cutlass*.cu), checked. x [N, D, H, W, C] bf16 with (W, C) dense
// and 16-byte aligned strides; weight [K, C, KT, KH, KW] bf16 in channels-last memory ([K, KT, KH, KW, C]
// dense), `w` its dense view; bias [K] fp32; out [N, D-KT+1, H-KH+1, W+2*pad_w-KW+1, K] bf16 contiguous.
wan22::ConvParams conv_params(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor& out, int64_t pad_w,
                              Tensor& w) {
    CHECK_BF16_CUDA(x, "x");
    CHECK_BF16_CUDA(weight, "weight");
    CHECK_BF16_CUDA(out, "out");
    TORCH_CHECK(x.dim() == 5 && weight.dim() == 5 && out.dim() == 5, "x, weight and out must be 5-D");
    const int64_t C = x.size(4), K = weight.size(0);
    TORCH_CHECK(C % 64 == 0 && K % 8 == 0, "channels: C must be a multiple of 64 and K of 8, got ", C, ", ", K);
    TORCH_CHECK(weight.size(1) == C, "weight has ", weight.size(1), " input channels, x has ", C);
    TORCH_CHECK(x.stride(4) == 1 && x.stride(3) == C, "x must be dense over (W, C), got strides ", x.strides());
    for (int i = 0; i < 3; ++i)
        TORCH_CHECK(x.stride(i) % 8 == 0, "x: strides must be multiples of 8 elements, got ", x.strides());
    w = weight.permute({0, 2, 3, 4, 1});
    TORCH_CHECK(w.is_contiguous(), "weight must be channels-last");
    CHECK_F32_VECTOR(bias, "bias", K);
    const int64_t KT = weight.size(2), KH = weight.size(3), KW = weight.size(4);
    TORCH_CHECK(out.is_contiguous() && out.size(0) == x.size(0) && out.size(1) == x.size(1) - KT + 1 &&
                    out.size(2) == x.size(2) - KH + 1 && out.size(3) == x.size(3) + 2 * pad_w - KW + 1 &&
                    out.size(4) == K,
                "out ", out.sizes(), " does not match the conv of x ", x.sizes(), " and weight ", weight.sizes());
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
    return p;
}

// conv + bias into `out`; `config` indexes cutlass_conv_configs().
void conv_cutlass(const Tensor& x, const Tensor& weight, const Tensor& bias, Tensor out, int64_t pad_w,
                  int64_t config) {
    Tensor w;
    const wan22::ConvParams p = conv_params(x, weight, bias, out, pad_w, w);
    if (out.numel() == 0) return;
    const c10::cuda::CUDAGuard guard(x.device());
    const size_t bytes = wan22::conv_cutlass_workspace(p, static_cast<int>(config));
    Tensor workspace = at::empty({static_cast<int64_t>(bytes)}, x.options().dtype(at::kByte));
    const char* error = wan22::conv_cutlass(p, static_cast<int>(config), bytes ? workspace.data_ptr() : nullptr,
                                            bytes, c10::cuda::getCurrentCUDAStream());
    TORCH_CHECK(error == nullptr, "conv_cutlass (", x.sizes(), " * ", weight.sizes(), "): ", error);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
}

std::vector<std::string> cutlass_conv_configs() {
    int count = 0;
    const char* const* names = wan22::cutlass_conv_configs(&count);
    return std::vector<std::string>(names, names + count);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
    m.doc() = "Fused bandwidth-bound kernels of the Wan2.2 VAE decoder (channels-last bf16, fp32 math)";
    m.def("rms_norm_silu", &rms_norm_silu, "(bias +)(residual +) RMS norm (+ SiLU), or the plain sum, into `out`", py::arg("x"),
          py::arg("gamma"), py::arg("bias"), py::arg("residual"), py::arg("sum_out"), py::arg("out"), py::arg("silu"),
          py::arg("history") = py::none(), py::arg("normalize") = true);
    m.def("phase_interleave", &phase_interleave, "four-phase resampler epilogue", py::arg("phases"), py::arg("bias"),
          py::arg("shortcut"), py::arg("out"), py::arg("factor_t"), py::arg("frame_offset"));
    m.def("head_to_uint8", &head_to_uint8, "conv_out epilogue: time partials + bias, unpatchify, clamp, uint8",
          py::arg("current"), py::arg("previous"), py::arg("before"), py::arg("bias"), py::arg("out"));
    m.def("conv_cutlass", &conv_cutlass, "implicit-GEMM conv (CUTLASS, fixed summation order) + bias into `out`",
          py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("out"), py::arg("pad_w"), py::arg("config"));
    m.def("cutlass_conv_configs", &cutlass_conv_configs,
          "the conv tile configurations of this build, in `config` order (empty without CUTLASS)");
}
