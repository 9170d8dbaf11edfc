"""Flow-matching Euler sampling: the shifted σ schedule and one step.

Convention (Wan / PAN 2): `x_σ = (1 − σ)·x₀ + σ·ε`, the DiT predicts the velocity `v = ε − x₀` at
timestep `σ·num_train_timesteps`, and an Euler step moves `x ← x + (σ_next − σ)·v` from σ = 1 (noise)
to σ = 0.
"""

from __future__ import annotations

import torch


def shift_sigma(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """`σ' = s·σ / (1 + (s − 1)·σ)`: s > 1 spends more steps at high noise (PAN 2 uses s = 9)."""
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def flow_sigmas(steps: int, shift: float) -> torch.Tensor:
    """The `steps + 1` noise levels of the schedule, float64 on the CPU: shifted `linspace(1, 0)`, ending at 0.

    Raises:
        ValueError: steps < 1 or shift ≤ 0.
    """
    if steps < 1 or not shift > 0:
        raise ValueError(f"steps must be ≥ 1 and shift > 0, got {steps} and {shift}")
    return shift_sigma(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64), shift)


def euler_step(
    latents: torch.Tensor, velocity: torch.Tensor, sigma: float, sigma_next: float
) -> torch.Tensor:
    """One Euler step in the latents' dtype (fp32 in the pipeline): `x + (σ_next − σ)·v`."""
    return latents + (sigma_next - sigma) * velocity.to(latents.dtype)


def uses_guidance(guidance: float) -> bool:
    """Whether classifier-free guidance runs (a second, negative-prompt pass): g > 1, as in PAN 2's pipeline."""
    return guidance > 1.0


def guided(cond: torch.Tensor, uncond: torch.Tensor | None, guidance: float) -> torch.Tensor:
    """Classifier-free guidance in fp32: `u + g·(c − u)`; the conditional prediction alone when `uncond` is None."""
    if uncond is None:
        return cond.float()
    cond, uncond = cond.float(), uncond.float()
    return uncond + guidance * (cond - uncond)
