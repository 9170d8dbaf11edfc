"""The flow-matching Euler sampler (pan2cli/scheduler.py and `VideoGenerator.sample`) against closed forms,
and the checkpoint's scheduler config (what is run, what is refused, who sets the shift) against diffusers.

The release's recipe (vllm-project/vllm-omni `vllm_omni/diffusion/models/pan2/pipeline_pan2.py`, the same in
MBZUAI-IFM/vllm-omni-pan2): diffusers' FlowMatchEulerDiscreteScheduler from the checkpoint's `scheduler/`, σ =
shifted `linspace(1, 0, steps + 1)` with `σ' = s·σ / (1 + (s − 1)·σ)`, the DiT's timestep σ·1000, Euler
`x ← x + (σ_next − σ)·v`, guidance `u + g·(c − u)`, skipped when g ≤ 1. Every expected number below is worked
out by hand in a comment; the toy velocity fields make the whole sampling loop a closed form, so a swapped
CFG, a flipped step or a lost shift in the path `pan2 generate` takes fails here.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pan2cli.components.locate import resolve_components
from pan2cli.config import GenerationSettings, RuntimeConfig
from pan2cli.errors import CheckpointError, InputError
from pan2cli.pipeline.generator import VideoGenerator
from pan2cli.presets import load_preset
from pan2cli.scheduler import (
    DEFAULT_SHIFT,
    UNSUPPORTED_OPTIONS,
    SchedulerConfig,
    euler_step,
    flow_sigmas,
    guided,
    scheduler_config_from,
    shift_sigma,
    uses_guidance,
)
from pan2cli.testing.tiny_pan2 import SCHEDULER_CONFIG, write_scheduler_config
from tests.pipeline.diffusers_reference import diffusers_latents

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

    def forward_passes(self, hidden_states, timestep, texts):
        """Both guidance passes in one call, as the DiT's: each pass recorded in order."""
        return [self(hidden_states, timestep, text) for text in texts]


def _generator(scheduler: SchedulerConfig = SchedulerConfig()) -> VideoGenerator:
    components = SimpleNamespace(transformer_arguments={}, scheduler=scheduler)
    return VideoGenerator(components, RuntimeConfig(device="cpu"))


def _settings(steps: int, guidance: float, shift: float | None, seed: int = 5) -> GenerationSettings:
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


def test_the_checkpoint_shift_runs_where_the_settings_give_none():
    """v = x, 4 steps: the checkpoint's shift 3 gives 0.9 · 0.85 · 0.75 · 0.5 = 0.286875 (as the test above); diffusers'
    default 1 (a config without `shift`) gives 0.75⁴ = 0.31640625; a shift in the settings wins over the config's."""
    model = _ToyModel(lambda x, t, text: x.clone())
    cond = torch.zeros(1, 3, 8)
    from_checkpoint = _generator(SchedulerConfig(shift=3.0, source="s.json"))
    got = from_checkpoint.sample(model, _settings(steps=4, guidance=1.0, shift=None, seed=9), cond, None)
    torch.testing.assert_close(got, _noise(9) * 0.286875, rtol=1e-6, atol=1e-6)
    got = _generator().sample(model, _settings(steps=4, guidance=1.0, shift=None, seed=9), cond, None)
    torch.testing.assert_close(got, _noise(9) * 0.75**4, rtol=1e-6, atol=1e-6)
    from_settings = _generator(SchedulerConfig(shift=9.0)).sample(
        model, _settings(steps=4, guidance=1.0, shift=3.0, seed=9), cond, None
    )
    torch.testing.assert_close(from_settings, _noise(9) * 0.286875, rtol=1e-6, atol=1e-6)


def test_shift_precedence_and_its_source():
    """Settings (a preset's or a flag's) > the checkpoint's `shift` > diffusers' default 1.0, each named."""
    config = SchedulerConfig(shift=5.0, source="repo/scheduler/scheduler_config.json")
    assert config.resolve_shift(3.0, "--flow-shift") == (3.0, "--flow-shift")
    assert config.resolve_shift(9.0, "preset pan2-10s") == (9.0, "preset pan2-10s")
    assert config.resolve_shift(None, "preset mine") == (5.0, "repo/scheduler/scheduler_config.json")
    shift, source = SchedulerConfig(source="x/scheduler_config.json").resolve_shift(None)
    assert (
        shift == DEFAULT_SHIFT == 1.0 and source == "diffusers' default (no shift in x/scheduler_config.json)"
    )
    assert "missing" in SchedulerConfig().resolve_shift(None)[1]


# -- the checkpoint's scheduler config against diffusers' FlowMatchEulerDiscreteScheduler (the release's) --------


