"""`Qwen35TextModel`: the Qwen3.5 text model (PAN 2's text encoder), the layers PAN 2 reads, module for module.

Parameter names are transformers' (`Qwen3_5TextModel`), so a checkpoint loads as saved. Why not transformers'
class itself: importing its modelling code (torch.distributed.tensor, torch._dynamo, scipy...) took 7.4 s of
`pan2 generate`'s start on an H200 host, longer than reading both models' 83 GB; this file imports nothing but
torch. `tests/pipeline/test_qwen3_5.py` holds it to transformers' class in float64 (every hidden state) and
checks that both name and shape every tensor alike.

The model (a config such as Qwen3.5-9B: hidden 4096, 32 layers, three linear-attention layers per
full-attention one, `layer_types`):

- `embed_tokens`, then per layer: x += mixer(RMSNorm(x)); x += SwiGLU(RMSNorm(x)). The RMSNorms are
  zero-centred (`x̂ · (1 + w)`, statistics in float32).
- linear attention (`GatedDeltaNet`): one projection to q, k, v → a causal depthwise conv (kernel 4) + SiLU →
  q, k L2-normalised, q scaled by d_k^-½ → the gated delta rule (`pan2cli.text.gated_delta_rule`, float32)
  with β = σ(b), g = −exp(A_log) · softplus(a + dt_bias) → an RMSNorm gated by SiLU(z) per head → out_proj.
  Each key head serves `linear_num_value_heads / linear_num_key_heads` consecutive value heads.
- full attention (`GatedAttention`): q_proj gives per head the query and a gate; q, k zero-centred RMSNorm
  per head, RoPE on the first `partial_rotary_factor` of each head (rotate-half pairs), causal grouped-query
  attention, the output times σ(gate) → o_proj. Text-only positions make Qwen3.5's multimodal RoPE the
  plain one (its three position rows are equal).

Dtypes follow transformers' step for step (the norms and the rule in float32, rounded where it rounds), so
bf16 results differ from its class only by kernels' summation order. A float64 model computes everything in
float64 (transformers' class drops to float32 there): that is the tests' reference.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from pan2cli.errors import CheckpointError
from pan2cli.text.gated_delta_rule import gated_delta_rule

LINEAR_ATTENTION, FULL_ATTENTION = "linear_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Qwen35TextConfig:
    """The fields of a `qwen3_5_text` config.json that the model uses; defaults are transformers' (Qwen3.5-9B)."""

    vocab_size: int = 248320
    hidden_size: int = 4096
    intermediate_size: int = 12288
    num_hidden_layers: int = 32
    num_attention_heads: int = 16
    num_key_value_heads: int = 4
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    attention_bias: bool = False
    linear_conv_kernel_dim: int = 4
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    layer_types: tuple[str, ...] = ()
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any], source: str) -> "Qwen35TextConfig":
        """The config of a `qwen3_5_text` config.json's fields (or a multimodal one's `text_config`).

        Raises:
            CheckpointError: a field of the wrong type, an activation or RoPE kind this model does not
                implement, or inconsistent head counts (named).
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for name in fields:
            if (
                name in raw
                and raw[name] is not None
                and name not in ("layer_types", "rope_theta", "partial_rotary_factor")
            ):
                values[name] = raw[name]
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"{source}: hidden_act {raw['hidden_act']!r}; Qwen3.5 uses 'silu'")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        kind = rope.get("rope_type", rope.get("type", "default"))
        if kind != "default":
            raise CheckpointError(
                f"{source}: RoPE type {kind!r}; pan2 runs Qwen3.5's default RoPE (the released text encoder's)"
            )
        values["rope_theta"] = rope.get("rope_theta", raw.get("rope_theta", cls.rope_theta))
        values["partial_rotary_factor"] = rope.get(
            "partial_rotary_factor", raw.get("partial_rotary_factor", cls.partial_rotary_factor)
        )
        for name, value in values.items():
            wanted = {"int": int, "float": float, "bool": bool}[fields[name].type]
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            if (
                (wanted is bool) != isinstance(value, bool)
                or (wanted is not bool and not number)
                or (wanted is int and not float(value).is_integer())
            ):
                raise CheckpointError(f"{source}: {name} = {value!r} is not a {wanted.__name__}")
            values[name] = wanted(value)
        layers = values.get("num_hidden_layers", cls.num_hidden_layers)
        types = raw.get("layer_types")
        if types is None:  # transformers' rule: every `full_attention_interval`-th layer is full attention
            interval = raw.get("full_attention_interval", 4)
            types = [LINEAR_ATTENTION if (i + 1) % interval else FULL_ATTENTION for i in range(layers)]
        if len(types) != layers or set(types) - {LINEAR_ATTENTION, FULL_ATTENTION}:
            raise CheckpointError(
                f"{source}: layer_types must list {layers} of {LINEAR_ATTENTION!r} / {FULL_ATTENTION!r}, got {types!r}"
            )
        config = cls(**values, layer_types=tuple(types))
        if (
            config.num_attention_heads % config.num_key_value_heads
            or config.linear_num_value_heads % config.linear_num_key_heads
        ):
            raise CheckpointError(f"{source}: the query / value heads are not a multiple of the key heads")
        return config

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm with weight `1 + w` (w zero at init), statistics in float32, rounded once to the input's dtype."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _wide(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + _wide(self.weight))).type_as(x)


class GatedRMSNorm(nn.Module):
    """RMSNorm (weight w, one at init) of each value head, then times SiLU(gate) in float32."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = _wide(x)
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        return (h * F.silu(_wide(gate))).to(dtype)


