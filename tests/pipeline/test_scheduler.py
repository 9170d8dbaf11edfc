"""The flow-matching Euler sampler (pan2cli/pipeline/scheduler.py and `VideoGenerator.sample`) against closed forms.

The release's recipe (../shared/docs/pan2_model.md §5): σ = shifted `linspace(1, 0, steps + 1)` with
`σ' = s·σ / (1 + (s − 1)·σ)`, the DiT's timestep σ·1000, Euler `x ← x + (σ_next − σ)·v`, guidance
`u + g·(c − u)`, skipped when g ≤ 1. Every expected number below is worked out by hand in a comment; the
toy velocity fields make the whole sampling loop a closed form, so a swapped CFG, a flipped step or a lost
shift in the path `pan2 generate` takes fails here (issue 18).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from pan2cli.config import GenerationSettings, RuntimeConfig
from pan2cli.pipeline.generator import VideoGenerator
from pan2cli.pipeline.scheduler import euler_step, flow_sigmas, guided, shift_sigma, uses_guidance

# Shift 3 on 4 steps: linspace 1, 0.75, 0.5, 0.25, 0 → 3σ/(1 + 2σ) = 3/3, 2.25/2.5, 1.5/2, 0.75/1.5, 0/1.
SIGMAS_SHIFT_3 = [1.0, 0.9, 0.75, 0.5, 0.0]


def test_shift_sigma_closed_form():
    """σ' = s·σ/(1 + (s − 1)·σ): s = 9 at σ = 0.5 → 4.5/5 = 0.9; s = 1 leaves σ; 0 and 1 are fixed points."""
    sigma = torch.tensor([0.0, 0.25, 0.5, 1.0], dtype=torch.float64)
    assert shift_sigma(sigma, 9.0).tolist() == pytest.approx([0.0, 2.25 / 3.0, 0.9, 1.0], abs=1e-15)
    assert shift_sigma(sigma, 3.0).tolist() == pytest.approx([0.0, 0.5, 0.75, 1.0], abs=1e-15)
    assert shift_sigma(sigma, 1.0).tolist() == [0.0, 0.25, 0.5, 1.0]


def test_flow_sigmas_are_the_shifted_linspace_ending_at_zero():
    """steps + 1 levels, float64, from 1 down to exactly 0, with the shift applied (not plain linspace)."""
    sigmas = flow_sigmas(4, 3.0)
    assert sigmas.dtype == torch.float64 and sigmas.shape == (5,)
    assert sigmas.tolist() == pytest.approx(SIGMAS_SHIFT_3, abs=1e-15)
    # PAN 2's shift 9 on 2 steps: 1, 9·0.5/(1 + 8·0.5) = 0.9, 0
    assert flow_sigmas(2, 9.0).tolist() == pytest.approx([1.0, 0.9, 0.0], abs=1e-15)
    assert flow_sigmas(4, 1.0).tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]
    for bad in ((0, 9.0), (4, 0.0), (4, -1.0)):
        with pytest.raises(ValueError):
            flow_sigmas(*bad)


def test_euler_step_moves_by_sigma_difference_times_velocity():
    """x + (σ_next − σ)·v: x = 2, v = 4, σ 0.9 → 0.75: 2 + (−0.15)·4 = 1.4 (a flipped sign gives 2.6)."""
    x = torch.full((2, 3), 2.0)
    v = torch.full((2, 3), 4.0, dtype=torch.bfloat16)
    out = euler_step(x, v, 0.9, 0.75)
    assert out.dtype == torch.float32  # the latents' dtype, whatever the prediction's
    torch.testing.assert_close(out, torch.full((2, 3), 1.4), rtol=0, atol=1e-6)


def test_euler_with_a_constant_velocity_lands_on_x0_plus_total_sigma_change_times_v():
    """A constant v: the steps add up to x₀ + (σ_end − σ_start)·v = x₀ − v exactly, whatever the schedule."""
    x0 = torch.tensor([0.5, -1.0, 3.0])
    v = torch.tensor([2.0, 1.0, -4.0])
    sigmas = flow_sigmas(5, 9.0).tolist()
    x = x0
    for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
        x = euler_step(x, v, sigma, sigma_next)
    torch.testing.assert_close(x, torch.tensor([-1.5, -2.0, 7.0]), rtol=0, atol=1e-6)


def test_guidance_is_uncond_plus_g_times_cond_minus_uncond():
    """c = 3, u = 1, g = 2.5: 1 + 2.5·(3 − 1) = 6 (the roles swapped give 3 + 2.5·(1 − 3) = −2)."""
    cond = torch.tensor([3.0, 0.0], dtype=torch.bfloat16)
    uncond = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    out = guided(cond, uncond, 2.5)
    assert out.dtype == torch.float32
    assert out.tolist() == [6.0, -3.0]  # second: 2 + 2.5·(0 − 2) = −3
    assert guided(cond, None, 2.5).tolist() == [3.0, 0.0]  # no negative pass: the prediction alone
    assert [uses_guidance(g) for g in (0.5, 1.0, 1.01, 2.5)] == [False, False, True, True]