def _diffusers_sigmas(steps: int, **config) -> tuple[torch.Tensor, torch.Tensor]:
    """What the release's pipeline gets: `set_timesteps(sigmas=linspace(1, 0, steps + 1)[:-1])` (float32)."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    scheduler = FlowMatchEulerDiscreteScheduler(**config)
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1])
    return scheduler.sigmas, scheduler.timesteps


@pytest.mark.parametrize(
    "steps, shift, terminal",
    [(4, 3.0, None), (50, 9.0, None), (3, 1.0, None), (7, 5.0, 0.1), (50, 9.0, 0.02), (2, 0.5, 0.5)],
)
def test_sigmas_equal_diffusers(steps, shift, terminal):
    """Shifted (and stretched to `shift_terminal`) levels and σ·1000 timesteps, to diffusers' float32 rounding."""
    config = scheduler_config_from({"shift": shift, "shift_terminal": terminal}, "scheduler_config.json")
    ours = config.sigmas(steps, config.resolve_shift(None)[0])
    sigmas, timesteps = _diffusers_sigmas(steps, shift=shift, shift_terminal=terminal)
    assert ours.dtype == torch.float64 and ours.shape == sigmas.shape == (steps + 1,)
    torch.testing.assert_close(ours.float(), sigmas, rtol=0, atol=1e-6)
    torch.testing.assert_close((ours[:-1] * 1000).float(), timesteps, rtol=0, atol=1e-3)
    if terminal is not None:  # the stretch matters: without it the last level before 0 is another
        assert ours[-2].item() == pytest.approx(terminal, abs=1e-12)
        assert (flow_sigmas(steps, shift) - ours).abs().max().item() > 1e-3


def test_one_step_with_a_terminal_shift_is_bad_input():
    """diffusers divides by 1 − σ_last = 0 there (NaN levels); pan2 says so before anything loads."""
    with pytest.raises(InputError, match="--steps 1: s.json sets shift_terminal 0.1") as err:
        SchedulerConfig(shift_terminal=0.1, source="s.json").sigmas(1, 9.0)
    assert "--steps 2" in err.value.hint
    assert SchedulerConfig().sigmas(1, 9.0).tolist() == [1.0, 0.0]


def test_defaults_and_switched_off_options_are_accepted():
    """A config as diffusers saves it (every option at its default) reads as shift, timesteps and no stretch; 0 is
    an off terminal shift, as in diffusers; the dynamic-shift parameters are inert without dynamic shifting."""
    saved = {
        "_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.37.0", "num_train_timesteps": 1000,
        "shift": 7, "use_dynamic_shifting": False, "base_shift": 0.5, "max_shift": 1.15, "base_image_seq_len": 256,
        "max_image_seq_len": 4096, "invert_sigmas": False, "shift_terminal": 0, "use_karras_sigmas": False,
        "use_exponential_sigmas": False, "use_beta_sigmas": False, "time_shift_type": "exponential",
        "stochastic_sampling": False, "a_future_switch": None,
    }  # fmt: skip
    assert scheduler_config_from(saved, "s.json") == SchedulerConfig(1000, 7.0, None, "s.json")
    assert scheduler_config_from({}, "s.json") == SchedulerConfig(source="s.json")


@pytest.mark.parametrize(
    "options, match",
    [
        ({"_class_name": "UniPCMultistepScheduler"}, "describes a UniPCMultistepScheduler"),
        ({"shift": 0}, "shift must be a positive number, got 0"),
        ({"shift": "9"}, "shift must be a number, got '9'"),
        ({"shift_terminal": 1.0}, "shift_terminal must be a noise level from 0 to below 1, got 1.0"),
        ({"num_train_timesteps": 0}, "num_train_timesteps must be a positive whole number, got 0"),
        ({"time_shift_type": "cubic"}, "time_shift_type must be one of exponential, linear, got 'cubic'"),
    ],
)
def test_bad_values_are_named(options, match):
    with pytest.raises(CheckpointError, match=match):
        scheduler_config_from({**SCHEDULER_CONFIG, **options}, "s.json")


# -- a tiny repository whose scheduler config sets each option (`pan2cli.testing.tiny_pan2`) -----------------------


def _repo_with_scheduler(tiny_pan2, tmp_path, **options):
    """The tiny repository with its own `scheduler/scheduler_config.json` (`SCHEDULER_CONFIG` with `options`);
    the other components are links to the session's tiny repository."""
    root = tmp_path / "PAN2"
    root.mkdir()
    for name in ("transformer", "text_encoder", "tokenizer", "vae", "modular_model_index.json"):
        os.symlink(tiny_pan2 / name, root / name)
    write_scheduler_config(root, options)
    return root


@pytest.mark.parametrize("key", [*UNSUPPORTED_OPTIONS, "a_future_option"])
def test_an_option_pan2_does_not_run_is_refused_by_name(tiny_pan2, tmp_path, key):
    """`stochastic_sampling: true`, `invert_sigmas: true`, dynamic shifting, Karras / exponential / beta
    levels, or an option pan2 does not know, in the checkpoint: a checkpoint error naming it (exit 2), before any
    weight is read, not a schedule silently other than the release's."""
    repo = _repo_with_scheduler(tiny_pan2, tmp_path, **{key: True})
    with pytest.raises(
        CheckpointError, match=f"scheduler_config.json sets what pan2 does not run: {key} = True"
    ) as err:
        resolve_components(repo)
    assert err.value.exit_code == 2 and "shift_terminal" in err.value.hint


