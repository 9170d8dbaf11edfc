"""PAN 2's condition channels: 48 condition latents and 1 mask, concatenated to the noisy latents (97 channels in all).

Text-to-video: all zeros. Image-to-video: latent frame 0 holds the start image's normalised latent and the
mask is 1 on that frame, 0 elsewhere (`prepare_condition_latents` of vllm-project/vllm-omni
`vllm_omni/diffusion/models/pan2/pipeline_pan2.py`). The noisy latents themselves are
never replaced: frame 0 is generated like the others, with the same timestep.
"""

from __future__ import annotations

import torch


def condition_latents(
    latent_shape: tuple[int, ...], image_latent: torch.Tensor | None = None
) -> torch.Tensor:
    """`[B, C + 1, T, h, w]` float32: condition latents then the mask.

    Args:
        latent_shape: `(B, C, T, h, w)` of the noisy latents.
        image_latent: `[B or 1, C, 1, h, w]` normalised latent of the start image, or None (text-to-video).
    """
    batch, channels, frames, height, width = latent_shape
    condition = torch.zeros(batch, channels + 1, frames, height, width, dtype=torch.float32)
    if image_latent is not None:
        condition[:, :channels, :1] = image_latent.to(torch.float32).cpu()
        condition[:, channels:, :1] = 1.0
    return condition
