"""`WanVAEConfig`: the Wan2.2 (TI2V-5B) VAE architecture (run-time options live in `pan2cli.config.RuntimeConfig`).

Field names equal the keys of diffusers' `vae/config.json` (misspellings such as `temperal_downsample`
included), so a config file maps onto this class one to one.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping

from pan2cli.constants import LATENT_CHANNELS, VAE_SPATIAL_FACTOR, VAE_TEMPORAL_FACTOR
from pan2cli.errors import CheckpointError

# Per-channel statistics of the Wan2.2 latent space (docs: wan22_vae.md §6). The DiT produces
# normalised latents; the decoder wants `z * std + mean`.
WAN22_LATENTS_MEAN = (
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542, 0.2813, 0.0891,
    0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723,
    -0.2839, -0.2083, -0.0520, 0.3748, 0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
)  # fmt: skip
WAN22_LATENTS_STD = (
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894, 1.0901,
    0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709, 0.6065, 0.6415, 0.4944,
    0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
)  # fmt: skip

# Keys of a diffusers config.json that describe the architecture (read), and keys that carry no
# meaning for us (ignored). Anything else is reported as unknown.
_IGNORED_CONFIG_KEYS = {"_class_name", "_diffusers_version", "_name_or_path", "clip_output"}
# The VAE `pan2 decode` loads when --vae is not given (here, not in checkpoint.py: the CLI names it without torch).
DEFAULT_VAE_REPO = "Wan-AI/Wan2.2-TI2V-5B-Diffusers"


@dataclass(frozen=True)
class WanVAEConfig:
    """Architecture of the Wan2.2 VAE.

    Args:
        base_dim (`int`, defaults to 160): encoder width (not used by the decoder).
        decoder_base_dim (`int`, defaults to 256): decoder width unit `d`; stage widths are
            `d * [dim_mult[-1]] + d * dim_mult[::-1]` = [1024, 1024, 1024, 512, 256] for TI2V-5B.
        z_dim (`int`, defaults to 48): latent channels.
        dim_mult (`tuple[int]`, defaults to (1, 2, 4, 4)): width multipliers.
        num_res_blocks (`int`, defaults to 2): the decoder runs `num_res_blocks + 1` residual blocks per up-block.
        attn_scales (`tuple`, defaults to ()): must be empty (Wan2.2 has only the mid-block attention).
        temperal_downsample (`tuple[bool]`, defaults to (False, True, True)): reversed, the decoder's
            temporal upsampling flags.
        is_residual (`bool`, defaults to True): Wan2.2 residual up-blocks (Wan2.1 VAEs are not supported).
        in_channels / out_channels (`int`, defaults to 12): 3 colour channels times patch_size².
        patch_size (`int`, defaults to 2): unpatchify factor after the decoder.
        scale_factor_spatial / scale_factor_temporal (`int`, defaults to 16 / 4).
        dropout (`float`, defaults to 0.0): unused at inference.
        latents_mean / latents_std (`tuple[float]`, 48 values): latent normalisation statistics.
    """

    base_dim: int = 160
    decoder_base_dim: int = 256
    z_dim: int = LATENT_CHANNELS
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    attn_scales: tuple[float, ...] = ()
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    is_residual: bool = True
    in_channels: int = 12
    out_channels: int = 12
    patch_size: int = 2
    scale_factor_spatial: int = VAE_SPATIAL_FACTOR
    scale_factor_temporal: int = VAE_TEMPORAL_FACTOR
    dropout: float = 0.0
    latents_mean: tuple[float, ...] = WAN22_LATENTS_MEAN
    latents_std: tuple[float, ...] = WAN22_LATENTS_STD

    def __post_init__(self) -> None:
        # Normalise lists from JSON into tuples so the config stays hashable and frozen.
        for name in ("dim_mult", "attn_scales", "temperal_downsample", "latents_mean", "latents_std"):
            object.__setattr__(self, name, tuple(getattr(self, name)))
        if not self.is_residual:
            raise CheckpointError(
                "this is a Wan2.1-style VAE (is_residual=false); pan2 decodes the Wan2.2 (TI2V-5B) VAE only"
            )
        if self.attn_scales:
            raise CheckpointError(f"attn_scales={list(self.attn_scales)} is not supported (Wan2.2 uses [])")
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            raise CheckpointError(
                f"temperal_downsample has {len(self.temperal_downsample)} entries, "
                f"expected len(dim_mult) - 1 = {len(self.dim_mult) - 1}"
            )
        if self.out_channels != 3 * self.patch_size**2:
            raise CheckpointError(
                f"out_channels={self.out_channels} does not match 3 * patch_size² = {3 * self.patch_size**2}"
            )
        if len(self.latents_mean) != self.z_dim or len(self.latents_std) != self.z_dim:
            raise CheckpointError(
                f"latents_mean/latents_std hold {len(self.latents_mean)}/{len(self.latents_std)} values, "
                f"expected z_dim = {self.z_dim}"
            )
        if any(s <= 0 for s in self.latents_std):
            raise CheckpointError("latents_std must be positive")

    # -- derived ---------------------------------------------------------------------------------
    @property
    def decoder_dims(self) -> tuple[int, ...]:
        """Channel widths of the decoder stages: conv_in/mid width, then each up-block's output."""
        d = self.decoder_base_dim
        return tuple(d * m for m in (self.dim_mult[-1], *self.dim_mult[::-1]))

    @property
    def temperal_upsample(self) -> tuple[bool, ...]:
        return tuple(reversed(self.temperal_downsample))

    def frames_out(self, latent_frames: int) -> int:
        """Video frames decoded from `latent_frames` latent frames: 1 + 4·(T − 1)."""
        return 1 + self.scale_factor_temporal * (latent_frames - 1)

    # -- (de)serialisation -----------------------------------------------------------------------
    @classmethod
    def from_diffusers_config(cls, config: Mapping[str, Any], source: str = "config.json") -> "WanVAEConfig":
        """Build from a diffusers `vae/config.json` dict.

        Raises:
            CheckpointError: the config is of another model class or of an unsupported variant.
        """
        class_name = config.get("_class_name", "AutoencoderKLWan")
        if class_name != "AutoencoderKLWan":
            raise CheckpointError(
                f"{source} describes a {class_name}, not a Wan VAE (AutoencoderKLWan)",
                hint="pass --vae with a Wan2.2 VAE: Wan2.2_VAE.pth, wan2.2_vae.safetensors or a diffusers vae/ folder",
            )
        arch_fields = {f.name for f in dataclasses.fields(cls)}
        known = {k: v for k, v in config.items() if k in arch_fields}
        if "is_residual" not in config:
            # Older diffusers configs (Wan2.1) have no is_residual key; its default there is False.
            known["is_residual"] = False
        if config.get("decoder_base_dim") is None and "base_dim" in config:
            # diffusers: a missing/null decoder_base_dim means the decoder is as wide as the encoder.
            known["decoder_base_dim"] = config["base_dim"]
        try:
            return cls(**known)
        except TypeError as exc:  # a field of the wrong type, e.g. a string width
            raise CheckpointError(f"{source} could not be read as a Wan VAE config: {exc}") from exc

    def to_diffusers_config(self) -> dict[str, Any]:
        """The diffusers `config.json` dict for this architecture (used to write test checkpoints)."""
        out: dict[str, Any] = {"_class_name": "AutoencoderKLWan"}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def replace(self, **changes: Any) -> "WanVAEConfig":
        return dataclasses.replace(self, **changes)
