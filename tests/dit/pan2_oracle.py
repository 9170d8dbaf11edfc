"""An independent, readable reference of the PAN 2 transformer (test oracle only).

Written from the public sources (vLLM-Omni's port of diffusers' `PAN2Transformer3DModel`,
vllm-project/vllm-omni `vllm_omni/diffusion/models/pan2/pan2_transformer.py` @f1ef55bd; diffusers 0.42.1
building blocks). It shares no code with `pan2cli.dit`: diffusers' `TimestepEmbedding`, `AdaLayerNormZero`, `AdaLayerNormContinuous`,
`RMSNorm`, `FeedForward` and `get_1d_rotary_pos_embed` are used where they state the semantics exactly;
the pieces diffusers computes in float32 internally (RMSNorm variance, timestep sinusoid, RoPE positions)
are computed here in the model's dtype when that is float64 ("a float64 model computes everything in
float64"), and in float32 otherwise, as the reference does.

Module names are the checkpoint key names (§2.3), so `state_dict()` is a checkpoint.
"""

from __future__ import annotations

import math

import torch
from diffusers.models.attention import FeedForward
from diffusers.models.embeddings import TimestepEmbedding, get_1d_rotary_pos_embed
from diffusers.models.normalization import AdaLayerNormContinuous, AdaLayerNormZero
from diffusers.models.normalization import RMSNorm as DiffusersRMSNorm
from torch import nn

TIMESTEP_WIDTH = 256
BLOCK_EPS = 1e-6  # block LayerNorms, block Q/K RMSNorms, norm_out
TEXT_EPS = 1e-5  # context_embedder RMSNorm, refiner RMSNorms (incl. its q/k norms)


