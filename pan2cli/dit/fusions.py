"""The `pan2_fusions` ops: fused Q/K RMSNorm + RoPE and LayerNorm + modulation, their PyTorch references, and the switch.

Three ops, each with one signature for both paths:

* `qk_norm_rope`: per-head RMSNorm of the video and text q/k (separate weights per stream), RoPE on the
  video tokens only (PAN 2's interleaved channel pairs), written as the joint `[B, N + L, H, head_dim]`
  q and k (video tokens first). Without `cos`/`sin` it is the plain Q/K RMSNorm (the text refiner).
* `layer_norm_modulate`: `LayerNorm(x) · (1 + scale) + shift` with scale/shift per sample (`[B, 1, D]`:
  the video stream's AdaLN-Zero, or the text stream's static table broadcast over the batch), per
  latent frame or per token (`[B, G, D]`, G dividing N).
* `gated_residual`: `x + gate · update` (the blocks' gated residuals) in one pass instead of eager's five
  (up-casts, multiply-add, down-cast).

The fused path runs one Triton kernel per op and stream (files beside this one), registered as
`torch.ops.pan2_fusions.*` custom ops with shape-only fakes so `torch.compile` keeps them as opaque
calls. The reference path is plain PyTorch in float32 (float64 for float64 inputs) with one rounding at
the end; the kernels do the same math in float32, so both agree to float32 rounding (bf16 outputs differ
by at most one bf16 ulp here and there). The text refiner's pre-norms (RMSNorm over D of at most ~1.5 k
tokens) stay in PyTorch: a microsecond-scale pass once per forward.

`set_fused_kernels(model, enabled)` picks the path for every module of a model that has a
`fused_kernels` attribute; `None` (the default) means fused for CUDA tensors when Triton is installed,
reference elsewhere.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from pan2cli.dit.fp8 import Fp8Product, k_mean_tokens
from pan2cli.dit.rope import apply_rope
from pan2cli.errors import KernelBuildError
from pan2cli.triton_support import triton_available


# -- reference (unfused) PyTorch ------------------------------------------------------------------
def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """Where norms and modulation are computed: float64 for float64 tensors, float32 for everything else."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim in `compute_dtype(x)`: `x / sqrt(mean(x²) + eps) · weight`, not rounded back."""
    xf = x.to(compute_dtype(x))
    y = xf * torch.rsqrt(xf.square().mean(dim=-1, keepdim=True) + eps)
    return y if weight is None else y * weight.to(xf.dtype)


