"""The fp8 tier's joint attention: Q, K, V in e4m3 from the fused kernels, one fp8 attention, bf16 out.

`joint_attention_fp8(attn, x, ctx, cos, sin)` replaces the bf16 path of `PAN2Attention.forward` (not under
sequence parallelism, which keeps bf16 attention):

1. the q/k/v projections (fp8 GEMMs when the block is quantised);
2. `qk_norm_rope` writes the joint Q and K straight in e4m3 with fixed scales (`Fp8AttentionScales`: the
   RMSNorm bound of `pan2cli.dit.fp8.qk_bound`, per block and per tensor, the stream with the larger
   weights setting it);
3. `values_fp8` quantises V with one scale per head, transposed for the kernel;
4. cuDNN's fp8 attention through cudnn-frontend (`cudnn_fp8_attention.py`; per-tensor V scale, e4m3 output
   that `to_out` takes without another quantisation): 14.1 ms at 121 frames on an H200 against 16.2 for our
   Triton kernel and 20.4 for cuDNN's bf16 (scripts/bench_kernels.py fp8-attention). Where cudnn-frontend is not
   installed, or cuDNN cannot build the graph on this GPU, our Triton kernel (`fp8_attention_kernel.py`;
   per-head V scale) runs instead, said once on stderr. `PAN2_FP8_ATTENTION=triton` (or `cudnn`) forces one;
   `PAN2_FP8_ATTENTION=cuda` runs our CUDA prototype for Hopper (`cuda_fp8_attention.py`: opt-in, not yet
   measured; head dim 128 only, the Triton kernel otherwise);
5. the output projections.

On the CPU (tests) the same steps run as PyTorch emulations (`attention_reference`): Q, K, V rounded to
e4m3 with the same scales, P rounded to e4m3 (times 2⁸) as the kernel rounds it, the rest in float32.
"""

from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from pan2cli.dit.fp8 import E4M3_MAX, FP8, P_SHIFT, Fp8Activation, qk_bound, quantize_with_scales
from pan2cli.dit.fusions import qk_norm_rope

# "cudnn", "triton" or "cuda" (the CUDA prototype); unset: cuDNN where it runs, else Triton
ENV_FP8_ATTENTION = "PAN2_FP8_ATTENTION"
_cudnn_failure: list[str] = []  # why cuDNN's fp8 attention did not run in this process (said once)


class Fp8AttentionScales(nn.Module):
    """A block's fixed Q and K scales (real value = e4m3 value · descale) and their product for the kernels.

    A submodule of the `PAN2Attention` it belongs to, its product `qk_descale` (`[1]` float32) a buffer (outside
    the state dict's keys), so that it goes wherever the block's other tensors go, with `.to()` and with the
    block streamer (`pan2cli.pipeline.offload`), which moves parameters and buffers only: a plain tensor
    attribute stays where it was made, and one made from streamed weights is host memory that the kernels
    would read as a device address (an illegal memory access).
    """

    def __init__(self, q_descale: float, k_descale: float, device: torch.device | str | None = None):
        super().__init__()
        self.q_descale, self.k_descale = q_descale, k_descale
        product = torch.tensor([q_descale * k_descale], dtype=torch.float32, device=device)
        self.register_buffer("qk_descale", product, persistent=False)

    @classmethod
    def for_attention(cls, attn) -> "Fp8AttentionScales":
        """From a `PAN2Attention`'s Q/K RMSNorm weights (both streams), on their device."""
        head_dim = attn.head_dim
        q = qk_bound(head_dim, attn.norm_q.weight, attn.norm_added_q.weight) / E4M3_MAX
        k = qk_bound(head_dim, attn.norm_k.weight, attn.norm_added_k.weight) / E4M3_MAX
        return cls(q, k, attn.norm_q.weight.device)

    def extra_repr(self) -> str:
        return f"q_descale={self.q_descale:.4g}, k_descale={self.k_descale:.4g}"


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


