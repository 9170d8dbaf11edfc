"""`Decoder`: what a decode needs of a decoder, met by the reference `WanVAEDecoder` and the compiled
`WanKernelDecoder` alike (`pan2cli.vae.kernel.choice` returns one, `pan2cli.vae.decoder` runs it)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch

from pan2cli.config import DEFAULT_CHUNK_LATENT_FRAMES
from pan2cli.vae.config import WanVAEConfig
from pan2cli.vae.parallel import RowSplit


@runtime_checkable
class Decoder(Protocol):
    """What a decode needs of a decoder; the reference `WanVAEDecoder` and the compiled `WanKernelDecoder` both have it."""

    @property
    def config(self) -> WanVAEConfig: ...

    @property
    def device(self) -> torch.device: ...

    @property
    def dtype(self) -> torch.dtype: ...

    def decode_uint8_chunks(
        self,
        z: torch.Tensor,
        chunk_latent_frames: int = DEFAULT_CHUNK_LATENT_FRAMES,
        rows: RowSplit | None = None,
    ) -> Iterator[torch.Tensor]:
        """Un-normalised latents `(B, z_dim, T, h, w)` → uint8 frames `(B, f, 16h, 16w, 3)` on the device, chunk by chunk."""
        ...
