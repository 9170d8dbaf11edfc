"""The release's sampler written with diffusers' FlowMatchEulerDiscreteScheduler (the oracle of the sampler
tests): the repo's text encoder, transformer and scheduler config, seeded CPU noise, CFG `u + g·(c − u)`, Euler."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch


def diffusers_latents(
    repo: Path, prompt: str, negative_prompt: str, *, steps: int, guidance: float, seed: int,
    shape: tuple[int, ...] = (1, 48, 2, 4, 6),
):  # fmt: skip
    """(final latents `shape` float32, the diffusers scheduler that ran) for a text-to-video sample of `repo`."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    from pan2cli.dit import load_pan2_transformer
    from pan2cli.text.encoder import PAN2TextEncoder

    encoder = PAN2TextEncoder.load(
        repo / "text_encoder", repo / "tokenizer", dtype=torch.float32, device="cpu"
    )
    cond, uncond = encoder.encode(prompt).features, encoder.encode(negative_prompt).features
    model = load_pan2_transformer(repo, subfolder="transformer", dtype=torch.float32)
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(repo, subfolder="scheduler")
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1])
    latents = torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32)
    condition = torch.zeros(shape[0], 49, *shape[2:])  # text-to-video: no condition latents, no mask
    with torch.no_grad():
        for t in scheduler.timesteps:
            x = torch.cat([latents, condition], dim=1)
            c, u = model(x, t.expand(1), cond), model(x, t.expand(1), uncond)
            latents = scheduler.step(u + guidance * (c - u), t, latents).prev_sample
    return latents, scheduler
