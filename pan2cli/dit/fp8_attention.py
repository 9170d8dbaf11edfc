"""The fp8 tier's joint attention: Q, K, V in e4m3 from the fused kernels, one fp8 attention, bf16 out.

`joint_attention_fp8(attn, x, ctx, cos, sin)` replaces the bf16 path of `PAN2Attention.forward` (not under
sequence parallelism, which keeps bf16 attention):

1. the q/k/v projections (fp8 GEMMs when the block is quantised);
2. `qk_norm_rope` writes the joint Q and K straight in e4m3 (`quantize_qk`), after two exact
   transformations that keep trained models' outliers from costing precision (`Fp8AttentionScales`,
   `Fp8Policy.qk_hadamard` / `smooth_k` turn them off for comparisons):
   * K smoothing: K's mean over every 4th token of its (batch, head) is subtracted (each score of a query
     row moves by the same q·mean, which the softmax removes): keys that share a large common direction
     keep their per-token differences in e4m3's 3 bits instead of spending them on the common part;
   * a Hadamard rotation of Q and K, x ↦ x·H/√D (orthonormal: (QH)(KH)ᵀ = QKᵀ; FlashAttention-3's
     "incoherent processing"): a few outlier channels are spread over all D channels, so the scores are no
     longer sums of a few large products, each rounded at its own large magnitude;
   then one fixed scale per tensor (the RMSNorm bound of `pan2cli.dit.fp8.qk_bound`, doubled for the
   smoothed K; per block, the stream with the larger weights setting it);
3. `values_fp8` quantises V with one scale per head, transposed for the kernel;
4. the fp8 attention the run chose once (`fp8_attention_choice`: pan2's CUDA kernel on sm_90 GPUs with head
   dim 128, pan2's Triton kernel elsewhere, cuDNN's when asked for), each call recorded in the block's
   `Fp8AttentionRun` (what ran, for the sidecar); cuDNN's e4m3 output goes to `to_out` without another
   quantisation;
5. the output projections.

On the CPU (tests) the same steps run as PyTorch emulations (`quantize_qk_reference`, `attention_reference`,
recorded as "emulation"):
Q and K smoothed, rotated (float16 operands, as the kernel's tensor cores take them) and rounded to e4m3
with the same scales, V per head, P rounded to e4m3 (times 2⁸) as the kernel rounds it, the rest in float32.

Measured in that emulation on the outlier suite (`pan2cli.testing.attention_inputs`, 4,160 tokens of 4
heads of 128; error = relative RMS of O against float64 attention of the same bf16 inputs; the table is in
docs/BENCHMARKS.md, `scripts/bench_kernels.py fp8-attention --suite --emulate` makes it): the rotation takes
4 outlier channels of Q and K from 0.208 to 0.052, the random-input level (0.053); smoothing takes keys
that share one direction from 0.045 to 0.036; per-token Q/K scales on top move no case by more than 0.0012
(e4m3's relative precision does not depend on the scale while values stay normal, and the fixed scales
keep RMS-normed vectors there: K scales 2x and 4x tighter than the doubled bound gave the same errors to
4 digits on the random and shared-key cases), and V per channel instead of per head nothing on
heavy-tailed V. Neither is used: the attention kernels keep one Q·K descale
and one V descale per head. Head dims outside 16-128 or not a power of two are quantised without the rotation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from pan2cli.dit.fp8 import (
    E4M3_MAX,
    FP8,
    P_SHIFT,
    Fp8Activation,
    hadamard_matrix,
    hadamard_rotates,
    qk_bound,
    quantize_with_scales,
    smoothing_mean,
)
from pan2cli.dit.fp8_attention_choice import Fp8AttentionRun, fp8_attention_run
from pan2cli.dit.fusions import compute_dtype, qk_norm_rope, qk_norm_rope_reference


class Fp8AttentionScales(nn.Module):
    """How a block quantises Q and K: the transformations before the e4m3 cast, and the fixed scales that
    bound the transformed values (real value = e4m3 value · descale; `pan2cli.dit.fp8`), their product
    `qk_descale` (`[1]` float32) as the attention kernels take it.

    hadamard: Q and K rotated by H/√D after RoPE (False where `hadamard_rotates(head_dim)` is False).
    smooth_k: K's mean over every 4th joint token of its (batch, head) subtracted (`smoothing_mean`; K's bound
        doubled).

    A submodule of the `PAN2Attention` it belongs to, `qk_descale` a buffer (outside the state dict's keys), so
    that it goes wherever the block's other tensors go, with `.to()` and with the layer streamer
    (`pan2cli.pipeline.offload`), which moves parameters and buffers only: a plain tensor attribute stays where
    it was made, and one made from streamed weights is host memory that the kernels would read as a device
    address (an illegal memory access).
    """

    def __init__(
        self, q_descale: float, k_descale: float, *, hadamard: bool, smooth_k: bool, device=None
    ) -> None:
        super().__init__()
        self.q_descale, self.k_descale = q_descale, k_descale
        self.hadamard, self.smooth_k = hadamard, smooth_k
        product = torch.tensor([q_descale * k_descale], dtype=torch.float32, device=device)
        self.register_buffer("qk_descale", product, persistent=False)

    @classmethod
    def for_norm_weights(
        cls, head_dim: int, q_weights, k_weights, *, hadamard: bool = True, smooth_k: bool = True, device=None
    ) -> "Fp8AttentionScales":
        """From the RMSNorm weights of Q (video and text stream) and those of K, each a sequence of `[D]`."""
        q = qk_bound(head_dim, *q_weights) / E4M3_MAX
        k = qk_bound(head_dim, *k_weights, mean_subtracted=smooth_k) / E4M3_MAX
        rotates = hadamard and hadamard_rotates(head_dim)
        return cls(q, k, hadamard=rotates, smooth_k=smooth_k, device=device)

    @classmethod
    def for_attention(cls, attn, *, hadamard: bool = True, smooth_k: bool = True) -> "Fp8AttentionScales":
        """From a `PAN2Attention`'s Q/K RMSNorm weights (both streams), on their device."""
        return cls.for_norm_weights(
            attn.head_dim, (attn.norm_q.weight, attn.norm_added_q.weight),
            (attn.norm_k.weight, attn.norm_added_k.weight),
            hadamard=hadamard, smooth_k=smooth_k, device=attn.norm_q.weight.device,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return (
            f"q_descale={self.q_descale:.4g}, k_descale={self.k_descale:.4g}, hadamard={self.hadamard}, "
            f"smooth_k={self.smooth_k}"
        )


def quantize_qk(
    q_video, k_video, q_text, k_text, weights, cos, sin,
    *, eps: float, scales: Fp8AttentionScales, fused: bool,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The joint Q and K of a block in e4m3 (video tokens, then text): RMSNorm, RoPE on the video tokens, then
    `scales`' smoothing and rotation, then the fixed scales (module docstring).

    Args:
        q_video, k_video: `[B, N, H, D]`; q_text, k_text: `[B, L, H, D]` (the projections' outputs).
        weights: RMSNorm weights (q, k, q_text, k_text), each `[D]`.
        cos, sin: `[N, D/2]` RoPE tables.
        fused: the Triton kernel (`qk_norm_rope_kernel.py`), else its emulation (`quantize_qk_reference`).

    Returns:
        (q8, k8), each `[B, N + L, H, D]` float8_e4m3fn: real Q = q8 · q_descale (rotated), K likewise.
    """
    if not fused:
        return quantize_qk_reference(
            q_video, k_video, q_text, k_text, weights, cos, sin, eps=eps, scales=scales
        )
    return qk_norm_rope(
        q_video, k_video, weights[0], weights[1], cos, sin, q_text, k_text, weights[2], weights[3],
        eps=eps, fused=True, interleaved=True, out_dtype=FP8,
        q_out_mult=1 / scales.q_descale, k_out_mult=1 / scales.k_descale,
        hadamard=scales.hadamard, smooth_k=scales.smooth_k,
    )  # fmt: skip


def quantize_qk_reference(
    q_video, k_video, q_text, k_text, weights, cos, sin, *, eps: float, scales: Fp8AttentionScales
) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch emulation of the fused kernel's e4m3 Q and K (`quantize_qk`), step for step: RMSNorm and RoPE in
    float32 (float64 for float64 inputs), K's mean subtracted (`smoothing_mean`), the product with the fixed scale's
    inverse, with the rotation the operands rounded to float16 (as the kernel hands them to the tensor
    cores) and multiplied by the ±1 matrix in float32, then clamped to ±448 and rounded once to e4m3."""
    dtype = compute_dtype(q_video)
    # Up-cast inputs: no rounding to the projections' dtype between the norm and the e4m3 cast.
    q, k = qk_norm_rope_reference(
        q_video.to(dtype), k_video.to(dtype), weights[0], weights[1], cos, sin,
        q_text.to(dtype), k_text.to(dtype), weights[2], weights[3], eps, True,
    )  # fmt: skip
    if scales.smooth_k:
        k = k - smoothing_mean(k, q_video.shape[1])
    head_dim = q.shape[-1]
    outs = []
    for x, descale in ((q, scales.q_descale), (k, scales.k_descale)):
        if scales.hadamard:
            operand = (x * ((1 / descale) / math.sqrt(head_dim))).to(torch.float16).to(dtype)
            x = operand @ hadamard_matrix(head_dim, dtype, x.device)
        else:
            x = x * (1 / descale)
        outs.append(x.clamp(-E4M3_MAX, E4M3_MAX).to(FP8))
    return outs[0], outs[1]


def quantize_values_reference(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """V `[B, S, H, D]` in e4m3 with one descale per head from its absolute maximum (as `values_fp8`) →
    (v8 `[B, S, H, D]`, descale `[H]` float32; 1 for an all-zero head)."""
    v_descale = v.float().abs().amax(dim=(0, 1, 3)) / E4M3_MAX
    v_descale = torch.where(v_descale > 0, v_descale, torch.ones_like(v_descale))
    return quantize_with_scales(v, v_descale[None, None, :].expand(v.shape[:-1])), v_descale


def attention_reference(
    q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, qk_descale: float, v_descale: torch.Tensor
) -> torch.Tensor:
    """Emulation of `fp8_attention` on `[B, S, H, D]` e4m3 inputs (v8 not transposed) → `[B, S, H, D]` float32."""
    q, k, v = (t.float().transpose(1, 2) for t in (q8, k8, v8))  # [B, H, S, D]
    scores = (q @ k.transpose(-1, -2)) * (qk_descale / math.sqrt(q.shape[-1]))
    p = torch.exp(scores - scores.amax(dim=-1, keepdim=True))
    row_sum = p.sum(dim=-1, keepdim=True)
    p8 = (p * 2**P_SHIFT).to(FP8).float()
    out = (p8 @ v) / (row_sum * 2**P_SHIFT) * v_descale.float()[None, :, None, None]
    return out.transpose(1, 2)


def joint_attention_fp8(attn, x, ctx, cos: torch.Tensor, sin: torch.Tensor, fused: bool):
    """`PAN2Attention.forward` with fp8 Q/K/V and attention (module docstring) → (video out, text out)."""
    scales: Fp8AttentionScales = attn.fp8_scales
    run = fp8_attention_run(attn, (x.data if isinstance(x, Fp8Activation) else x).device)
    batch, n_video = x.shape[:2]
    n_text = ctx.shape[1]
    heads = (attn.heads, attn.head_dim)
    q_video, k_video = attn.to_q(x).view(batch, n_video, *heads), attn.to_k(x).view(batch, n_video, *heads)
    q_text, k_text = (
        attn.add_q_proj(ctx).view(batch, n_text, *heads),
        attn.add_k_proj(ctx).view(batch, n_text, *heads),
    )
    v_video, v_text = attn.to_v(x), attn.add_v_proj(ctx)
    weights = (attn.norm_q.weight, attn.norm_k.weight, attn.norm_added_q.weight, attn.norm_added_k.weight)
    q8, k8 = quantize_qk(
        q_video, k_video, q_text, k_text, weights, cos, sin, eps=attn.eps, scales=scales, fused=fused
    )
    if fused:
        out = _attend_fused(q8, k8, [v_video, v_text], scales.qk_descale, attn.heads, run)
        if isinstance(out, Fp8Activation):  # cuDNN's e4m3 output, one descale: to_out takes it as it is
            data = out.data.reshape(batch, n_video + n_text, -1)
            scale = out.scale.expand(batch, n_video + n_text)
            video = Fp8Activation(data[:, :n_video], scale[:, :n_video].contiguous())
            text = Fp8Activation(data[:, n_video:], scale[:, n_video:].contiguous())
            return attn.to_out[0](video), attn.to_add_out(text)
    else:
        v = torch.cat([v_video, v_text], dim=1).view(batch, n_video + n_text, *heads)
        v8, v_descale = quantize_values_reference(v)
        out = attention_reference(q8, k8, v8, scales.q_descale * scales.k_descale, v_descale).to(v.dtype)
        run.ran("emulation")
    out = out.reshape(batch, n_video + n_text, -1)
    return attn.to_out[0](out[:, :n_video]), attn.to_add_out(out[:, n_video:])


def _attend_fused(
    q8: torch.Tensor, k8: torch.Tensor, v_streams, qk_descale: torch.Tensor, heads: int, run: Fp8AttentionRun
):
    """The chosen kernel on e4m3 Q, K and V quantised for it (per head; per tensor for cuDNN); recorded in `run`."""
    from pan2cli.dit.fp8_values_kernel import transposed_values, values_fp8

    batch, n_tokens, _, head_dim = q8.shape
    kernel = run.choice.kernel
    if kernel == "cuda":
        from pan2cli.dit.cuda_fp8_attention import choose_instantiation, cuda_fp8_attention, values_for

        instantiation = choose_instantiation(torch.cuda.get_device_name(q8.device), n_tokens)
        v_t, v_descale, v_mean = values_for(instantiation, v_streams, heads)
        run.ran("cuda", instantiation)
        return cuda_fp8_attention(
            q8, k8, v_t, qk_descale, v_descale, instantiation=instantiation, v_mean=v_mean
        )
    if kernel == "cudnn":
        from pan2cli.dit.cudnn_fp8_attention import cudnn_fp8_attention

        v8 = torch.empty(batch, n_tokens, heads, head_dim, dtype=FP8, device=q8.device)
        v_descale = torch.empty(heads, dtype=torch.float32, device=q8.device)
        # cuDNN applies one V descale to every head: the heads' scales made equal (the largest).
        values_fp8(v_streams, heads, v8, v_descale, transposed=False, per_tensor=True)
        run.ran("cudnn")
        return Fp8Activation(*cudnn_fp8_attention(q8, k8, v8, qk_descale, v_descale))
    from pan2cli.dit.fp8_attention_kernel import fp8_attention

    v_t, v_descale, _ = transposed_values(v_streams, heads)
    run.ran("triton")
    return fp8_attention(q8, k8, v_t, qk_descale, v_descale)


def bf16_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA over `[B, S, H, D]` (the reference the fp8 attention is measured against) → `[B, S, H, D]`."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(
        1, 2
    )
