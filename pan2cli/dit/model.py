"""The PAN 2-style MMDiT: patch embedding, timestep/text embedding, dual-stream joint-attention blocks, AdaLN out.

Shapes: latents `[B, 48, T, H, W]` → video tokens `[B, N, D]`, N = T·(H/2)·(W/2) in (t, h, w) order; text
`[B, L, text_dim]` → `[B, L, D]`. Each block keeps separate weights for the two streams (AdaLN table,
q/k/v, Q/K RMSNorm, output projection, MLP) and runs one attention over the `N + L` joint tokens (video
first). Modulation follows Wan2.2: one shared projection of the timestep embedding to 6·D, plus a learnt
`[1, 6, D]` table per block and stream, in the order (shift, scale, gate) for attention then for the MLP.

Timesteps: `[B]` (one per sample), `[B, T]` (one per latent frame: image-to-video passes the clean
start frame with timestep 0) or `[B, N]` (one per video token). Modulation is computed per group of
consecutive tokens (G = 1, T or N) and never expanded to tokens unless G = N. The text stream is
modulated per sample with the largest of the sample's timesteps (the noise level of the generated frames).

The parameter names are the checkpoint keys (listed in `pan2cli.dit.checkpoint`). Numerics: LayerNorm,
RMSNorm, RoPE and the modulation table sum in float32; projections and attention in the weights' dtype.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pan2cli.dit.config import PAN2TransformerConfig
from pan2cli.dit.fusions import layer_norm_modulate, qk_norm_rope, use_fused
from pan2cli.dit.rope import rope_table
from pan2cli.errors import InputError


def timestep_embedding(timestep: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """Sinusoidal embedding `[cos(t·f), sin(t·f)]`, f = max_period^(−i/(dim/2)), in float32.

    Args:
        timestep: any shape, values in [0, 1000].
        dim: even embedding width.

    Returns:
        `timestep.shape + (dim,)` float32.
    """
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=timestep.device) / half)
    angles = timestep.float()[..., None] * freqs
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def _grouped(x: torch.Tensor, groups: int) -> torch.Tensor:
    """`[B, N, D]` → `[B, G, N/G, D]` view (tokens of a modulation group together)."""
    batch, n_tokens, dim = x.shape
    return x.view(batch, groups, n_tokens // groups, dim)


class PAN2MLP(nn.Module):
    """`fc2(GELU_tanh(fc1(x)))`."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class PAN2EmbedMLP(nn.Module):
    """`linear_2(act(linear_1(x)))`: the timestep (SiLU) and text (GELU tanh) embedders."""

    def __init__(self, in_dim: int, dim: int, act: str):
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear_1(x)
        x = F.silu(x) if self.act == "silu" else F.gelu(x, approximate="tanh")
        return self.linear_2(x)