def stat_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype of internal statistics/tables: float64 for a float64 model, else float32 (the reference's)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


class RMSNorm(DiffusersRMSNorm):
    """diffusers RMSNorm (x·rsqrt(mean(x²)+eps)·w) whose variance is float64 for float64 inputs.

    diffusers computes the variance in float32 always; this is the only change.
    """

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        dt = stat_dtype(hidden_states.dtype)
        variance = hidden_states.to(dt).pow(2).mean(-1, keepdim=True)
        out = hidden_states * torch.rsqrt(variance + self.eps)
        if self.weight is not None:
            out = out * self.weight
        return out.to(hidden_states.dtype)


def timestep_sinusoid(timestep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Width-256 sinusoid, [cos | sin], frequency i = exp(-ln(10000)·i/128), no shift (diffusers Timesteps
    (256, flip_sin_to_cos=True, downscale_freq_shift=0)), in float64 for a float64 model."""
    dt = stat_dtype(dtype)
    half = TIMESTEP_WIDTH // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=dt, device=timestep.device) / half)
    args = timestep.to(dt)[:, None] * freqs[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1).to(dtype)


def rope_cos_sin(
    grid: tuple[int, int, int], axes_dim, theta: float, temporal_scale: float, dtype: torch.dtype, device
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of the per-token angles [N, sum(axes_dim)/2], tokens in (t, h, w) order, tables [t | h | w]."""
    dt = stat_dtype(dtype)
    axes = [torch.arange(n, dtype=dt, device=device) for n in grid]
    tt, hh, ww = torch.meshgrid(*axes, indexing="ij")
    positions = [tt.reshape(-1) * temporal_scale, hh.reshape(-1), ww.reshape(-1)]
    cos, sin = [], []
    for d, pos in zip(axes_dim, positions):
        cis = get_1d_rotary_pos_embed(d, pos, theta, use_real=False, freqs_dtype=dt)  # θ^(-2i/d)·pos
        cos.append(cis.real)
        sin.append(cis.imag)
    return torch.cat(cos, dim=1).to(dtype), torch.cat(sin, dim=1).to(dtype)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GPT-J rotation: channels (2i, 2i+1) rotate by angle i. x [B, N, H, Dh], cos/sin [N, Dh/2]."""
    pairs = x.unflatten(-1, (-1, 2))
    a, b = pairs[..., 0], pairs[..., 1]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Plain softmax attention, [B, S, H, Dh] in and out, scale 1/sqrt(Dh), no mask."""
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(q.shape[-1])
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(dim=-1), v)


class RefinerAttention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, heads * head_dim, bias=False)
        self.to_k = nn.Linear(dim, heads * head_dim, bias=False)
        self.to_v = nn.Linear(dim, heads * head_dim, bias=False)
        self.norm_q = RMSNorm(head_dim, eps=TEXT_EPS)
        self.norm_k = RMSNorm(head_dim, eps=TEXT_EPS)
        self.to_out = nn.ModuleList([nn.Linear(heads * head_dim, dim, bias=False)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.norm_q(self.to_q(x).unflatten(-1, (self.heads, -1)))
        k = self.norm_k(self.to_k(x).unflatten(-1, (self.heads, -1)))
        v = self.to_v(x).unflatten(-1, (self.heads, -1))
        return self.to_out[0](attention(q, k, v).flatten(2))


class RefinerBlock(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: float):
        super().__init__()
        self.norm1 = RMSNorm(dim, eps=TEXT_EPS)
        self.attn = RefinerAttention(dim, heads, head_dim)
        self.norm2 = RMSNorm(dim, eps=TEXT_EPS)
        # SwiGLU: proj D -> 2F split [value | gate], value * SiLU(gate), then F -> D; no biases.
        self.ff = FeedForward(dim, inner_dim=int(dim * mlp_ratio), activation_fn="swiglu", bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.ff(self.norm2(x))


class JointAttention(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int):
        super().__init__()
        self.heads = heads
        inner = heads * head_dim
        self.to_q = nn.Linear(dim, inner)
        self.to_k = nn.Linear(dim, inner)
        self.to_v = nn.Linear(dim, inner)
        self.add_q_proj = nn.Linear(dim, inner)
        self.add_k_proj = nn.Linear(dim, inner)
        self.add_v_proj = nn.Linear(dim, inner)
        self.norm_q = RMSNorm(head_dim, eps=BLOCK_EPS)
        self.norm_k = RMSNorm(head_dim, eps=BLOCK_EPS)
        self.norm_added_q = RMSNorm(head_dim, eps=BLOCK_EPS)
        self.norm_added_k = RMSNorm(head_dim, eps=BLOCK_EPS)
        self.to_out = nn.ModuleList([nn.Linear(inner, dim)])
        self.to_add_out = nn.Linear(inner, dim)

    def forward(self, x, ctx, cos, sin):
        split = lambda t: t.unflatten(-1, (self.heads, -1))  # noqa: E731
        # video: per-head RMSNorm, then RoPE (video only)
        q = apply_rope_interleaved(self.norm_q(split(self.to_q(x))), cos, sin)
        k = apply_rope_interleaved(self.norm_k(split(self.to_k(x))), cos, sin)
        v = split(self.to_v(x))
        # text: per-head RMSNorm, no RoPE
        cq = self.norm_added_q(split(self.add_q_proj(ctx)))
        ck = self.norm_added_k(split(self.add_k_proj(ctx)))
        cv = split(self.add_v_proj(ctx))
        # one attention over [video ; text]
        out = attention(torch.cat([q, cq], 1), torch.cat([k, ck], 1), torch.cat([v, cv], 1)).flatten(2)
        n = x.shape[1]
        return self.to_out[0](out[:, :n]), self.to_add_out(out[:, n:])


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, head_dim: int, mlp_ratio: float, context_mlp_ratio: float):
        super().__init__()
        # Linear D->6D on SiLU(temb) -> (shift, scale, gate) msa, (shift, scale, gate) mlp; LN eps 1e-6, no affine
        self.norm1 = AdaLayerNormZero(dim, norm_type="layer_norm")
        self.norm1_context = nn.LayerNorm(dim, elementwise_affine=False, eps=BLOCK_EPS)
        self.scale_shift_table_context = nn.Parameter(torch.zeros(6 * dim))
        self.attn = JointAttention(dim, heads, head_dim)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False, eps=BLOCK_EPS)
        self.norm2_context = nn.LayerNorm(dim, elementwise_affine=False, eps=BLOCK_EPS)
        self.ff = FeedForward(dim, inner_dim=int(dim * mlp_ratio), activation_fn="gelu-approximate")
        self.ff_context = FeedForward(
            dim, inner_dim=int(dim * context_mlp_ratio), activation_fn="gelu-approximate"
        )

    def forward(self, x, ctx, temb, cos, sin):
        assert self.norm1.norm.eps == BLOCK_EPS
        x_mod, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.norm1(x, emb=temb)
        c_shift, c_scale, c_gate, c_shift_mlp, c_scale_mlp, c_gate_mlp = self.scale_shift_table_context.chunk(
            6
        )
        ctx_mod = self.norm1_context(ctx) * (1 + c_scale) + c_shift

        a, ca = self.attn(x_mod, ctx_mod, cos, sin)
        x = x + gate_msa[:, None] * a
        ctx = ctx + c_gate * ca

        x = x + gate_mlp[:, None] * self.ff(self.norm2(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None])
        ctx = ctx + c_gate_mlp * self.ff_context(self.norm2_context(ctx) * (1 + c_scale_mlp) + c_shift_mlp)
        return x, ctx


class OraclePAN2(nn.Module):
    def __init__(
        self,
        patch_size=(1, 2, 2),
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
        rope_axes_dim=(16, 56, 56),
        rope_theta: float = 256.0,
        rope_temporal_scale: float = 16 / 24,
    ):
        super().__init__()
        assert sum(rope_axes_dim) == attention_head_dim and all(d % 2 == 0 for d in rope_axes_dim)
        self.patch_size = tuple(patch_size)
        self.out_channels = out_channels
        self.rope_axes_dim = tuple(rope_axes_dim)
        self.rope_theta = float(rope_theta)
        self.rope_temporal_scale = float(rope_temporal_scale)
        dim = num_attention_heads * attention_head_dim

        self.x_embedder = nn.Conv3d(in_channels, dim, kernel_size=self.patch_size, stride=self.patch_size)
        self.time_embedder = TimestepEmbedding(TIMESTEP_WIDTH, dim)  # linear_1, SiLU, linear_2
        self.context_embedder = nn.Sequential(
            RMSNorm(text_embed_dim, eps=TEXT_EPS), nn.Linear(text_embed_dim, dim)
        )
        self.context_refiner = nn.ModuleList(
            [
                RefinerBlock(dim, num_attention_heads, attention_head_dim, refiner_mlp_ratio)
                for _ in range(num_refiner_layers)
            ]
        )
        self.context_type_embedding = nn.Parameter(torch.zeros(dim))
        self.transformer_blocks = nn.ModuleList(
            [
                Block(dim, num_attention_heads, attention_head_dim, mlp_ratio, context_mlp_ratio)
                for _ in range(num_layers)
            ]
        )
        # Linear D->2D on SiLU(temb) -> (scale, shift), scale first; LN eps 1e-6, no affine
        self.norm_out = AdaLayerNormContinuous(dim, dim, elementwise_affine=False, eps=BLOCK_EPS)
        self.proj_out = nn.Linear(dim, math.prod(self.patch_size) * out_channels)

    def forward(self, hidden_states, timestep, encoder_hidden_states):
        dtype = self.x_embedder.weight.dtype
        hidden_states = hidden_states.to(dtype)
        encoder_hidden_states = encoder_hidden_states.to(dtype)
        B, _, T, H, W = hidden_states.shape
        pt, ph, pw = self.patch_size
        grid = (T // pt, H // ph, W // pw)

        # 1. patchify: tokens in (t, h, w) order
        x = self.x_embedder(hidden_states).flatten(2).transpose(1, 2)
        # 2. timestep
        temb = self.time_embedder(timestep_sinusoid(timestep, dtype))
        # 3. text path
        ctx = self.context_embedder(encoder_hidden_states)
        for block in self.context_refiner:
            ctx = block(ctx)
        ctx = ctx + self.context_type_embedding
        # 4. blocks (RoPE positions from 0, frame positions scaled)
        cos, sin = rope_cos_sin(
            grid, self.rope_axes_dim, self.rope_theta, self.rope_temporal_scale, dtype, hidden_states.device
        )
        for block in self.transformer_blocks:
            x, ctx = block(x, ctx, temb, cos, sin)
        # 5. final layer
        x = self.proj_out(self.norm_out(x, temb))
        # 6. unpatchify: token features read as (C, pt, ph, pw)
        x = x.reshape(B, *grid, self.out_channels, pt, ph, pw)
        x = x.permute(0, 4, 1, 5, 2, 6, 3, 7)
        return x.reshape(B, self.out_channels, grid[0] * pt, grid[1] * ph, grid[2] * pw)