def _wide(x: torch.Tensor) -> torch.Tensor:
    """`x` in the statistics' dtype: float32, or float64 for a float64 model."""
    return x if x.dtype == torch.float64 else x.float()


def _l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention mixer (module docstring)."""

    def __init__(self, config: Qwen35TextConfig):
        super().__init__()
        self.k_heads, self.v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.d_k, self.d_v = config.linear_key_head_dim, config.linear_value_head_dim
        self.key_dim, self.value_dim = self.k_heads * self.d_k, self.v_heads * self.d_v
        channels = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(
            channels, channels, config.linear_conv_kernel_dim, groups=channels, bias=False,
            padding=config.linear_conv_kernel_dim - 1,
        )  # fmt: skip
        self.dt_bias = nn.Parameter(torch.ones(self.v_heads))
        self.A_log = nn.Parameter(torch.zeros(self.v_heads))
        self.norm = GatedRMSNorm(self.d_v, config.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, config.hidden_size, bias=False)
        self.in_proj_qkv = nn.Linear(config.hidden_size, channels, bias=False)
        self.in_proj_z = nn.Linear(config.hidden_size, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(config.hidden_size, self.v_heads, bias=False)
        self.in_proj_a = nn.Linear(config.hidden_size, self.v_heads, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        weight = self.conv1d.weight
        mixed = F.conv1d(
            self.in_proj_qkv(x).transpose(1, 2).to(weight.dtype), weight, padding=weight.shape[-1] - 1,
            groups=weight.shape[0],
        )[..., :length]  # fmt: skip
        mixed = F.silu(mixed).to(x.dtype).transpose(1, 2)
        query, key, value = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        per_key = self.v_heads // self.k_heads  # consecutive value heads that share a key head
        query, key = (
            t.reshape(batch, length, self.k_heads, self.d_k).repeat_interleave(per_key, dim=2)
            for t in (query, key)
        )
        value = value.reshape(batch, length, self.v_heads, self.d_v)
        beta = self.in_proj_b(x).sigmoid()
        log_decay = -_wide(self.A_log).exp() * F.softplus(_wide(self.in_proj_a(x)) + self.dt_bias)

        query, key, value, beta, log_decay = (
            _wide(t.transpose(1, 2)).contiguous() for t in (query, key, value, beta, log_decay)
        )
        query = _l2_normalize(query) * self.d_k**-0.5
        out = gated_delta_rule(query, _l2_normalize(key), value, log_decay, beta)
        out = out.transpose(1, 2).to(x.dtype)  # [B, L, heads, d_v]
        z = self.in_proj_z(x).reshape(batch, length, self.v_heads, self.d_v)
        return self.out_proj(self.norm(out, z).reshape(batch, length, self.value_dim))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class GatedAttention(nn.Module):
    """Qwen3.5's full-attention mixer (module docstring)."""

    def __init__(self, config: Qwen35TextConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            config.num_attention_heads, config.num_key_value_heads, config.head_dim,
        )  # fmt: skip
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, 2 * self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rotated, passed = x[..., : cos.shape[-1]], x[..., cos.shape[-1] :]
        return torch.cat((rotated * cos + _rotate_half(rotated) * sin, passed), dim=-1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        query, gate = self.q_proj(x).view(batch, length, self.heads, 2 * self.head_dim).chunk(2, dim=-1)
        query = self.q_norm(query).transpose(1, 2)
        key = self.k_norm(self.k_proj(x).view(batch, length, self.kv_heads, self.head_dim)).transpose(1, 2)
        value = self.v_proj(x).view(batch, length, self.kv_heads, self.head_dim).transpose(1, 2)
        query, key = self._rope(query, cos, sin), self._rope(key, cos, sin)
        per_kv = self.heads // self.kv_heads  # consecutive query heads that share a key/value head
        key, value = key.repeat_interleave(per_kv, dim=1), value.repeat_interleave(per_kv, dim=1)
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=self.head_dim**-0.5)
        out = out.transpose(1, 2).reshape(batch, length, self.heads * self.head_dim)
        return self.o_proj(out * torch.sigmoid(gate.reshape(batch, length, -1)))


