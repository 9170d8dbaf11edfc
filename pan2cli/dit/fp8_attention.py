"""The fp8 tier's joint attention: Q, K, V in e4m3 from the fused kernels, one fp8 attention, bf16 out.

`joint_attention_fp8(attn, x, ctx, cos, sin)` replaces the bf16 path of `PAN2Attention.forward` (not under
sequence parallelism, which keeps bf16 attention):

1. the q/k/v projections (fp8 GEMMs when the block is quantised);
2. `qk_norm_rope` writes the joint Q and K straight in e4m3 with fixed scales (`Fp8AttentionScales`: the
   RMSNorm bound of `pan2cli.dit.fp8.qk_bound`, per block and per tensor, the stream with the larger
   weights setting it);
3. `values_fp8` quantises V with one scale per head, transposed for the kernel;
4. the fp8 attention the run chose once (`fp8_attention_choice`: pan2's CUDA kernel on sm_90 GPUs with head
   dim 128, pan2's Triton kernel elsewhere, cuDNN's when asked for), each call recorded in the block's
   `Fp8AttentionRun` (what ran, for the sidecar); cuDNN's e4m3 output goes to `to_out` without another
   quantisation;
5. the output projections.

On the CPU (tests) the same steps run as PyTorch emulations (`attention_reference`, recorded as "emulation"):
Q, K, V rounded to e4m3 with the same scales, P rounded to e4m3 (times 2⁸) as the kernel rounds it, the rest
in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pan2cli.dit.fp8 import E4M3_MAX, FP8, P_SHIFT, Fp8Activation, qk_bound, quantize_with_scales
from pan2cli.dit.fp8_attention_choice import Fp8AttentionRun, fp8_attention_run
from pan2cli.dit.fusions import qk_norm_rope


@dataclass
class Fp8AttentionScales:
    """A block's fixed Q and K scales (real value = e4m3 value · descale) and their product on the device."""

    q_descale: float
    k_descale: float
    qk_descale: torch.Tensor  # [1] float32, q_descale · k_descale

    @classmethod
    def for_attention(cls, attn) -> "Fp8AttentionScales":
        """From a `PAN2Attention`'s Q/K RMSNorm weights (both streams)."""
        head_dim = attn.head_dim
        q = qk_bound(head_dim, attn.norm_q.weight, attn.norm_added_q.weight) / E4M3_MAX
        k = qk_bound(head_dim, attn.norm_k.weight, attn.norm_added_k.weight) / E4M3_MAX
        device = attn.norm_q.weight.device
        return cls(q, k, torch.tensor([q * k], dtype=torch.float32, device=device))


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
    if fused:
        q8, k8 = qk_norm_rope(
            q_video, k_video, weights[0], weights[1], cos, sin, q_text, k_text, weights[2], weights[3],
            eps=attn.eps, fused=True, interleaved=True,
            out_dtype=FP8, q_out_mult=1 / scales.q_descale, k_out_mult=1 / scales.k_descale,
        )  # fmt: skip
        out = _attend_fused(q8, k8, [v_video, v_text], scales.qk_descale, attn.heads, run)
        if isinstance(out, Fp8Activation):  # cuDNN's e4m3 output, one descale: to_out takes it as it is
            data = out.data.reshape(batch, n_video + n_text, -1)
            scale = out.scale.expand(batch, n_video + n_text)
            video = Fp8Activation(data[:, :n_video], scale[:, :n_video].contiguous())
            text = Fp8Activation(data[:, n_video:], scale[:, n_video:].contiguous())
            return attn.to_out[0](video), attn.to_add_out(text)
    else:
        q, k = qk_norm_rope(
            q_video, k_video, weights[0], weights[1], cos, sin, q_text, k_text, weights[2], weights[3],
            eps=attn.eps, fused=False, interleaved=True,
        )  # fmt: skip
        q8 = quantize_with_scales(q, torch.full(q.shape[:-1], scales.q_descale, device=q.device))
        k8 = quantize_with_scales(k, torch.full(k.shape[:-1], scales.k_descale, device=k.device))
        v = torch.cat([v_video, v_text], dim=1).view(batch, n_video + n_text, *heads)
        v_descale = v.float().abs().amax(dim=(0, 1, 3)) / E4M3_MAX
        v_descale = torch.where(v_descale > 0, v_descale, torch.ones_like(v_descale))
        v8 = quantize_with_scales(v, v_descale[None, None, :].expand(v.shape[:-1]))
        out = attention_reference(q8, k8, v8, scales.q_descale * scales.k_descale, v_descale).to(v.dtype)
        run.ran("emulation")
    out = out.reshape(batch, n_video + n_text, -1)
    return attn.to_out[0](out[:, :n_video]), attn.to_add_out(out[:, n_video:])


def _attend_fused(
    q8: torch.Tensor, k8: torch.Tensor, v_streams, qk_descale: torch.Tensor, heads: int, run: Fp8AttentionRun
):
    """The chosen kernel on e4m3 Q, K and V quantised for it (per head; per tensor for cuDNN); recorded in `run`."""
    from pan2cli.dit.fp8_values_kernel import values_fp8

    batch, n_tokens, _, head_dim = q8.shape
    v_descale = torch.empty(heads, dtype=torch.float32, device=q8.device)
    kernel = run.choice.kernel
    if kernel == "cudnn":
        from pan2cli.dit.cudnn_fp8_attention import cudnn_fp8_attention

        v8 = torch.empty(batch, n_tokens, heads, head_dim, dtype=FP8, device=q8.device)
        # cuDNN applies one V descale to every head: the heads' scales made equal (the largest).
        values_fp8(v_streams, heads, v8, v_descale, transposed=False, per_tensor=True)
        run.ran("cudnn")
        return Fp8Activation(*cudnn_fp8_attention(q8, k8, v8, qk_descale, v_descale))
    from pan2cli.dit.fp8_attention_kernel import fp8_attention, padded_keys

    v_t = torch.empty(batch, heads, head_dim, padded_keys(n_tokens), dtype=FP8, device=q8.device)
    if kernel == "cuda":
        from pan2cli.dit.cuda_fp8_attention import choose_instantiation, cuda_fp8_attention

        instantiation = choose_instantiation(torch.cuda.get_device_name(q8.device), n_tokens)
        values_fp8(v_streams, heads, v_t, v_descale, key_order=instantiation.v_key_order)
        run.ran("cuda", instantiation)
        return cuda_fp8_attention(q8, k8, v_t, qk_descale, v_descale, instantiation=instantiation)
    values_fp8(v_streams, heads, v_t, v_descale)
    run.ran("triton")
    return fp8_attention(q8, k8, v_t, qk_descale, v_descale)


def bf16_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA over `[B, S, H, D]` (the reference the fp8 attention is measured against) → `[B, S, H, D]`."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(
        1, 2
    )
