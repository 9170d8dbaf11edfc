"""`PAN2TransformerConfig`: the hyper-parameters of the PAN 2-style MMDiT, read from its `config.json`.

PAN 2's exact layer layout is not public (docs/peers.md §1), so every size is a field here. The defaults
are the PAN 2-like shapes the fused kernels are benchmarked at (hidden 5120 = 40 heads × 128); the depth
(44) is inferred from the public int8 repack (528 large linears = 44 blocks × 2 streams × q, k, v, out,
fc1, fc2) and is a guess, as is the text width (Qwen3.5 hidden size 4096).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from pan2cli.errors import CheckpointError

CLASS_NAME = "PAN2Transformer3DModel"
# Keys a diffusers config.json carries that describe no hyper-parameter.
_IGNORED_CONFIG_KEYS = {"_class_name", "_diffusers_version", "_name_or_path"}


@dataclass(frozen=True)
class PAN2TransformerConfig:
    """Architecture of the PAN 2-style MMDiT.

    Args:
        hidden_size (`int`, defaults to 5120): token width `D` of both streams.
        num_attention_heads (`int`, defaults to 40): heads of the joint attention; head_dim = D / heads.
        num_layers (`int`, defaults to 44): dual-stream blocks.
        text_dim (`int`, defaults to 4096): width of the text encoder's hidden states.
        mlp_ratio (`float`, defaults to 4.0): MLP width = round(D · mlp_ratio).
        freq_dim (`int`, defaults to 256): width of the sinusoidal timestep embedding (even).
        rope_axes_dim (`tuple[int, int, int]`, defaults to (44, 42, 42)): head-dim channels rotated by
            the (t, h, w) position; even, summing to head_dim (Wan's split of 128).
        rope_theta (`float`, defaults to 10000.0): RoPE base.
        eps (`float`, defaults to 1e-6): epsilon of every LayerNorm and Q/K RMSNorm.
        patch_size (`tuple[int, int, int]`, defaults to (1, 2, 2)): (t, h, w) patch of the latents.
        in_channels / out_channels (`int`, defaults to 48): Wan2.2 VAE latent channels.
    """

    hidden_size: int = 5120
    num_attention_heads: int = 40
    num_layers: int = 44
    text_dim: int = 4096
    mlp_ratio: float = 4.0
    freq_dim: int = 256
    rope_axes_dim: tuple[int, ...] = (44, 42, 42)
    rope_theta: float = 10000.0
    eps: float = 1e-6
    patch_size: tuple[int, ...] = (1, 2, 2)
    in_channels: int = 48
    out_channels: int = 48

    def __post_init__(self) -> None:
        # JSON gives lists; keep tuples so the config stays hashable and frozen.
        for name in ("rope_axes_dim", "patch_size"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        for name in ("hidden_size", "num_attention_heads", "num_layers", "text_dim", "freq_dim", "in_channels", "out_channels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CheckpointError(f"{name} must be a positive whole number, got {value!r}")
        if self.hidden_size % self.num_attention_heads:
            raise CheckpointError(
                f"hidden_size={self.hidden_size} is not a multiple of num_attention_heads={self.num_attention_heads}"
            )
        if self.head_dim % 2 or self.freq_dim % 2:
            raise CheckpointError(f"head_dim ({self.head_dim}) and freq_dim ({self.freq_dim}) must be even")
        if len(self.rope_axes_dim) != 3 or any(d < 0 or d % 2 for d in self.rope_axes_dim):
            raise CheckpointError(f"rope_axes_dim must be three even numbers (t, h, w), got {list(self.rope_axes_dim)}")
        if sum(self.rope_axes_dim) != self.head_dim:
            raise CheckpointError(
                f"rope_axes_dim {list(self.rope_axes_dim)} sums to {sum(self.rope_axes_dim)}, expected head_dim {self.head_dim}"
            )
        if len(self.patch_size) != 3 or any(not isinstance(p, int) or p < 1 for p in self.patch_size):
            raise CheckpointError(f"patch_size must be three positive whole numbers (t, h, w), got {list(self.patch_size)}")
        if not self.mlp_ratio > 0 or not self.eps > 0 or not self.rope_theta > 0:
            raise CheckpointError("mlp_ratio, eps and rope_theta must be positive")

    # -- derived ---------------------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def ffn_dim(self) -> int:
        return round(self.hidden_size * self.mlp_ratio)

    @property
    def patch_volume(self) -> int:
        pt, ph, pw = self.patch_size
        return pt * ph * pw

    # -- (de)serialisation -----------------------------------------------------------------------
    @classmethod
    def from_config_dict(cls, config: Mapping[str, Any], source: str = "config.json") -> "PAN2TransformerConfig":
        """Build from a `config.json` dict; unknown keys are an error naming them and the valid ones.

        Raises:
            CheckpointError: another model class, unknown keys, or invalid values.
        """
        class_name = config.get("_class_name", CLASS_NAME)
        if class_name != CLASS_NAME:
            raise CheckpointError(f"{source} describes a {class_name}, not a {CLASS_NAME}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(config) - fields - _IGNORED_CONFIG_KEYS)
        if unknown:
            raise CheckpointError(
                f"{source} has unknown keys: {', '.join(unknown)}", hint=f"valid keys: {', '.join(sorted(fields))}"
            )
        try:
            return cls(**{k: v for k, v in config.items() if k in fields})
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"{source} could not be read as a {CLASS_NAME} config: {exc}") from exc

    def to_config_dict(self) -> dict[str, Any]:
        """The `config.json` dict (with `_class_name`)."""
        out: dict[str, Any] = {"_class_name": CLASS_NAME}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def replace(self, **changes: Any) -> "PAN2TransformerConfig":
        return dataclasses.replace(self, **changes)