class SwiGLU(nn.Module):
    def __init__(self, config: Qwen35TextConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: Qwen35TextConfig, index: int):
        super().__init__()
        self.full_attention = config.layer_types[index] == FULL_ATTENTION
        if self.full_attention:
            self.self_attn = GatedAttention(config)
        else:
            self.linear_attn = GatedDeltaNet(config)
        self.mlp = SwiGLU(config)
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self.input_layernorm(x)
        x = x + (self.self_attn(h, cos, sin) if self.full_attention else self.linear_attn(h))
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen35TextModel(nn.Module):
    """The Qwen3.5 text model's first `layers` layers (all of them, and the final norm, by default).

    Args:
        config: the text config.
        layers: how many layers to build; PAN 2 reads the hidden state after all but the last two
            (transformers' `hidden_states[-3]`), so it builds only those and reads only their weights.
    """

    def __init__(self, config: Qwen35TextConfig, layers: int | None = None):
        super().__init__()
        layers = config.num_hidden_layers if layers is None else layers
        if not 0 <= layers <= config.num_hidden_layers:
            raise ValueError(f"layers must be in [0, {config.num_hidden_layers}], got {layers}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(layers))
        # The final norm belongs to the last layer's output only.
        self.norm = (
            ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
            if layers == config.num_hidden_layers
            else None
        )

    def _rope_tables(self, length: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin `[L, rotary_dim]` in `like`'s dtype; the frequencies on the CPU in float32 (float64 for a float64 model), as transformers."""
        dim, wide = self.config.rotary_dim, _wide(like).dtype
        inv_freq = 1.0 / (self.config.rope_theta ** (torch.arange(0, dim, 2, dtype=wide) / dim))
        positions = torch.arange(length, device=like.device, dtype=wide)
        angles = positions[:, None] * inv_freq.to(like.device)[None, :]
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos().to(like.dtype), angles.sin().to(like.dtype)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The hidden states `[B, L, hidden]` after the built layers (normed only when all are built)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self._rope_tables(input_ids.shape[1], x)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.norm(x) if self.norm is not None else x