def fp8_attention_backend() -> tuple[str, str | None]:
    """(the fp8 attention that runs, why not cuDNN's or None): "cudnn", "triton" or "cuda" (`ENV_FP8_ATTENTION`)."""
    choice = os.environ.get(ENV_FP8_ATTENTION, "").strip().lower()
    if choice not in ("", "triton", "cudnn", "cuda"):
        from pan2cli.errors import InputError

        raise InputError(
            f"{ENV_FP8_ATTENTION}={choice!r} is not an fp8 attention",
            hint="use cudnn, triton or cuda (the CUDA prototype)",
        )
    if choice in ("triton", "cuda"):
        return choice, f"{ENV_FP8_ATTENTION}={choice}"
    if _cudnn_failure:
        return "triton", _cudnn_failure[0]
    try:
        import cudnn  # noqa: F401
    except ImportError:
        if choice == "cudnn":
            from pan2cli.dit.cudnn_fp8_attention import cudnn_frontend

            cudnn_frontend()  # raises the error that says how to install it
        return "triton", "cudnn-frontend is not installed (pip install 'pan2cli[fp8]')"
    return "cudnn", None


def joint_attention_fp8(attn, x, ctx, cos: torch.Tensor, sin: torch.Tensor, fused: bool):
    """`PAN2Attention.forward` with fp8 Q/K/V and attention (module docstring) → (video out, text out)."""
    scales: Fp8AttentionScales = attn.fp8_scales
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
        out = _attend_fused(q8, k8, [v_video, v_text], scales.qk_descale, attn.heads)
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
    out = out.reshape(batch, n_video + n_text, -1)
    return attn.to_out[0](out[:, :n_video]), attn.to_add_out(out[:, n_video:])


def _attend_fused(q8: torch.Tensor, k8: torch.Tensor, v_streams, qk_descale: torch.Tensor, heads: int):
    from pan2cli.dit.fp8_values_kernel import values_fp8

    batch, n_tokens, _, head_dim = q8.shape
    v_descale = torch.empty(heads, dtype=torch.float32, device=q8.device)
    backend, _ = fp8_attention_backend()
    if backend == "cudnn":
        from pan2cli.dit.cudnn_fp8_attention import cudnn_fp8_attention

        v8 = torch.empty(batch, n_tokens, heads, head_dim, dtype=FP8, device=q8.device)
        values_fp8(v_streams, heads, v8, v_descale, transposed=False, per_tensor=True)
        try:
            return Fp8Activation(*cudnn_fp8_attention(q8, k8, v8, qk_descale, v_descale))
        except Exception as error:  # cuDNN declined the graph on this GPU: the Triton kernel, said once
            if os.environ.get(ENV_FP8_ATTENTION, "").strip().lower() == "cudnn":
                raise
            first_line = str(error).splitlines()[0] if str(error) else type(error).__name__
            _cudnn_failure.append(f"cuDNN's fp8 attention does not run here ({first_line[:160]})")
            print(f"Note: {_cudnn_failure[0]}; using pan2's Triton fp8 attention.", file=sys.stderr)
    from pan2cli.dit.fp8_attention_kernel import fp8_attention, padded_keys

    v_t = torch.empty(batch, heads, head_dim, padded_keys(n_tokens), dtype=FP8, device=q8.device)
    # The CUDA prototype takes one head size, PAN 2's 128; other sizes run the Triton kernel.
    if backend == "cuda" and head_dim == 128:
        from pan2cli.dit.cuda_fp8_attention import DEFAULT_TMA, cuda_fp8_attention, v_key_order

        values_fp8(v_streams, heads, v_t, v_descale, key_order=v_key_order(DEFAULT_TMA))
        return cuda_fp8_attention(q8, k8, v_t, qk_descale, v_descale)
    values_fp8(v_streams, heads, v_t, v_descale)
    return fp8_attention(q8, k8, v_t, qk_descale, v_descale)


def bf16_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA over `[B, S, H, D]` (the reference the fp8 attention is measured against) → `[B, S, H, D]`."""
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(
        1, 2
    )
