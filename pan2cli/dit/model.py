"""`PAN2Transformer3DModel`: the released PAN 2 MMDiT (IFM/PAN2, 29.2 B parameters), module for module.

Parameter names are the checkpoint's keys (diffusers names); `pan2cli.dit.checkpoint` holds the key table
and loads the model (`load_pan2_transformer`).
Source: vLLM-Omni's port of diffusers' model (vllm-project/vllm-omni
`vllm_omni/diffusion/models/pan2/pan2_transformer.py` @f1ef55bd, the same in IFM's fork MBZUAI-IFM/vllm-omni-pan2).
The forward pass:

1. `x_embedder`: Conv3d 97 → D (kernel = stride = patch (1, 2, 2)); tokens in (t, h, w) order. The 97
   channels are the noisy latents (48), the condition latents (48) and the condition mask (1).
2. `time_proj` (a 256-wide `[cos | sin]` sinusoid, no parameters) → `time_embedder` (Linear–SiLU–Linear)
   → `temb [B, D]`: one timestep (σ·1000) per sample.
3. Text: `context_embedder` (RMSNorm over the 4096 text features, then Linear) → `context_refiner`
   (text-only pre-norm blocks: bias-free self-attention with Q/K RMSNorm, SwiGLU FFN) → plus the learned
   `context_type_embedding`.
4. 44 dual-stream blocks over [video ; text]: video modulation from `norm1.linear(SiLU(temb))`
   (AdaLN-Zero: shift, scale, gate for attention, then for the MLP); text modulation from the block's
   static `scale_shift_table_context` (no timestep); per-stream q/k/v/out with bias, per-head Q/K
   RMSNorm on both streams, RoPE (interleaved pairs) on the video tokens only, one attention over the
   joint tokens (video first, no mask); GELU-tanh MLPs (8·D video, 4·D text); gated residuals.
5. `norm_out` (LayerNorm modulated by `(scale, shift) = norm_out.linear(SiLU(temb))`) → `proj_out` → 192
   features per token read as (channel, pt, ph, pw) → `[B, 48, T, H, W]`: the flow velocity.

Numerics: LayerNorm/RMSNorm statistics, modulation, RoPE tables and the timestep sinusoid are computed
in float32 (float64 when the model is float64: then *everything* is float64); projections and attention
run in the weights' dtype. The AdaLN linears (`norm1.linear`, `norm_out.linear`) are float32 in the
release, and `load_pan2_transformer` keeps them (and the modulation they compute) in float32 in a bf16 model:
17.7 GB instead of 8.9 GB of the 67.3 GB model, for an exact modulation (a bf16 AdaLN shifts the
modulation by up to 2⁻⁹ relative). Residual updates `x + gate·f(x)` are computed in float32 and
rounded once.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional

import torch
import torch.nn.functional as F
from torch import nn

from pan2cli.dit.config import PAN2TransformerConfig
from pan2cli.dit.fp8 import Fp8Activation, Fp8Linear, Fp8Product, quantize_rows
from pan2cli.dit.fusions import (
    compute_dtype,
    gated_residual,
    layer_norm_modulate,
    qk_norm_rope,
    rms_norm_reference,
    use_fused,
)
from pan2cli.dit.rope import rope_table
from pan2cli.errors import InputError

if TYPE_CHECKING:
    from pan2cli.dit.parallel import SequenceParallel

TIMESTEP_CHANNELS = 256  # width of the timestep sinusoid (diffusers `Timesteps(256, flip_sin_to_cos=True)`)


def timestep_embedding(
    timestep: torch.Tensor, dim: int, dtype: torch.dtype, max_period: float = 10000.0
) -> torch.Tensor:
    """Sinusoidal embedding `[cos(t·f_i) | sin(t·f_i)]`, f_i = exp(−ln(max_period)·i/(dim/2)), computed in `dtype`.

    Args:
        timestep: `[B]` values in [0, 1000].
        dim: even width.
        dtype: float32, or float64 for a float64 model.

    Returns:
        `[B, dim]` in `dtype`.
    """
    half = dim // 2
    exponent = -math.log(max_period) * torch.arange(half, dtype=dtype, device=timestep.device) / half
    angles = timestep.to(dtype)[:, None] * torch.exp(exponent)[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


class PAN2TimestepEmbedding(nn.Module):
    """`linear_2(SiLU(linear_1(sinusoid)))`: the timestep sinusoid → `temb [B, D]`."""

    def __init__(self, in_dim: int, dim: int):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, sinusoid: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(sinusoid)))


class PAN2RMSNorm(nn.Module):
    """RMSNorm with a learned scale: `x / sqrt(mean(x²) + eps) · weight`, computed in `compute_dtype(x)`."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_reference(x, self.weight, self.eps).to(x.dtype)