def qk_norm_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_text: Optional[torch.Tensor] = None,
    k_text: Optional[torch.Tensor] = None,
    q_text_weight: Optional[torch.Tensor] = None,
    k_text_weight: Optional[torch.Tensor] = None,
    eps: float = 1e-6,
    interleaved: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference of `qk_norm_rope` (float32 math, float64 for float64 q; one rounding to the dtype of q)."""
    outs = []
    for x, w, x_text, w_text in ((q, q_weight, q_text, q_text_weight), (k, k_weight, k_text, k_text_weight)):
        video = rms_norm_reference(x, w, eps)
        if cos is not None:
            video = apply_rope(video, cos.to(video.dtype), sin.to(video.dtype), interleaved)
        if x_text is not None:
            video = torch.cat([video, rms_norm_reference(x_text, w_text, eps)], dim=1)
        outs.append(video.to(x.dtype))
    return outs[0], outs[1]


def layer_norm_modulate_reference(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float = 1e-6
) -> torch.Tensor:
    """Reference of `layer_norm_modulate` (float32 math, float64 for float64 x; one rounding to the dtype of x)."""
    batch, n_tokens, dim = x.shape
    groups = scale.shape[1]
    dtype = compute_dtype(x)
    xf = F.layer_norm(x.to(dtype).reshape(batch, groups, n_tokens // groups, dim), (dim,), eps=eps)
    y = xf * (1 + scale.to(dtype)[:, :, None]) + shift.to(dtype)[:, :, None]
    return y.view(batch, n_tokens, dim).to(x.dtype)


def gated_residual_reference(x: torch.Tensor, update: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """Reference of `gated_residual`: `x + gate·update` in `compute_dtype(x)`, rounded once to the dtype of x."""
    dtype = compute_dtype(x)
    return torch.addcmul(x.to(dtype), update.to(dtype), gate.to(dtype)).to(x.dtype)


# -- the custom ops -------------------------------------------------------------------------------
@torch.library.custom_op("pan2_fusions::qk_norm_rope", mutates_args=())
def _qk_norm_rope_op(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: Optional[torch.Tensor],
    sin: Optional[torch.Tensor],
    q_text: Optional[torch.Tensor],
    k_text: Optional[torch.Tensor],
    q_text_weight: Optional[torch.Tensor],
    k_text_weight: Optional[torch.Tensor],
    eps: float,
    interleaved: bool,
    fp8_out: bool = False,
    q_out_mult: float = 1.0,
    k_out_mult: float = 1.0,
    hadamard: bool = False,
    smooth_k: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    from pan2cli.dit.qk_norm_rope_kernel import qk_norm_rope as launch

    q_out, k_out = _joint_qk(q, q_text, fp8_out)
    k_mean = None
    if smooth_k:
        k_mean = _joint_k_mean(k, k_weight, cos, sin, k_text, k_text_weight, eps, interleaved)
    if hadamard:  # the kernel multiplies by the ±1 matrix: the 1/√head_dim rides on the factors
        q_out_mult, k_out_mult = (m / math.sqrt(q.shape[-1]) for m in (q_out_mult, k_out_mult))
    options = dict(q_out_mult=q_out_mult, k_out_mult=k_out_mult, k_mean=k_mean, hadamard=hadamard)
    launch(q, k, q_weight, k_weight, cos, sin, q_out, k_out, eps=eps, interleaved=interleaved, **options)
    if q_text is not None:
        launch(
            q_text, k_text, q_text_weight, k_text_weight, None, None, q_out, k_out,
            eps=eps, out_token_offset=q.shape[1], **options,
        )  # fmt: skip
    return q_out, k_out


@_qk_norm_rope_op.register_fake
def _(q, k, q_weight, k_weight, cos, sin, q_text, k_text, q_text_weight, k_text_weight, eps, interleaved,
      fp8_out=False, q_out_mult=1.0, k_out_mult=1.0, hadamard=False, smooth_k=False):  # fmt: skip
    return _joint_qk(q, q_text, fp8_out)


def _joint_k_mean(
    k, k_weight, cos, sin, k_text, k_text_weight, eps: float, interleaved: bool
) -> torch.Tensor:
    """The mean of RMSNorm(K) (RoPE on the video tokens) over every 4th token of the video and the text
    (`pan2cli.dit.fp8.smoothing_mean`), per (batch, head): `[B, H, head_dim]` float32, from the fused sum
    kernel's partial sums added in a fixed order."""
    from pan2cli.dit.qk_norm_rope_kernel import k_sum_blocks, k_token_sums

    batch, n_video, heads, head_dim = k.shape
    n_text = 0 if k_text is None else k_text.shape[1]
    blocks = k_sum_blocks(n_video) + k_sum_blocks(n_text)
    partial = torch.empty(blocks, batch, heads, head_dim, dtype=torch.float32, device=k.device)
    k_token_sums(k, k_weight, cos, sin, partial, eps=eps, interleaved=interleaved)
    if n_text:
        k_token_sums(k_text, k_text_weight, None, None, partial, eps=eps, block_offset=k_sum_blocks(n_video))
    return partial.sum(dim=0).div_(max(1, k_mean_tokens(n_video) + k_mean_tokens(n_text)))


def _joint_qk(
    q: torch.Tensor, q_text: Optional[torch.Tensor], fp8_out: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialised joint q and k `[B, N + L, H, head_dim]`: video tokens, then text (L = 0 without);
    float8_e4m3fn with `fp8_out`, else the dtype of q."""
    batch, n_video, n_heads, head_dim = q.shape
    n_text = 0 if q_text is None else q_text.shape[1]
    dtype = torch.float8_e4m3fn if fp8_out else q.dtype
    q_out = q.new_empty(batch, n_video + n_text, n_heads, head_dim, dtype=dtype)
    return q_out, torch.empty_like(q_out)


@torch.library.custom_op("pan2_fusions::layer_norm_modulate", mutates_args=())
def _layer_norm_modulate_op(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float
) -> torch.Tensor:
    from pan2cli.dit.layer_norm_modulate_kernel import layer_norm_modulate as launch

    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    launch(x, scale, shift, out, eps=eps)
    return out


@_layer_norm_modulate_op.register_fake
def _(x, scale, shift, eps):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


@torch.library.custom_op("pan2_fusions::layer_norm_modulate_fp8", mutates_args=())
def _layer_norm_modulate_fp8_op(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    from pan2cli.dit.layer_norm_modulate_kernel import layer_norm_modulate as launch

    out, out_scale = _fp8_like(x)
    launch(x, scale, shift, out, eps=eps, out_scale=out_scale.view(-1))
    return out, out_scale


@_layer_norm_modulate_fp8_op.register_fake
def _(x, scale, shift, eps):
    return _fp8_like(x)


def _fp8_like(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An uninitialised e4m3 copy of x's shape and its per-row float32 scales `x.shape[:-1]`."""
    out = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    return out, torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device)