# -- the generator's loop, with toy velocity fields --------------------------------------------------


class _ToyModel:
    """A stand-in for the DiT: `field(latents, timestep, text)` as the velocity; records every call."""

    def __init__(self, field):
        self.field = field
        self.calls = []
        # what the generator reads of a transformer's config (the attention backend it records)
        self.config = SimpleNamespace(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16)

    def __call__(self, hidden_states, timestep, encoder_hidden_states):
        assert hidden_states.shape[1] == 97  # 48 latents + 48 condition + 1 mask
        self.calls.append((timestep.clone(), encoder_hidden_states.clone()))
        return self.field(hidden_states[:, :48], timestep, encoder_hidden_states)


def _generator() -> VideoGenerator:
    components = SimpleNamespace(transformer_arguments={}, num_train_timesteps=1000)
    return VideoGenerator(components, RuntimeConfig(device="cpu"))


def _settings(steps: int, guidance: float, shift: float, seed: int = 5) -> GenerationSettings:
    # 5 frames of 32x32: latents (1, 48, 2, 2, 2)
    return GenerationSettings(
        prompt="p",
        negative_prompt="n",
        seed=seed,
        frames=5,
        height=32,
        width=32,
        fps=24.0,
        steps=steps,
        guidance=guidance,
        flow_shift=shift,
        sampler="euler",
    )


def _noise(seed: int) -> torch.Tensor:
    """The seed contract of `VideoGenerator.sample`: float32 CPU randn of the latent shape."""
    return torch.randn(
        (1, 48, 2, 2, 2), generator=torch.Generator("cpu").manual_seed(seed), dtype=torch.float32
    )


def test_sample_applies_guidance_with_the_prompt_as_cond():
    """Velocity = the text features' value: prompt 3, negative 1, g = 2.5 → v = 1 + 2.5·(3 − 1) = 6 at every step,
    so the result is noise + (0 − 1)·6 = noise − 6 (swapped roles: noise + 2; a flipped step: noise + 6)."""
    model = _ToyModel(lambda x, t, text: torch.full_like(x, text.mean().item()))
    cond, uncond = torch.full((1, 3, 8), 3.0), torch.full((1, 3, 8), 1.0)
    got = _generator().sample(model, _settings(steps=3, guidance=2.5, shift=9.0), cond, uncond)
    torch.testing.assert_close(got, _noise(5) - 6.0, rtol=0, atol=1e-5)
    assert len(model.calls) == 6  # two passes per step
    assert sorted(call[1].mean().item() for call in model.calls[:2]) == [1.0, 3.0]


def test_sample_with_a_linear_field_follows_the_shifted_schedule():
    """v = x (no guidance): each step multiplies by 1 + σ_next − σ. Shift 3, 4 steps, σ = 1, 0.9, 0.75, 0.5, 0:
    0.9 · 0.85 · 0.75 · 0.5 = 0.286875 (no shift: 0.75⁴ = 0.31640625; a flipped step: 1.1·1.15·1.25·1.5).
    The DiT sees timesteps σ·1000 = 1000, 900, 750, 500, one per sample."""
    model = _ToyModel(lambda x, t, text: x.clone())
    cond = torch.zeros(1, 3, 8)
    got = _generator().sample(model, _settings(steps=4, guidance=1.0, shift=3.0, seed=9), cond, None)
    torch.testing.assert_close(got, _noise(9) * 0.286875, rtol=1e-6, atol=1e-6)
    assert len(model.calls) == 4  # g = 1: one pass per step
    timesteps = [call[0] for call in model.calls]
    assert all(t.shape == (1,) and t.dtype == torch.float32 for t in timesteps)
    assert [t.item() for t in timesteps] == pytest.approx([1000.0, 900.0, 750.0, 500.0], abs=1e-3)


def test_sample_with_a_timestep_field_sums_sigma_steps():
    """v = t/1000 = σ (the field reads the timestep): x = noise + Σ (σ_next − σ)·σ over σ = 1, 0.9, 0.75, 0.5, 0:
    −0.1·1 − 0.15·0.9 − 0.25·0.75 − 0.5·0.5 = −0.1 − 0.135 − 0.1875 − 0.25 = −0.6725; guidance with equal cond and
    uncond leaves it unchanged."""
    model = _ToyModel(lambda x, t, text: torch.full_like(x, t.item() / 1000.0))
    text = torch.zeros(1, 3, 8)
    got = _generator().sample(model, _settings(steps=4, guidance=2.5, shift=3.0, seed=2), text, text)
    torch.testing.assert_close(got, _noise(2) - 0.6725, rtol=0, atol=1e-5)
