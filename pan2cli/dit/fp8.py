"""The fp8 tier's numbers: e4m3 quantisation, the fp8 linear, and whether a device runs it.

Format: float8_e4m3fn (4 exponent bits, 3 mantissa bits, largest finite 448, no infinities), rounded to
nearest even. A quantised tensor is (data, scale) with real value = data · scale:

* weights: one scale per output channel, `max|w[n, :]| / 448`, computed once at load from the bf16 (or
  float32) checkpoint (`quantize_weight`); no second checkpoint file.
* activations: one scale per token (row), `max|x[m, :]| / 448`, written by the kernel that produces the
  activation (LayerNorm + modulation, GELU after fc1, or `quantize_rows_fp8` for the attention output), so
  there is no separate quantisation pass over HBM. An all-zero row has scale 1; a row holding NaN or Inf
  gets a NaN scale, so the GEMM's output is NaN there and the sampler stops with a clear error
  (`check_finite`) instead of writing a NaN video.
* the GEMM: `torch._scaled_mm` with row-wise scales on the fp8 tensor cores, bias added in its epilogue,
  bf16 out, with cuBLASLt's fast accumulation (the tensor cores' own ~14-bit-mantissa sums over a K tile,
  without the periodic promotion to float32): measured on an H200 at PAN 2's shapes it is 12 % faster for
  q/k/v/o and fc1 and adds 0.1 % to the relative error of e4m3's own 3.7 % (scripts/bench_kernels.py fp8-gemm);
  `PAN2_FP8_FAST_ACCUM=0` turns it off. On the CPU (tests) `Fp8Linear` emulates the GEMM: the dequantised
  operands multiplied in float32.
* the MLP's fc2 (`Fp8Linear.product`): the GEMM of the e4m3 operands with unit scales, bf16 out, the scales
  and the bias applied by the gated residual that consumes it (`Fp8Product`). cuBLASLt runs row-wise scales
  ("outer vector") only with 128x128 tiles; with unit (per-tensor) scales it picks 256-wide cooperative
  tiles: 5.067 against 5.505 ms at 121 frames on an H100 (`fc2`, 26,598 x 32768 x 4096; 4.73 ms a call in
  the model's step), and the residual reads the two scale vectors from L2. One more rounding than the
  scaled GEMM's: the product to bf16 before its scales, 2⁻⁹ relative, as the scaled product's own rounding
  to bf16.

Error of one product: each operand's rounding is at most 2⁻⁴ relative (3 mantissa bits: half an ulp of
2⁻³), so an element of x·wᵀ is off by at most (2·2⁻⁴ + 2⁻⁸)·Σ|x_k·w_k| before accumulation rounding.

Q and K of the attention need no measured scale. After the per-head RMSNorm with weights w, a head's vector
x = w ⊙ u has u of unit RMS, so its length is ‖x‖₂ ≤ ‖u‖₂ · max|w| = √D · max|w| (D = head_dim), and RoPE
rotates channel pairs, which keeps that length. Every element is at most the vector's length in magnitude,
so R = √D · max|w| bounds every element (`qk_bound`) and gives a fixed scale per block and stream.

The fp8 attention quantises Q and K after two exact transformations (`pan2cli.dit.fp8_attention`):

* the Hadamard rotation x ↦ x·H/√D (H the ±1 Sylvester matrix, `hadamard_matrix`): orthonormal, so
  (QH)(KH)ᵀ = QKᵀ. Each rotated element is ⟨x, h_j⟩/√D with ‖h_j‖₂ = √D, at most ‖x‖₂ by Cauchy–Schwarz:
  the bound R holds unchanged. What changes is the typical element: an outlier channel's energy is spread
  over all D channels, so a few channels no longer take e4m3's rounding at their own (large) magnitude.
* K smoothing, k ↦ k − m with m the mean of K over every 4th joint token of its (batch, head): every score
  of a query row moves by the same q·m, which the softmax removes. ‖m‖₂ ≤ R (a mean of vectors of length ≤ R),
  so ‖k − m‖₂ ≤ 2R and the K bound doubles (`qk_bound(..., mean_subtracted=True)`), before or after the
  rotation alike. 2R is reached only by a key opposite to all the others; the doubled scale moves K's
  values one binade down in e4m3, where the relative rounding is the same (2⁻⁴) until they reach the
  subnormals (below 2⁻⁶ · 2R/448, about 8·10⁻⁴ of a unit-RMS element at D = 128).
"""