class _Projection(nn.Module):
    """`net.0` of a feed-forward: one Linear (`proj`) followed by the activation."""

    def __init__(self, dim: int, out: int, activation: str, bias: bool):
        super().__init__()
        self.proj = nn.Linear(dim, out, bias=bias)
        self.activation = activation
        self.fp8_output = False  # the fp8 tier: GELU and net.2's per-token quantisation in one pass

    def forward(self, x: torch.Tensor | Fp8Activation) -> torch.Tensor | Fp8Activation:
        x = self.proj(x)
        if self.activation == "swiglu":  # [value | gate]: value · SiLU(gate)
            value, gate = x.chunk(2, dim=-1)
            return value * F.silu(gate)
        if self.fp8_output:
            return quantize_rows(x, fused=use_fused(None, x), gelu=True)
        return F.gelu(x, approximate="tanh")


class PAN2FeedForward(nn.Module):
    """`net.2(act(net.0.proj(x)))`: GELU-tanh with bias (the blocks) or SwiGLU without bias (the refiner).

    `net.1` is an empty slot, so that the keys are diffusers' (`net.0.proj`, `net.2`).
    """

    def __init__(self, dim: int, inner_dim: int, activation: str = "gelu-tanh", bias: bool = True):
        super().__init__()
        proj_out = 2 * inner_dim if activation == "swiglu" else inner_dim
        self.net = nn.ModuleList(
            [
                _Projection(dim, proj_out, activation, bias),
                nn.Identity(),
                nn.Linear(inner_dim, dim, bias=bias),
            ]
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor | Fp8Product:
        """The MLP's output; in the fp8 tier (fc1's GELU handing fc2 e4m3 rows) fc2's unscaled product, which
        the block's gated residual scales (`pan2cli.dit.fp8.Fp8Linear.product`)."""
        x = self.net[1](self.net[0](x))
        fc2 = self.net[2]
        if isinstance(x, Fp8Activation) and isinstance(fc2, Fp8Linear):
            return fc2.product(x)
        return fc2(x)


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA over `[B, S, H, head_dim]` inputs (scale 1/√head_dim, no mask) → `[B, S, H·head_dim]`."""
    batch, seq = q.shape[:2]
    # SDPA wants [B, H, S, head_dim]; the transposed views need no copy for the flash/cuDNN kernels.
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).reshape(batch, seq, -1)


class PAN2RefinerAttention(nn.Module):
    """Text self-attention of the refiner: bias-free q/k/v/out, per-head Q/K RMSNorm, no RoPE, no mask."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.head_dim, self.eps = heads, head_dim, eps
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.norm_q = PAN2RMSNorm(head_dim, eps)
        self.norm_k = PAN2RMSNorm(head_dim, eps)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim, bias=False), nn.Identity()])
        self.fused_kernels: Optional[bool] = None  # see fusions.set_fused_kernels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, n_text, _ = x.shape
        heads = (self.heads, self.head_dim)
        q, k = qk_norm_rope(
            self.to_q(x).view(batch, n_text, *heads), self.to_k(x).view(batch, n_text, *heads),
            self.norm_q.weight, self.norm_k.weight, None, None,
            eps=self.eps, fused=use_fused(self.fused_kernels, x),
        )  # fmt: skip
        out = _attention(q, k, self.to_v(x).view(batch, n_text, *heads))
        return self.to_out[0](out)