@pytest.mark.parametrize("value", [1, 2.5, "yes", [0]], ids=["1", "2.5", "a string", "a list"])
def test_any_true_value_of_an_option_is_on_as_diffusers_reads_it(value):
    """diffusers tests its switches by truth (`if self.config.stochastic_sampling:`): `stochastic_sampling: 1` would
    draw fresh noise there, so it is refused here like `true`, not taken as off because it is not `true` itself."""
    with pytest.raises(
        CheckpointError, match=re.escape(f"sets what pan2 does not run: stochastic_sampling = {value!r}")
    ):
        scheduler_config_from({**SCHEDULER_CONFIG, "stochastic_sampling": value}, "s.json")
    for off in (0, 0.0, "", [], None, False):
        scheduler_config_from({**SCHEDULER_CONFIG, "stochastic_sampling": off}, "s.json")


def test_the_checkpoint_options_reach_the_components(tiny_pan2, tmp_path):
    repo = _repo_with_scheduler(tiny_pan2, tmp_path, shift=5.0, shift_terminal=0.2, num_train_timesteps=999)
    scheduler = resolve_components(repo).scheduler
    assert scheduler == SchedulerConfig(
        999, 5.0, 0.2, str(repo.resolve() / "scheduler" / "scheduler_config.json")
    )


def test_generation_runs_the_checkpoint_schedule_as_diffusers_does(tiny_pan2, tmp_path):
    """A preset without flow_shift: the checkpoint's shift 5 and terminal shift 0.2 run, as diffusers' scheduler read
    from the same folder runs them (the release's loop written out, diffusers as the oracle); the sidecar says
    which shift ran and where it came from."""

    repo = _repo_with_scheduler(tiny_pan2, tmp_path, shift=5.0, shift_terminal=0.2)
    preset = dataclasses.replace(load_preset("pan2-5s"), flow_shift=None)
    generator = VideoGenerator.from_pretrained(repo, config=RuntimeConfig(device="cpu"))
    steps, guidance, seed = 3, 3.5, 11
    result = generator.generate(
        "a red fox", preset=preset, negative_prompt="snow", seed=seed, guidance=guidance, steps=steps, frames=5,
        height=64, width=96, output=tmp_path / "fox.mp4",
    )  # fmt: skip

    latents, scheduler = diffusers_latents(
        repo, "a red fox", "snow", steps=steps, guidance=guidance, seed=seed
    )
    assert scheduler.sigmas[-2].item() == pytest.approx(0.2, abs=1e-6)  # the stretch is on
    assert (result.latents - latents).abs().max().item() <= 1e-4  # float32 levels in diffusers, float64 here

    side = json.loads((tmp_path / "fox.json").read_text())
    assert side["flow_shift"] == 5.0
    assert side["flow_shift_source"] == str(repo.resolve() / "scheduler" / "scheduler_config.json")


def test_cli_says_which_shift_ran_and_where_it_came_from(tiny_pan2, tmp_path, run_cli):
    """The checkpoint says 5: the shipped preset's 9 wins (one line on stderr names both), `--flow-shift 3` wins
    over both, and a preset without flow_shift takes the checkpoint's, without a word; the sidecar says which."""
    from pan2cli.presets import preset_to_toml

    repo = _repo_with_scheduler(tiny_pan2, tmp_path, shift=5.0)
    config_file = repo.resolve() / "scheduler" / "scheduler_config.json"
    mine = tmp_path / "mine.toml"
    mine.write_text(preset_to_toml(dataclasses.replace(load_preset("pan2-5s"), flow_shift=None)))
    small = ("--model", repo, "--steps", 1, "--frames", 5, "--size", "64x96", "--device", "cpu")
    runs = {
        "preset": ((), 9.0, "preset pan2-10s"),
        "flag": (("--flow-shift", 3), 3.0, "--flow-shift"),
        "checkpoint": (("--preset", mine), 5.0, str(config_file)),
    }
    for name, (extra, shift, source) in runs.items():
        res = run_cli("generate", "a cat", *small, *extra, "-o", tmp_path / f"{name}.mp4")
        assert res.exit_code == 0, res.stderr
        side = json.loads((tmp_path / f"{name}.json").read_text())
        assert (side["flow_shift"], side["flow_shift_source"]) == (shift, source), name
        note = f"Flow shift {shift:g} from {source}; the checkpoint's {config_file} sets 5."
        assert res.stderr.count("Flow shift") == (0 if name == "checkpoint" else 1), res.stderr
        assert name == "checkpoint" or note in res.stderr


def test_cli_refuses_a_checkpoint_option_it_does_not_run(tiny_pan2, tmp_path, run_cli):
    repo = _repo_with_scheduler(tiny_pan2, tmp_path, stochastic_sampling=True)
    small = ("--steps", 1, "--frames", 5, "--size", "64x96", "--device", "cpu")  # quick if it ran after all
    res = run_cli("generate", "a cat", "--model", repo, *small, "-o", tmp_path / "x.mp4")
    assert res.exit_code == 2
    assert "stochastic_sampling = True (steps that draw fresh noise instead of the Euler step)" in res.stderr
    assert not (tmp_path / "x.mp4").exists()