from __future__ import annotations

import math
import os
from typing import NamedTuple

import torch
from torch import nn

from pan2cli.errors import Pan2Error

FP8 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# The fp8 attention scales P (in [0, 1]) by 2**P_SHIFT before its e4m3 cast (pan2cli.dit.fp8_attention_kernel).
P_SHIFT = 8
# cuBLASLt's fast accumulation for the fp8 GEMMs (module docstring); read once, at import.
FAST_ACCUMULATION = os.environ.get("PAN2_FP8_FAST_ACCUM", "1").strip() != "0"
# cuBLASLt has no fast-accumulation kernel for a few rows (CUBLAS_STATUS_NOT_SUPPORTED at 12, the negative
# prompt's text tokens); the text stream's GEMMs are a fraction of a percent of the time anyway.
FAST_ACCUMULATION_MIN_ROWS = 1024
# `quantize_weight` quantises this many elements at a time, so that its float32 temporary stays 64 MiB.
QUANTIZE_BLOCK_ELEMENTS = 2**24


class Fp8Product(NamedTuple):
    """An fp8 linear's output before its scales (`Fp8Linear.product`): real value = raw · row_scale[..., None] ·
    col_scale + bias. raw `[..., N]` bf16 (CUDA) or float32 (emulation); row_scale `[...]` and col_scale
    `[N]` float32; bias `[N]` or None."""

    raw: torch.Tensor
    row_scale: torch.Tensor
    col_scale: torch.Tensor
    bias: torch.Tensor | None

    @property
    def shape(self) -> torch.Size:
        return self.raw.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out = self.raw.to(dtype) * self.row_scale.to(dtype)[..., None] * self.col_scale.to(dtype)
        return out if self.bias is None else out + self.bias.to(dtype)


class Fp8Activation(NamedTuple):
    """A per-token quantised activation: `data` `[..., K]` float8_e4m3fn, `scale` `[...]` float32 (real = data·scale)."""

    data: torch.Tensor
    scale: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        """The activation's shape (the data's), so that code reads the shape of quantised and plain activations alike."""
        return self.data.shape

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.data.to(dtype) * self.scale.to(dtype)[..., None]


class NonFiniteError(Pan2Error):
    """NaN or Inf reached the fp8 tier's activations (or the latents): exit code 1."""


