"""The denoising loop: flow-matching Euler with classifier-free guidance, in one process or CFG-parallel.

CFG-parallel (issue 15): with several processes sharing one video, rank 0 runs the conditional pass and
rank 1 the unconditional one, and the two predictions are swapped with one all-gather per step, so a
step costs one forward per GPU instead of two. Every rank then applies the same guidance and Euler step
to the same tensors, so all ranks hold the same latents, equal to one process's (the same forward on
the same inputs; exact in float64 on the CPU, `tests/test_sampling.py`). Ranks beyond the first two
repeat rank 0's or rank 1's pass (no gain yet: sequence parallelism would use them).
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from pan2cli import distributed
from pan2cli.pipeline.scheduler import euler_step, guided, uses_guidance


def denoise(
    model,
    latents: torch.Tensor,
    condition: torch.Tensor,
    cond: torch.Tensor,
    uncond: torch.Tensor | None,
    sigmas: Sequence[float],
    guidance: float,
    num_train_timesteps: int,
    *,
    cfg_parallel: bool = False,
    on_step: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Run the Euler steps from `latents` and return the final latents (float32, on their device).

    Args:
        model: the PAN 2 transformer (its dtype is the one the inputs are cast to).
        latents: `[1, 48, T, h, w]` float32 initial noise.
        condition: `[1, 49, T, h, w]` condition channels in the model's dtype (`condition_latents`).
        cond, uncond: prompt and negative-prompt features; `uncond` None (or guidance ≤ 1): no CFG.
        sigmas: the schedule, σ_0 … σ_N (`flow_sigmas`); the timestep is σ·num_train_timesteps.
        cfg_parallel: split the two passes over ranks 0 and 1 (module docstring); needs ≥ 2 processes
            that all call this with the same arguments.
        on_step: called with 1 after each step (progress).
    """
    dtype = next(model.parameters()).dtype
    use_uncond = uses_guidance(guidance) and uncond is not None
    split = cfg_parallel and use_uncond and distributed.world_size() >= 2
    mine = (cond if distributed.rank() % 2 == 0 else uncond) if split else None
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        timestep = torch.full((1,), sigma * num_train_timesteps, device=latents.device, dtype=torch.float32)
        x = torch.cat([latents.to(dtype), condition], dim=1)
        if split:
            predictions = distributed.gather_equal(model(x, timestep, mine))
            v_cond, v_uncond = predictions[0], predictions[1]
        else:
            v_cond = model(x, timestep, cond)
            v_uncond = model(x, timestep, uncond) if use_uncond else None
        latents = euler_step(latents, guided(v_cond, v_uncond, guidance), sigma, sigma_next)
        if on_step is not None:
            on_step(1)
    return latents