class PAN2TokenRefinerBlock(nn.Module):
    """Pre-norm text block: `x + attn(RMSNorm(x))`, then `x + SwiGLU(RMSNorm(x))`."""

    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: float, eps: float):
        super().__init__()
        self.norm1 = PAN2RMSNorm(dim, eps)
        self.attn = PAN2RefinerAttention(dim, heads, head_dim, eps)
        self.norm2 = PAN2RMSNorm(dim, eps)
        self.ff = PAN2FeedForward(dim, int(dim * mlp_ratio), activation="swiglu", bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class PAN2AdaLayerNormZero(nn.Module):
    """`linear(SiLU(temb))` → six `[B, 1, D]` (shift, scale, gate for attention; shift, scale, gate for the MLP).

    Computed in the linear's dtype (float32 as released), never rounded to the activations' dtype.
    """

    def __init__(self, dim: int, chunks: int = 6):
        super().__init__()
        self.chunks = chunks
        self.linear = nn.Linear(dim, chunks * dim)

    def forward(self, temb: torch.Tensor) -> tuple[torch.Tensor, ...]:
        weight_dtype = self.linear.weight.dtype
        emb = self.linear(F.silu(temb.to(weight_dtype)))
        return emb[:, None, :].chunk(self.chunks, dim=-1)


class PAN2Attention(nn.Module):
    """Joint attention over [video ; text]: per-stream projections, Q/K RMSNorm, RoPE on video, one SDPA."""

    def __init__(self, dim: int, heads: int, head_dim: int, eps: float):
        super().__init__()
        self.heads, self.head_dim, self.eps = heads, head_dim, eps
        inner = heads * head_dim
        self.to_q, self.to_k, self.to_v = nn.Linear(dim, inner), nn.Linear(dim, inner), nn.Linear(dim, inner)
        self.norm_q, self.norm_k = PAN2RMSNorm(head_dim, eps), PAN2RMSNorm(head_dim, eps)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim), nn.Identity()])
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (
            nn.Linear(dim, inner),
            nn.Linear(dim, inner),
            nn.Linear(dim, inner),
        )
        self.norm_added_q, self.norm_added_k = PAN2RMSNorm(head_dim, eps), PAN2RMSNorm(head_dim, eps)
        self.to_add_out = nn.Linear(inner, dim)
        # Set by `pan2cli.dit.quantize` for fp8 attention: a submodule (`pan2cli.dit.fp8_attention.Fp8AttentionScales`),
        # and the kernel it runs with the record of its calls (`pan2cli.dit.fp8_attention_choice.use_fp8_attention`).
        self.fp8_scales: nn.Module | None = None
        self.fp8_attention = None

    def forward(
        self, x: torch.Tensor | Fp8Activation, ctx: torch.Tensor | Fp8Activation, cos: torch.Tensor,
        sin: torch.Tensor, fused: bool, sp: SequenceParallel | None = None, video_tokens: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """x `[B, N, D]` video, ctx `[B, L, D]` text, cos/sin `[N, head_dim/2]` → (video, text) outputs.

        With `sp`, x holds this rank's band of the `video_tokens` video tokens (cos/sin its rows) and the
        attention runs over all of them for this rank's heads (`pan2cli.dit.parallel`). x and ctx are
        `Fp8Activation`s in a block quantised to fp8 (`pan2cli.dit.quantize`).
        """
        if self.fp8_scales is not None and sp is None:
            from pan2cli.dit.fp8_attention import joint_attention_fp8

            return joint_attention_fp8(self, x, ctx, cos, sin, fused)
        batch, n_video = x.shape[:2]
        n_text = ctx.shape[1]
        heads = (self.heads, self.head_dim)
        q, k = qk_norm_rope(
            self.to_q(x).view(batch, n_video, *heads),
            self.to_k(x).view(batch, n_video, *heads),
            self.norm_q.weight,
            self.norm_k.weight,
            cos,
            sin,
            self.add_q_proj(ctx).view(batch, n_text, *heads),
            self.add_k_proj(ctx).view(batch, n_text, *heads),
            self.norm_added_q.weight,
            self.norm_added_k.weight,
            eps=self.eps,
            fused=fused,
            interleaved=True,
        )  # q, k: [B, N + L, H, head_dim]
        v = torch.cat([self.to_v(x), self.add_v_proj(ctx)], dim=1).view(batch, n_video + n_text, *heads)
        if sp is not None:
            return self._sequence_parallel(q, k, v, n_video, video_tokens, sp)
        out = _attention(q, k, v)
        return self.to_out[0](out[:, :n_video]), self.to_add_out(out[:, n_video:])

    def _sequence_parallel(self, q, k, v, n_video: int, video_tokens: int, sp: SequenceParallel):
        """The joint attention for this rank's heads over every video token (Ulysses all-to-all)."""
        batch, _, heads, head_dim = q.shape
        mine = heads // sp.world
        first = sp.rank * mine

        def all_tokens_my_heads(t: torch.Tensor) -> torch.Tensor:
            video = sp.video_to_heads(t[:, :n_video], video_tokens)
            return torch.cat([video, t[:, n_video:, first : first + mine]], dim=1)

        out = _attention(all_tokens_my_heads(q), all_tokens_my_heads(k), all_tokens_my_heads(v))
        out = out.view(batch, -1, mine, head_dim)
        video = sp.heads_to_video(out[:, :video_tokens]).reshape(batch, n_video, heads * head_dim)
        text = sp.gather_heads(out[:, video_tokens:]).reshape(batch, -1, heads * head_dim)
        return self.to_out[0](video), self.to_add_out(text)


class PAN2TransformerBlock(nn.Module):
    """Dual-stream block: modulated joint attention, then modulated MLPs, gated residuals (video AdaLN-Zero, text static table)."""

    def __init__(
        self, dim: int, heads: int, head_dim: int, mlp_ratio: float, context_mlp_ratio: float, eps: float
    ):
        super().__init__()
        self.eps = eps
        self.head_dim = head_dim
        self.norm1 = PAN2AdaLayerNormZero(dim)
        self.scale_shift_table_context = nn.Parameter(torch.zeros(6 * dim))
        self.attn = PAN2Attention(dim, heads, head_dim, eps)
        self.ff = PAN2FeedForward(dim, int(dim * mlp_ratio))
        self.ff_context = PAN2FeedForward(dim, int(dim * context_mlp_ratio))
        self.fused_kernels: Optional[bool] = None  # see fusions.set_fused_kernels
        self.fp8_activations = False  # set by `pan2cli.dit.quantize`: the norms hand the fp8 GEMMs e4m3 rows

    def forward(
        self, x: torch.Tensor | list[torch.Tensor], ctx: torch.Tensor | list[torch.Tensor], temb: torch.Tensor,
        cos: torch.Tensor, sin: torch.Tensor, sp: SequenceParallel | None = None, video_tokens: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor] | tuple[list[torch.Tensor], list[torch.Tensor]]:  # fmt: skip
        """x `[B, N, D]`, ctx `[B, L, D]`, temb `[B, D]`, cos/sin `[N, head_dim/2]` (with `sp`: this rank's band).

        x and ctx may be lists, one entry per pass (`PAN2Transformer3DModel.forward_passes`): each pass runs as a
        call of its own would, one after the other, inside one call of the block (the hooks of a block streamer
        then bring its weights to the device once for all of them); returns lists then. The lists are emptied
        as the passes go, so that a pass's input is freed once its output exists.
        """
        modulation = self.norm1(temb)  # the passes share the timestep: computed once for all of them
        if isinstance(x, list):
            outputs = []
            while x:
                outputs.append(self._one_pass(x.pop(0), ctx.pop(0), modulation, cos, sin, sp, video_tokens))
            return [out[0] for out in outputs], [out[1] for out in outputs]
        return self._one_pass(x, ctx, modulation, cos, sin, sp, video_tokens)

    def _one_pass(
        self, x: torch.Tensor, ctx: torch.Tensor, modulation: tuple[torch.Tensor, ...], cos: torch.Tensor,
        sin: torch.Tensor, sp: SequenceParallel | None, video_tokens: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        fused = use_fused(self.fused_kernels, x)
        shift1, scale1, gate1, shift2, scale2, gate2 = modulation  # each [B, 1, D], from `norm1(temb)`
        batch, dim = x.shape[0], x.shape[-1]
        # The text table is the same for every sample and step: [1, 1, D] views broadcast over the batch.
        c_shift1, c_scale1, c_gate1, c_shift2, c_scale2, c_gate2 = (
            t.view(1, 1, dim).expand(batch, 1, dim) for t in self.scale_shift_table_context.chunk(6)
        )

        q8 = self.fp8_activations
        attn, attn_ctx = self.attn(
            layer_norm_modulate(x, scale1, shift1, eps=self.eps, fused=fused, quantize=q8),
            layer_norm_modulate(ctx, c_scale1, c_shift1, eps=self.eps, fused=fused, quantize=q8),
            cos,
            sin,
            fused,
            sp,
            video_tokens,
        )
        x = gated_residual(x, attn, gate1, fused=fused)
        ctx = gated_residual(ctx, attn_ctx, c_gate1, fused=fused)

        x = gated_residual(
            x, self.ff(layer_norm_modulate(x, scale2, shift2, eps=self.eps, fused=fused, quantize=q8)), gate2,
            fused=fused,
        )  # fmt: skip
        ctx = gated_residual(
            ctx,
            self.ff_context(
                layer_norm_modulate(ctx, c_scale2, c_shift2, eps=self.eps, fused=fused, quantize=q8)
            ),
            c_gate2,
            fused=fused,
        )
        return x, ctx


class PAN2Transformer3DModel(nn.Module):
    """The PAN 2 MMDiT. Constructor arguments are the `transformer/config.json` keys; defaults are the release's.

    Args:
        patch_size (`tuple[int, int, int]`, defaults to (1, 2, 2)): (t, h, w) patch of the latents.
        in_channels (`int`, defaults to 97): noisy latents (48) + condition latents (48) + condition mask (1).
        out_channels (`int`, defaults to 48): the velocity's channels.
        num_attention_heads (`int`, defaults to 32), attention_head_dim (`int`, defaults to 128): D = 4096.
        num_layers (`int`, defaults to 44): dual-stream blocks.
        num_refiner_layers (`int`, defaults to 4): text refiner blocks.
        mlp_ratio (`float`, defaults to 8.0): video MLP width / D.
        context_mlp_ratio (`float`, defaults to 4.0): text MLP width / D.
        refiner_mlp_ratio (`float`, defaults to 4.0): refiner SwiGLU width / D.
        text_embed_dim (`int`, defaults to 4096): width of the text encoder's features (Qwen3.5-9B).
        rope_axes_dim (`tuple[int, int, int]`, defaults to (16, 56, 56)): head channels per (t, h, w) axis.
        rope_theta (`float`, defaults to 256.0): RoPE base.
        rope_temporal_scale (`float`, defaults to 16/24): factor on the frame positions.
        norm_eps (`float`, defaults to 1e-6): the blocks' LayerNorms and Q/K RMSNorms, and `norm_out`.
        text_norm_eps (`float`, defaults to 1e-5): the text embedder's and refiner's RMSNorms.
    """

    # Stored in float32 in the release and kept so by `load_pan2_transformer` (see the module docstring).
    keep_in_fp32_modules = ("norm1.linear", "norm_out.linear")

    def __init__(
        self,
        patch_size: tuple[int, int, int] = (1, 2, 2),
        in_channels: int = 97,
        out_channels: int = 48,
        num_attention_heads: int = 32,
        attention_head_dim: int = 128,
        num_layers: int = 44,
        num_refiner_layers: int = 4,
        mlp_ratio: float = 8.0,
        context_mlp_ratio: float = 4.0,
        refiner_mlp_ratio: float = 4.0,
        text_embed_dim: int = 4096,
        rope_axes_dim: tuple[int, int, int] = (16, 56, 56),
        rope_theta: float = 256.0,
        rope_temporal_scale: float = 16 / 24,
        norm_eps: float = 1e-6,
        text_norm_eps: float = 1e-5,
    ):
        super().__init__()
        self.config = config = PAN2TransformerConfig(
            patch_size=patch_size, in_channels=in_channels, out_channels=out_channels,
            num_attention_heads=num_attention_heads, attention_head_dim=attention_head_dim, num_layers=num_layers,
            num_refiner_layers=num_refiner_layers, mlp_ratio=mlp_ratio, context_mlp_ratio=context_mlp_ratio,
            refiner_mlp_ratio=refiner_mlp_ratio, text_embed_dim=text_embed_dim, rope_axes_dim=rope_axes_dim,
            rope_theta=rope_theta, rope_temporal_scale=rope_temporal_scale, norm_eps=norm_eps, text_norm_eps=text_norm_eps,
        )  # fmt: skip
        dim, heads, head_dim = config.inner_dim, num_attention_heads, attention_head_dim
        self.x_embedder = nn.Conv3d(in_channels, dim, kernel_size=config.patch_size, stride=config.patch_size)
        self.time_embedder = PAN2TimestepEmbedding(TIMESTEP_CHANNELS, dim)
        self.context_embedder = nn.Sequential(
            PAN2RMSNorm(text_embed_dim, text_norm_eps), nn.Linear(text_embed_dim, dim)
        )
        self.context_refiner = nn.ModuleList(
            PAN2TokenRefinerBlock(dim, heads, head_dim, refiner_mlp_ratio, text_norm_eps)
            for _ in range(num_refiner_layers)
        )
        self.context_type_embedding = nn.Parameter(torch.zeros(dim))
        self.transformer_blocks = nn.ModuleList(
            PAN2TransformerBlock(dim, heads, head_dim, mlp_ratio, context_mlp_ratio, norm_eps)
            for _ in range(num_layers)
        )
        self.norm_out = PAN2AdaLayerNormZero(dim, chunks=2)  # (scale, shift) on SiLU(temb)
        self.proj_out = nn.Linear(dim, config.patch_volume * out_channels)
        self.fused_kernels: Optional[bool] = None  # the final modulation; see fusions.set_fused_kernels
        self.precision = "bf16"  # "fp8" once `pan2cli.dit.quantize.quantize_transformer` has run
        self._rope_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        # Set (`pan2cli.dit.parallel.SequenceParallel`) to split each video's tokens over a process group.
        self.sequence_parallel: SequenceParallel | None = None

    # -- forward ---------------------------------------------------------------------------------
    def rope(
        self, grid: tuple[int, int, int], device: torch.device, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin table for a token grid, computed once per (grid, device, dtype) and kept (not in the state dict)."""
        key = (grid, str(device), dtype)
        if key not in self._rope_cache:
            cfg = self.config
            self._rope_cache[key] = rope_table(
                grid, cfg.rope_axes_dim, cfg.rope_theta, cfg.rope_temporal_scale, dtype=dtype, device=device
            )
        return self._rope_cache[key]

    def _check_inputs(
        self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor
    ) -> torch.Tensor:
        cfg = self.config
        if hidden_states.dim() != 5 or hidden_states.shape[1] != cfg.in_channels:
            raise InputError(
                f"hidden_states must be [B, {cfg.in_channels}, T, H, W], got {list(hidden_states.shape)}"
            )
        batch, _, frames, height, width = hidden_states.shape
        if any(size % patch for size, patch in zip((frames, height, width), cfg.patch_size)):
            raise InputError(
                f"latent T, H, W {frames, height, width} must be multiples of the patch size {cfg.patch_size}"
            )
        if (
            encoder_hidden_states.dim() != 3
            or encoder_hidden_states.shape[0] != batch
            or encoder_hidden_states.shape[2] != cfg.text_embed_dim
        ):
            raise InputError(
                f"encoder_hidden_states must be [{batch}, L, {cfg.text_embed_dim}], got {list(encoder_hidden_states.shape)}"
            )
        if encoder_hidden_states.shape[1] < 1:
            raise InputError("encoder_hidden_states has no tokens (an empty prompt is encoded as a space)")
        timestep = torch.as_tensor(timestep, device=hidden_states.device)
        if timestep.dim() == 0:
            timestep = timestep.expand(batch)
        if timestep.shape != (batch,):
            raise InputError(
                f"timestep must be [{batch}] (one σ·1000 per sample), got {list(timestep.shape)}"
            )
        return timestep

    def forward(
        self, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor
    ) -> torch.Tensor:
        """The flow velocity for noisy latents with their condition.

        Args:
            hidden_states: `[B, 97, T, H, W]` = [noisy latents ; condition latents ; mask], H and W even.
            timestep: `[B]` (σ·1000; a scalar is broadcast).
            encoder_hidden_states: `[B, L, text_embed_dim]` text features (valid tokens only: no mask).

        Returns:
            `[B, 48, T, H, W]` in the dtype of `proj_out`'s weights.

        Raises:
            InputError: shapes that do not fit the config.
        """
        (velocity,) = self.forward_passes(hidden_states, timestep, [encoder_hidden_states])
        return velocity

    def forward_passes(
        self, hidden_states: torch.Tensor, timestep: torch.Tensor, texts: list[torch.Tensor]
    ) -> list[torch.Tensor]:
        """`[forward(hidden_states, timestep, text) for text in texts]`, the same ops on the same tensors, but
        walking the blocks once: each block runs every pass in one call (classifier-free guidance's prompt and
        negative prompt), so that a streamed block crosses the bus once per step instead of once per pass
        (`pan2cli.pipeline.offload`). The patch embedding and the timestep's, which do not depend on the text,
        are computed once. Holds every pass's hidden states at once: one `[B, N + L, D]` more per extra pass.

        Args:
            hidden_states, timestep: as `forward`'s.
            texts: each pass's `encoder_hidden_states` (their lengths may differ: nothing is padded).

        Returns:
            Each pass's velocity, in the order of `texts`.
        """
        cfg = self.config
        if not texts:
            raise ValueError("forward_passes needs at least one text")
        timestep = [self._check_inputs(hidden_states, timestep, text) for text in texts][0]
        dtype = self.x_embedder.weight.dtype
        batch, _, frames, height, width = hidden_states.shape
        pt, ph, pw = cfg.patch_size
        grid = (frames // pt, height // ph, width // pw)

        # 1. patches → video tokens [B, N, D] in (t, h, w) order
        x = self.x_embedder(hidden_states.to(dtype)).flatten(2).transpose(1, 2).contiguous()
        # 2. timestep → temb [B, D]
        sinusoid = timestep_embedding(timestep, TIMESTEP_CHANNELS, compute_dtype(x))
        temb = self.time_embedder(sinusoid.to(dtype))
        # 3. text → [B, L, D], per pass
        contexts = []
        for text in texts:
            ctx = self.context_embedder(text.to(dtype))
            for block in self.context_refiner:
                ctx = block(ctx)
            contexts.append(ctx + self.context_type_embedding)
        # 4. blocks (under sequence parallelism: this rank's band of the tokens and of the RoPE table)
        cos, sin = self.rope(grid, x.device, compute_dtype(x))
        sp, video_tokens = self.sequence_parallel, x.shape[1]
        if sp is not None and sp.world > 1:
            sp.check_heads(cfg.num_attention_heads)
            start, stop = sp.band(video_tokens)
            x, cos, sin = x[:, start:stop], cos[start:stop], sin[start:stop]
        else:
            sp = None
        states, x = [x] * len(texts), None  # the blocks free each input once its output exists
        for block in self.transformer_blocks:
            states, contexts = block(states, contexts, temb, cos, sin, sp, video_tokens)
        # 5. final modulation (scale, shift) + projection, features read as (c, pt, ph, pw)
        return [self._velocity(x, temb, sp, video_tokens, grid, hidden_states.shape) for x in states]

    def _velocity(self, x, temb, sp, video_tokens: int, grid, shape) -> torch.Tensor:
        cfg = self.config
        batch, _, frames, height, width = shape
        pt, ph, pw = cfg.patch_size
        scale, shift = self.norm_out(temb)
        x = layer_norm_modulate(x, scale, shift, eps=cfg.norm_eps, fused=use_fused(self.fused_kernels, x))
        x = self.proj_out(x)
        if sp is not None:
            x = sp.gather_tokens(x, video_tokens)
        t, h, w = grid
        x = x.view(batch, t, h, w, cfg.out_channels, pt, ph, pw)
        return x.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(batch, cfg.out_channels, frames, height, width)