# -- quantisation (PyTorch reference; the Triton kernels compute the same) ---------------------------
def row_scales(x: torch.Tensor) -> torch.Tensor:
    """Per-row scales `max|x[..., :]| / 448` in float32 (1 for all-zero rows, NaN for rows with NaN/Inf)."""
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    bad = ~torch.isfinite(xf).all(dim=-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return torch.where(bad, torch.full_like(scale, float("nan")), scale)


def quantize_with_scales(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`x / scale` (scale broadcast over the last dim) clamped to ±448 and rounded to e4m3 (nearest even)."""
    scale = scale.float()
    return (x.float() * (1.0 / scale)[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(FP8)


def quantize_rows_reference(x: torch.Tensor, *, per_tensor: bool = False) -> Fp8Activation:
    """x `[..., K]` → per-row (or, with `per_tensor`, one shared) e4m3 quantisation (module docstring)."""
    if per_tensor:
        scale = row_scales(x.reshape(1, -1)).expand(x.shape[:-1]).contiguous()
    else:
        scale = row_scales(x)
    return Fp8Activation(quantize_with_scales(x, scale), scale)


def quantize_rows(x: torch.Tensor, *, fused: bool, gelu: bool = False) -> Fp8Activation:
    """x `[..., K]` (of GELU-tanh(x) with `gelu`: the MLP between fc1 and fc2) quantised per row to e4m3.

    Args:
        x: `[..., K]`, K ≤ 32768 for the fused kernel.
        fused: one pass of the Triton kernel (`quantize_rows_kernel.py`) instead of the PyTorch reference
            (GELU in float32, then `quantize_rows_reference`).
        gelu: apply GELU (tanh approximation) first.
    """
    if not fused:
        if gelu:
            x = torch.nn.functional.gelu(
                x.double() if x.dtype == torch.float64 else x.float(), approximate="tanh"
            )
        return quantize_rows_reference(x)
    from pan2cli.dit.quantize_rows_kernel import quantize_rows_fp8

    rows = x.reshape(-1, x.shape[-1])
    data = torch.empty(rows.shape, dtype=FP8, device=x.device)
    scale = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
    quantize_rows_fp8(rows, data, scale, gelu=gelu)
    return Fp8Activation(data.view(x.shape), scale.view(x.shape[:-1]))


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A linear's weight `[N, K]` → (e4m3 `[N, K]`, float32 scales `[N]`), one scale per output channel.

    Computed where the weight is (on the GPU at load), a block of rows at a time so that the float32
    temporary stays small.

    Raises:
        NonFiniteError: the weight holds NaN or Inf.
    """
    data = torch.empty(weight.shape, dtype=FP8, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    rows = max(1, QUANTIZE_BLOCK_ELEMENTS // max(1, weight.shape[1]))
    for start in range(0, weight.shape[0], rows):
        part = weight[start : start + rows]
        scale[start : start + rows] = row_scales(part)
        data[start : start + rows] = quantize_with_scales(part, scale[start : start + rows])
    if not torch.isfinite(scale).all():
        raise NonFiniteError("a weight of the transformer holds NaN or Inf: the checkpoint is damaged")
    return data, scale


def qk_bound(head_dim: int, *weights: torch.Tensor, mean_subtracted: bool = False) -> float:
    """The largest magnitude a Q or K element can take after the per-head RMSNorm (and RoPE, and the Hadamard
    rotation) with these weights: √head_dim · max|weight| (module docstring); twice that for K with its mean
    over the tokens subtracted (`mean_subtracted`)."""
    bound = math.sqrt(head_dim) * max(float(w.detach().abs().max()) for w in weights)
    return 2 * bound if mean_subtracted else bound


# K smoothing's mean is taken over every 4th token of each stream (`pan2cli.dit.qk_norm_rope_kernel` says why).
K_MEAN_STRIDE = 4


def k_mean_tokens(n_tokens: int) -> int:
    """How many of a stream's `n_tokens` tokens K smoothing's mean is taken over: tokens 0, S, 2S, … (S =
    `K_MEAN_STRIDE`)."""
    return -(-n_tokens // K_MEAN_STRIDE)


def smoothing_mean(k: torch.Tensor, n_video: int) -> torch.Tensor:
    """The mean K smoothing subtracts from the joint `k` `[B, N + L, H, D]` (video tokens first): over every
    `K_MEAN_STRIDE`-th token of each stream, in k's dtype → `[B, 1, H, D]`."""
    return torch.cat([k[:, :n_video:K_MEAN_STRIDE], k[:, n_video::K_MEAN_STRIDE]], dim=1).mean(
        dim=1, keepdim=True
    )


def hadamard_rotates(head_dim: int) -> bool:
    """Whether the fp8 attention rotates Q and K of this head size: a power of two from 16 (the Triton kernel
    multiplies by the matrix on the tensor cores, whose tiles are at least 16 wide) to 128 (at 256 the ±1
    matrix takes 128 KiB of shared memory, more than an Ada GPU gives a program)."""
    return 16 <= head_dim <= 128 and head_dim & (head_dim - 1) == 0


def hadamard_matrix(head_dim: int, dtype: torch.dtype = torch.float32, device=None) -> torch.Tensor:
    """The ±1 Sylvester–Hadamard matrix `[head_dim, head_dim]`: H[i, j] = (−1)^popcount(i & j), symmetric,
    H·Hᵀ = head_dim·I (so H/√head_dim is orthonormal). head_dim a power of two."""
    assert head_dim >= 1 and head_dim & (head_dim - 1) == 0, f"head_dim {head_dim} must be a power of two"
    index = torch.arange(head_dim, device=device)
    bits = index[:, None] & index[None, :]
    parity = torch.zeros_like(bits)
    while bool(bits.any()):
        parity ^= bits & 1
        bits = bits >> 1
    return (1 - 2 * parity).to(dtype)


def check_finite(x: torch.Tensor, what: str) -> None:
    """Raise `NonFiniteError` if x holds NaN or Inf (one device sync: call it once per step, not per block)."""
    if not torch.isfinite(x).all():
        raise NonFiniteError(
            f"{what} holds NaN or Inf",
            hint="the fp8 tier saturates at ±448 and cannot carry NaN/Inf activations; "
            "run with --precision bf16 to see whether the model itself overflows",
        )


# -- the linear ----------------------------------------------------------------------------------
class Fp8Linear(nn.Module):
    """`y = x·wᵀ + b` with w in e4m3 (per-output-channel scales) and x quantised per token (module docstring).

    Built from an `nn.Linear` by `from_linear` (the weight is quantised where it lives, then dropped).
    `forward` takes an `Fp8Activation` (quantised by the kernel that produced it) or a plain tensor, which is
    quantised here per token (`input_scaling="token"`) or with one scale for the whole tensor ("tensor": for
    accuracy measurements only). Returns bf16 on CUDA, the input's float dtype on the CPU (emulation).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", torch.empty(out_features, in_features, dtype=FP8, device=device))
        self.register_buffer("weight_scale", torch.empty(out_features, dtype=torch.float32, device=device))
        self.bias = (
            nn.Parameter(torch.empty(out_features, device=device), requires_grad=False) if bias else None
        )
        self.input_scaling = "token"

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> "Fp8Linear":
        weight = linear.weight.detach()
        module = cls(linear.in_features, linear.out_features, linear.bias is not None, device="meta")
        module.weight, module.weight_scale = quantize_weight(weight)
        if linear.bias is not None:
            bias_dtype = torch.bfloat16 if weight.is_cuda else weight.dtype
            module.bias = nn.Parameter(linear.bias.detach().to(bias_dtype), requires_grad=False)
        return module

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3, input {self.input_scaling}"

    def quantize_input(self, x: torch.Tensor) -> Fp8Activation:
        if self.input_scaling == "tensor":
            return quantize_rows_reference(x, per_tensor=True)
        return quantize_rows(x, fused=x.is_cuda)

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor:
        if not isinstance(x, Fp8Activation):
            x = self.quantize_input(x)
        lead = x.data.shape[:-1]
        data = x.data.reshape(-1, self.in_features)
        scale = x.scale.reshape(-1, 1)
        if data.is_cuda:
            out = self._gemm(data, scale, self.weight_scale.view(1, -1), self.bias)
        else:  # emulation: the same products of dequantised operands, in float32 (float64 for a float64 bias)
            dtype = self._emulation_dtype()
            weight = self.weight.to(dtype) * self.weight_scale.to(dtype)[:, None]
            out = (data.to(dtype) * scale.to(dtype)) @ weight.t()
            if self.bias is not None:
                out = out + self.bias.to(dtype)
        return out.view(*lead, self.out_features)

    def product(self, x: Fp8Activation) -> Fp8Product:
        """The GEMM of x's and the weight's e4m3 values with unit scales (bf16 on CUDA, float32 emulated on the
        CPU), their scales and the bias left to the consumer (module docstring)."""
        lead = x.data.shape[:-1]
        data = x.data.reshape(-1, self.in_features)
        if data.is_cuda:
            unit = _unit_scale(data.device)
            raw = self._gemm(data, unit, unit, None)
        else:  # emulated in `forward`'s dtype
            dtype = self._emulation_dtype()
            raw = data.to(dtype) @ self.weight.to(dtype).t()
        return Fp8Product(raw.view(*lead, self.out_features), x.scale, self.weight_scale, self.bias)

    def _gemm(self, data: torch.Tensor, scale_a, scale_b, bias) -> torch.Tensor:
        """cuBLASLt's fp8 GEMM of `data` `[M, K]` e4m3 and the weight with these scales (and bias), bf16 out,
        fast accumulation where it runs (module docstring)."""
        return torch._scaled_mm(
            data, self.weight.t(), scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=torch.bfloat16,
            use_fast_accum=FAST_ACCUMULATION and data.shape[0] >= FAST_ACCUMULATION_MIN_ROWS,
        )  # fmt: skip

    def _emulation_dtype(self) -> torch.dtype:
        """The CPU emulation's dtype: float64 for a float64 model (its bias), else float32."""
        return torch.float64 if self.bias is not None and self.bias.dtype == torch.float64 else torch.float32


_UNIT_SCALES: dict[torch.device, torch.Tensor] = {}


def _unit_scale(device: torch.device) -> torch.Tensor:
    """A float32 scalar 1 on `device` (the unit scales of `Fp8Linear.product`), made once per device."""
    if device not in _UNIT_SCALES:
        _UNIT_SCALES[device] = torch.ones((), dtype=torch.float32, device=device)
    return _UNIT_SCALES[device]
