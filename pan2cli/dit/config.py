"""`PAN2TransformerConfig`: the hyper-parameters of the released PAN 2 MMDiT, as its `transformer/config.json` names them.

The field names are the diffusers config keys of `IFM/PAN2` (`PAN2Transformer3DModel`); the defaults live
in the model's constructor (`pan2cli.dit.model`), which takes exactly these names. Sources for every value:
the constructor of vLLM-Omni's port of the diffusers model (vllm-project/vllm-omni
`vllm_omni/diffusion/models/pan2/pan2_transformer.py` @f1ef55bd), whose defaults reproduce the published
29.20 B parameters and every published file size (huggingface.co/IFM/PAN2).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from pan2cli.errors import CheckpointError

CLASS_NAME = "PAN2Transformer3DModel"
# Keys a diffusers config.json carries that describe no hyper-parameter.
BOOKKEEPING_KEYS = frozenset(
    {"_class_name", "_diffusers_version", "_name_or_path", "_commit_hash", "_use_default_values"}
)


@dataclass(frozen=True)
class PAN2TransformerConfig:
    """The constructor arguments of `PAN2Transformer3DModel`, checked; see the model for what each means."""

    patch_size: tuple[int, int, int]
    in_channels: int
    out_channels: int
    num_attention_heads: int
    attention_head_dim: int
    num_layers: int
    num_refiner_layers: int
    mlp_ratio: float
    context_mlp_ratio: float
    refiner_mlp_ratio: float
    text_embed_dim: int
    rope_axes_dim: tuple[int, int, int]
    rope_theta: float
    rope_temporal_scale: float
    norm_eps: float
    text_norm_eps: float

    def __post_init__(self) -> None:
        # JSON gives lists; keep tuples so the config stays hashable.
        for name in ("patch_size", "rope_axes_dim"):
            value = getattr(self, name)
            if not isinstance(value, (list, tuple)):
                raise CheckpointError(f"{name} must be a list of three whole numbers, got {value!r}")
            object.__setattr__(self, name, tuple(value))
        problems = []
        for name in (
            "in_channels",
            "out_channels",
            "num_attention_heads",
            "attention_head_dim",
            "num_layers",
            "text_embed_dim",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                problems.append(f"{name} must be a positive whole number, got {value!r}")
        if (
            isinstance(self.num_refiner_layers, bool)
            or not isinstance(self.num_refiner_layers, int)
            or self.num_refiner_layers < 0
        ):
            problems.append(f"num_refiner_layers must be a whole number ≥ 0, got {self.num_refiner_layers!r}")
        for name in (
            "mlp_ratio",
            "context_mlp_ratio",
            "refiner_mlp_ratio",
            "rope_theta",
            "rope_temporal_scale",
            "norm_eps",
            "text_norm_eps",
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                problems.append(f"{name} must be a positive number, got {value!r}")
        if len(self.patch_size) != 3 or any(
            isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in self.patch_size
        ):
            problems.append(
                f"patch_size must be three positive whole numbers (t, h, w), got {list(self.patch_size)}"
            )
        axes = self.rope_axes_dim
        if len(axes) != 3 or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 0 or d % 2 for d in axes
        ):
            problems.append(f"rope_axes_dim must be three even whole numbers (t, h, w), got {list(axes)}")
        elif isinstance(self.attention_head_dim, int) and sum(axes) != self.attention_head_dim:
            problems.append(
                f"rope_axes_dim {list(axes)} sums to {sum(axes)}, but attention_head_dim is {self.attention_head_dim}"
            )
        if problems:
            raise CheckpointError("; ".join(problems))

    # -- derived ---------------------------------------------------------------------------------
    @property
    def inner_dim(self) -> int:
        """Token width D of both streams: heads × head_dim (4096 in the release)."""
        return self.num_attention_heads * self.attention_head_dim

    @property
    def patch_volume(self) -> int:
        pt, ph, pw = self.patch_size
        return pt * ph * pw

    def to_dict(self) -> dict[str, Any]:
        """The `config.json` dict (with `_class_name`)."""
        out: dict[str, Any] = {"_class_name": CLASS_NAME}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out[field.name] = list(value) if isinstance(value, tuple) else value
        return out


def config_arguments(config: Mapping[str, Any], source: str = "config.json") -> dict[str, Any]:
    """The constructor arguments in a `config.json` dict: bookkeeping keys dropped, everything else checked.

    Missing keys take the constructor's defaults (the release's values).

    Raises:
        CheckpointError: another model class, or keys that are not PAN 2 config keys (named).
    """
    class_name = config.get("_class_name", CLASS_NAME)
    if class_name != CLASS_NAME:
        raise CheckpointError(
            f"{source} describes a {class_name}, not a {CLASS_NAME}",
            hint="transformer/ must hold the PAN 2 transformer (IFM/PAN2)",
        )
    fields = {field.name for field in dataclasses.fields(PAN2TransformerConfig)}
    unknown = sorted(set(config) - fields - BOOKKEEPING_KEYS)
    if unknown:
        raise CheckpointError(
            f"{source} has keys that are not {CLASS_NAME} config keys: {', '.join(unknown)}",
            hint=f"the known keys are {', '.join(sorted(fields))}",
        )
    return {key: value for key, value in config.items() if key in fields}