class PAN2ConditionEmbedder(nn.Module):
    """Timestep → `temb` `[…, D]` and its modulation projection `[…, 6D]`; text → `[B, L, D]`."""

    def __init__(self, config: PAN2TransformerConfig):
        super().__init__()
        dim = config.hidden_size
        self.freq_dim = config.freq_dim
        self.time_embedder = PAN2EmbedMLP(config.freq_dim, dim, "silu")
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embedder = PAN2EmbedMLP(config.text_dim, dim, "gelu")

    def forward(self, timestep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """timestep `[B, G]` → (temb `[B, G, D]`, modulation `[B, G, 6D]`), dtype of the weights."""
        dtype = self.time_embedder.linear_1.weight.dtype
        temb = self.time_embedder(timestep_embedding(timestep, self.freq_dim).to(dtype))
        return temb, self.time_proj(F.silu(temb))


class PAN2JointAttention(nn.Module):
    """q/k/v per stream, Q/K RMSNorm per head (+ RoPE on video), one SDPA over video + text tokens."""

    def __init__(self, config: PAN2TransformerConfig):
        super().__init__()
        dim, self.heads, self.head_dim, self.eps = config.hidden_size, config.num_attention_heads, config.head_dim, config.eps
        self.to_q, self.to_k, self.to_v, self.to_out = (nn.Linear(dim, dim) for _ in range(4))
        self.add_q_proj, self.add_k_proj, self.add_v_proj, self.to_add_out = (nn.Linear(dim, dim) for _ in range(4))
        for name in ("norm_q", "norm_k", "norm_added_q", "norm_added_k"):
            setattr(self, name, nn.RMSNorm(self.head_dim, eps=config.eps))

    def forward(
        self, x: torch.Tensor, ctx: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fused: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[B, N, D]` video, ctx `[B, L, D]` text, cos/sin `[N, head_dim/2]` → (video, text) outputs."""
        batch, n_video, _ = x.shape
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
        )  # q, k: [B, N + L, H, head_dim]
        v = torch.cat([self.to_v(x), self.add_v_proj(ctx)], dim=1).view(batch, n_video + n_text, *heads)
        # SDPA wants [B, H, S, head_dim]; the transposed views need no copy for the flash/cuDNN kernels.
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        out = out.transpose(1, 2).reshape(batch, n_video + n_text, -1)
        return self.to_out(out[:, :n_video]), self.to_add_out(out[:, n_video:])


class PAN2TransformerBlock(nn.Module):
    """Dual-stream block: AdaLN-modulated joint attention, then AdaLN-modulated MLP, gated residuals."""

    def __init__(self, config: PAN2TransformerConfig):
        super().__init__()
        dim = config.hidden_size
        self.eps = config.eps
        self.head_dim = config.head_dim
        self.scale_shift_table = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)
        self.scale_shift_table_context = nn.Parameter(torch.randn(1, 6, dim) / dim**0.5)
        self.attn = PAN2JointAttention(config)
        self.ffn = PAN2MLP(dim, config.ffn_dim)
        self.ffn_context = PAN2MLP(dim, config.ffn_dim)
        self.fused_kernels: Optional[bool] = None  # see fusions.set_fused_kernels

    @staticmethod
    def _modulation(table: torch.Tensor, proj: torch.Tensor, dtype: torch.dtype) -> list[torch.Tensor]:
        """table `[1, 6, D]` + proj `[B, G, 6D]` summed in float32 → six `[B, G, D]` in `dtype`."""
        batch, groups, _ = proj.shape
        mod = (table.float()[:, None] + proj.float().view(batch, groups, 6, -1)).to(dtype)
        return list(mod.unbind(dim=2))

    def forward(
        self,
        x: torch.Tensor,
        ctx: torch.Tensor,
        proj: torch.Tensor,
        proj_ctx: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[B, N, D]`, ctx `[B, L, D]`, proj `[B, G, 6D]`, proj_ctx `[B, 1, 6D]`, cos/sin `[N, head_dim/2]`."""
        fused = use_fused(self.fused_kernels, x)
        shift1, scale1, gate1, shift2, scale2, gate2 = self._modulation(self.scale_shift_table, proj, x.dtype)
        c_shift1, c_scale1, c_gate1, c_shift2, c_scale2, c_gate2 = self._modulation(
            self.scale_shift_table_context, proj_ctx, ctx.dtype
        )
        groups = proj.shape[1]

        # attention
        attn, attn_ctx = self.attn(
            layer_norm_modulate(x, scale1, shift1, eps=self.eps, fused=fused),
            layer_norm_modulate(ctx, c_scale1, c_shift1, eps=self.eps, fused=fused),
            cos,
            sin,
            fused,
        )
        x = (_grouped(x, groups) + gate1[:, :, None] * _grouped(attn, groups)).flatten(1, 2)
        ctx = ctx + c_gate1 * attn_ctx

        # MLP
        mlp = self.ffn(layer_norm_modulate(x, scale2, shift2, eps=self.eps, fused=fused))
        x = (_grouped(x, groups) + gate2[:, :, None] * _grouped(mlp, groups)).flatten(1, 2)
        ctx = ctx + c_gate2 * self.ffn_context(layer_norm_modulate(ctx, c_scale2, c_shift2, eps=self.eps, fused=fused))
        return x, ctx


class PAN2Transformer3DModel(nn.Module):
    """The MMDiT: `forward(latents, timestep, text)` → the flow-matching prediction, shaped like the latents."""

    def __init__(self, config: PAN2TransformerConfig):
        super().__init__()
        self.config = config
        dim = config.hidden_size
        self.patch_embedding = nn.Conv3d(config.in_channels, dim, kernel_size=config.patch_size, stride=config.patch_size)
        self.condition_embedder = PAN2ConditionEmbedder(config)
        self.blocks = nn.ModuleList(PAN2TransformerBlock(config) for _ in range(config.num_layers))
        self.scale_shift_table = nn.Parameter(torch.randn(1, 2, dim) / dim**0.5)
        self.proj_out = nn.Linear(dim, config.out_channels * config.patch_volume)
        self.fused_kernels: Optional[bool] = None  # the final AdaLN; see fusions.set_fused_kernels
        self._rope_cache: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def rope(self, grid: tuple[int, int, int], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos/sin table for a token grid, computed once per (grid, device) and kept (not in the state dict)."""
        key = (grid, str(device))
        if key not in self._rope_cache:
            self._rope_cache[key] = rope_table(grid, self.config.rope_axes_dim, self.config.rope_theta, device)
        return self._rope_cache[key]

    def _timestep_groups(self, timestep: torch.Tensor, batch: int, grid: tuple[int, int, int]) -> torch.Tensor:
        """Check the timestep's shape and return it as `[B, G]` (G = 1, latent frames or tokens)."""
        t, h, w = grid
        frames = t * self.config.patch_size[0]
        if timestep.dim() == 0:
            timestep = timestep.expand(batch)
        if timestep.dim() == 1 and timestep.shape[0] == batch:
            return timestep[:, None]
        if timestep.dim() == 2 and timestep.shape[0] == batch:
            if timestep.shape[1] == frames:
                # one timestep per latent frame; a temporal patch takes its first frame's timestep
                return timestep[:, :: self.config.patch_size[0]]
            if timestep.shape[1] == t * h * w:
                return timestep
        raise InputError(
            f"timestep has shape {list(timestep.shape)}; expected [{batch}] (per sample), "
            f"[{batch}, {frames}] (per latent frame) or [{batch}, {t * h * w}] (per token)"
        )

    def forward(
        self, latents: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor
    ) -> torch.Tensor:
        """Predict the flow for noisy latents.

        Args:
            latents: `[B, in_channels, T, H, W]`, H and W multiples of the patch size (2).
            timestep: `[B]`, `[B, T]` or `[B, N]` (N video tokens), values in [0, 1000].
            encoder_hidden_states: `[B, L, text_dim]` text-encoder states (only valid tokens: no mask).

        Returns:
            `[B, out_channels, T, H, W]` in the weights' dtype.

        Raises:
            InputError: shapes that do not fit the config.
        """
        cfg = self.config
        dtype = self.patch_embedding.weight.dtype
        if latents.dim() != 5 or latents.shape[1] != cfg.in_channels:
            raise InputError(f"latents must be [B, {cfg.in_channels}, T, H, W], got {list(latents.shape)}")
        batch, _, frames, height, width = latents.shape
        pt, ph, pw = cfg.patch_size
        if frames % pt or height % ph or width % pw:
            raise InputError(f"latent T, H, W {frames, height, width} must be multiples of the patch size {cfg.patch_size}")
        if encoder_hidden_states.dim() != 3 or encoder_hidden_states.shape[0] != batch or encoder_hidden_states.shape[2] != cfg.text_dim:
            raise InputError(
                f"encoder_hidden_states must be [{batch}, L, {cfg.text_dim}], got {list(encoder_hidden_states.shape)}"
            )
        grid = (frames // pt, height // ph, width // pw)
        timestep = self._timestep_groups(timestep, batch, grid)  # [B, G]

        # patches → tokens [B, N, D] in (t, h, w) order
        x = self.patch_embedding(latents.to(dtype)).flatten(2).transpose(1, 2).contiguous()
        temb, proj = self.condition_embedder(timestep)  # [B, G, D], [B, G, 6D]
        _, proj_ctx = self.condition_embedder(timestep.amax(dim=1, keepdim=True))  # [B, 1, 6D]
        ctx = self.condition_embedder.text_embedder(encoder_hidden_states.to(dtype))
        cos, sin = self.rope(grid, x.device)
        for block in self.blocks:
            x, ctx = block(x, ctx, proj, proj_ctx, cos, sin)

        # final AdaLN (shift, scale) + projection
        shift, scale = (self.scale_shift_table.float()[:, None] + temb.float()[:, :, None]).to(dtype).unbind(dim=2)
        x = layer_norm_modulate(x, scale, shift, eps=cfg.eps, fused=use_fused(self.fused_kernels, x))
        x = self.proj_out(x)  # [B, N, pt·ph·pw·C_out], features in (pt, ph, pw, c) order
        t, h, w = grid
        x = x.view(batch, t, h, w, pt, ph, pw, cfg.out_channels)
        return x.permute(0, 7, 1, 4, 2, 5, 3, 6).reshape(batch, cfg.out_channels, frames, height, width)
