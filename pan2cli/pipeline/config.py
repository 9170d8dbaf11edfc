"""`PAN2PipelineConfig`: how the PAN 2 pipeline runs (device, dtypes, kernels, offload), not what it generates."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from pan2cli.constants import TORCH_DTYPES
from pan2cli.errors import InputError
from pan2cli.vae.config import DECODE_KERNEL_MODES

# fp32 first: the order `one of fp32, bf16` names them in.
DTYPES = {name: getattr(torch, TORCH_DTYPES[name]) for name in ("fp32", "bf16")}


@dataclass(frozen=True)
class PAN2PipelineConfig:
    """Run-time choices of `VideoGenerator`; what to generate (frames, steps, ...) comes from a preset.

    Args:
        device (`str`, *optional*): `cuda`, `cuda:N` or `cpu`; None means cuda when available.
        dtype (`str`, *optional*): "bf16" or "fp32" for the DiT and the text encoder; None means bf16
            on CUDA, fp32 on CPU.
        vae_dtype (`str`, *optional*): the VAE's dtype; None means the same as `dtype`.
        vae_decode_kernel (`str`, defaults to "auto"): the compiled CUDA decoder (`WanVAEConfig.decode_kernel`):
            "auto" where it applies, "off" the reference decoder, "require" fail when it cannot run.
        vae_decode_kernel_parallel (`bool`, defaults to True): with several processes and one video,
            split the decode by rows across them (`WanVAEConfig.decode_kernel_parallel`).
        dit_fused_kernels (`bool`, defaults to True): the Triton fusions of the MMDiT where they apply
            (CUDA with Triton, power-of-two head_dim); the PyTorch ops elsewhere.
        offload (`bool`, defaults to False): keep the DiT's blocks in (pinned) host memory and stream
            them to the device one at a time; same output, a fraction of the memory.
        chunk_latent_frames (`int`, *optional*): VAE decode chunk; None means the preset's.
    """

    device: str | None = None
    dtype: str | None = None
    vae_dtype: str | None = None
    vae_decode_kernel: str = "auto"
    vae_decode_kernel_parallel: bool = True
    dit_fused_kernels: bool = True
    offload: bool = False
    chunk_latent_frames: int | None = None

    def __post_init__(self) -> None:
        for name in ("dtype", "vae_dtype"):
            value = getattr(self, name)
            if value is not None and value not in DTYPES:
                raise InputError(f"{name} must be one of {', '.join(DTYPES)}, got {value!r}")
        if self.vae_decode_kernel not in DECODE_KERNEL_MODES:
            raise InputError(
                f"vae_decode_kernel must be one of {', '.join(DECODE_KERNEL_MODES)}, got {self.vae_decode_kernel!r}"
            )
        for name in ("vae_decode_kernel_parallel", "dit_fused_kernels", "offload"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.chunk_latent_frames is not None and (
            not isinstance(self.chunk_latent_frames, int) or self.chunk_latent_frames < 1
        ):
            raise InputError(
                f"chunk_latent_frames must be a whole number ≥ 1, got {self.chunk_latent_frames!r}"
            )

    def torch_device(self) -> torch.device:
        """The device to run on (checked: a CUDA device that does not exist is bad input)."""
        from pan2cli.devices import resolve_device

        return resolve_device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """The DiT / text encoder dtype: `dtype`, else bf16 on CUDA and fp32 on CPU."""
        if self.dtype is None:
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def torch_vae_dtype(self, device: torch.device) -> torch.dtype:
        return DTYPES[self.vae_dtype] if self.vae_dtype is not None else self.torch_dtype(device)

    def replace(self, **changes: Any) -> "PAN2PipelineConfig":
        return dataclasses.replace(self, **changes)