@torch.library.custom_op("pan2_fusions::gated_residual", mutates_args=())
def _gated_residual_op(
    x: torch.Tensor, update: torch.Tensor, gate: torch.Tensor, row_scale: Optional[torch.Tensor] = None,
    col_scale: Optional[torch.Tensor] = None, bias: Optional[torch.Tensor] = None,
) -> torch.Tensor:  # fmt: skip
    """The fused residual; with row_scale and col_scale, update is an fp8 product's raw GEMM output."""
    from pan2cli.dit.gated_residual_kernel import gated_residual as launch

    batch, _, dim = x.shape
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    launch(
        x, update, gate.reshape(-1, dim).expand(batch, dim), out,
        row_scale=row_scale, col_scale=col_scale, bias=bias,
    )  # fmt: skip
    return out


@_gated_residual_op.register_fake
def _(x, update, gate, row_scale=None, col_scale=None, bias=None):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


# -- dispatch -------------------------------------------------------------------------------------
def qk_norm_rope(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    cos: Optional[torch.Tensor],
    sin: Optional[torch.Tensor],
    q_text: Optional[torch.Tensor] = None,
    k_text: Optional[torch.Tensor] = None,
    q_text_weight: Optional[torch.Tensor] = None,
    k_text_weight: Optional[torch.Tensor] = None,
    *,
    eps: float,
    fused: bool,
    interleaved: bool = True,
    out_dtype: Optional[torch.dtype] = None,
    q_out_mult: float = 1.0,
    k_out_mult: float = 1.0,
    hadamard: bool = False,
    smooth_k: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Q/K RMSNorm per head + RoPE for video tokens, RMSNorm only for text tokens; joint output.

    Args:
        q, k: video `[B, N, H, head_dim]` (the `[H, head_dim]` block of each token contiguous).
        q_weight, k_weight: video RMSNorm weights `[head_dim]`.
        cos, sin: `[N, head_dim/2]` (`rope.rope_table`; float32 for the fused path), or None: no rotation.
        q_text, k_text: text `[B, L, H, head_dim]` or None; q_text_weight, k_text_weight: `[head_dim]`.
        eps: RMSNorm epsilon.
        fused: run the Triton kernels (power-of-two head_dim, not float64) instead of the reference.
        interleaved: RoPE pairs (2i, 2i+1), PAN 2's layout; False pairs (i, i + head_dim/2).
        out_dtype: None (the dtype of q) or float8_e4m3fn (fused only: the fp8 tier), then q and k are
            multiplied by `q_out_mult` / `k_out_mult`, clamped to ±448 and rounded once to e4m3.
        hadamard, smooth_k: the fp8 attention's transformations (fused, fp8 output only;
            `pan2cli.dit.fp8_attention`): after RoPE, subtract K's mean over every 4th token of its
            (batch, head) (`smooth_k`, `pan2cli.dit.fp8.smoothing_mean`), then multiply Q and K by
            H/√head_dim (`hadamard`; head_dim 16-128).

    Returns:
        (q, k), each `[B, N + L, H, head_dim]` contiguous in the dtype of q (or `out_dtype`): video tokens,
        then text.
    """
    fp8_out = out_dtype == torch.float8_e4m3fn
    assert fp8_out or not (hadamard or smooth_k), "hadamard and smooth_k go with the fp8 output"
    if not fused:
        assert not fp8_out and not hadamard and not smooth_k, (
            "the fp8 output of qk_norm_rope is the fused kernel's (emulated by fp8_attention.quantize_qk_reference)"
        )
        return qk_norm_rope_reference(
            q, k, q_weight, k_weight, cos, sin, q_text, k_text, q_text_weight, k_text_weight, eps, interleaved
        )
    return _qk_norm_rope_op(
        q, k, q_weight, k_weight, cos, sin, q_text, k_text, q_text_weight, k_text_weight, eps, interleaved,
        fp8_out, float(q_out_mult), float(k_out_mult), hadamard, smooth_k,
    )  # fmt: skip


def layer_norm_modulate(
    x: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    *,
    eps: float,
    fused: bool,
    quantize: bool = False,
):
    """`LayerNorm(x) · (1 + scale) + shift` (LayerNorm without affine).

    Args:
        x: `[B, N, D]`.
        scale, shift: `[B, G, D]`, G dividing N (tokens `g·N/G … (g+1)·N/G − 1` use group g).
        eps: LayerNorm epsilon.
        fused: run the Triton kernel instead of the reference.
        quantize: return the result quantised per token to e4m3 (`pan2cli.dit.fp8`), for an fp8 GEMM.

    Returns:
        `[B, N, D]` in the dtype of x, or with `quantize` an `Fp8Activation` (`[B, N, D]` e4m3, `[B, N]` scales).
    """
    if quantize:
        from pan2cli.dit.fp8 import Fp8Activation, quantize_rows_reference

        if fused:
            return Fp8Activation(*_layer_norm_modulate_fp8_op(x, scale, shift, eps))
        return quantize_rows_reference(layer_norm_modulate_reference(x, scale, shift, eps))
    op = _layer_norm_modulate_op if fused else layer_norm_modulate_reference
    return op(x, scale, shift, eps)


def gated_residual(
    x: torch.Tensor, update: torch.Tensor | Fp8Product, gate: torch.Tensor, *, fused: bool
) -> torch.Tensor:
    """`x + gate·update` computed in float32 (float64 for float64 x) and rounded once to the dtype of x.

    Args:
        x, update: `[B, S, D]`, rows contiguous; update may be an fp8 linear's unscaled product
            (`pan2cli.dit.fp8.Fp8Product`), scaled on the way in. gate: `[B, 1, D]`, `[1, 1, D]` or `[D]` (any
            float dtype).
        fused: run the Triton kernel (one pass) instead of the reference.
    """
    if isinstance(update, Fp8Product):
        if fused:
            return _gated_residual_op(
                x, update.raw, gate, update.row_scale.contiguous(), update.col_scale, update.bias
            )
        update = update.dequantize(compute_dtype(x))
    op = _gated_residual_op if fused else gated_residual_reference
    return op(x, update, gate)


# -- the switch -----------------------------------------------------------------------------------
def use_fused(setting: Optional[bool], x: torch.Tensor) -> bool:
    """Resolve a module's `fused_kernels` setting for input `x`: None means CUDA and Triton present.

    float64 always takes the reference: the kernels compute in float32.
    """
    if x.dtype == torch.float64:
        return False
    if setting is None:
        return x.is_cuda and triton_available()
    return setting


def set_fused_kernels(model: torch.nn.Module, enabled: Optional[bool]) -> int:
    """Switch every module of `model` with a `fused_kernels` attribute to the fused or reference ops.

    Args:
        model: a `PAN2Transformer3DModel` (or any module holding its blocks).
        enabled: True (Triton kernels), False (PyTorch reference), None (fused on CUDA when Triton is
            installed, reference elsewhere; the default of a new model).

    Returns:
        The number of modules switched.

    Raises:
        KernelBuildError: enabled is True but Triton is not installed.
        ValueError: enabled is True and a module's head_dim is not a power of two.
    """
    if enabled and not triton_available():
        raise KernelBuildError(
            "the fused DiT kernels need Triton, which is not installed",
            hint="install a CUDA build of torch (it brings Triton), or run with the reference ops",
        )
    switched = 0
    for module in model.modules():
        if not hasattr(module, "fused_kernels"):
            continue
        head_dim = getattr(module, "head_dim", None)
        if enabled and head_dim is not None and head_dim & (head_dim - 1):
            raise ValueError(f"the fused Q/K kernel needs a power-of-two head_dim, this model has {head_dim}")
        module.fused_kernels = enabled
        switched += 1
    return switched
