"""Flow-matching Euler sampling: the checkpoint's schedule options, the shifted σ schedule and one step.

Convention (Wan / PAN 2): `x_σ = (1 − σ)·x₀ + σ·ε`, the DiT predicts the velocity `v = ε − x₀` at
timestep `σ·num_train_timesteps`, and an Euler step moves `x ← x + (σ_next − σ)·v` from σ = 1 (noise)
to σ = 0.

The schedule is the one the release's pipeline asks of diffusers' `FlowMatchEulerDiscreteScheduler` (read
from the checkpoint's `scheduler/scheduler_config.json`): `set_timesteps(sigmas=linspace(1, 0, steps + 1)[:-1])`,
which shifts the levels, stretches them to `shift_terminal` when the config sets one, and appends σ = 0
(vLLM-Omni's `vllm_omni/diffusion/models/pan2/pipeline_pan2.py`, the same in IFM's fork
MBZUAI-IFM/vllm-omni-pan2). `SchedulerConfig` is what pan2 reads of that config; options it does not run
are refused by name (`scheduler_config_from`).

torch is imported where a schedule is computed: `pan2 --help` reads this module's config without it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from pan2cli.errors import CheckpointError, InputError

if TYPE_CHECKING:
    import torch

SCHEDULER_CLASS = "FlowMatchEulerDiscreteScheduler"
DEFAULT_NUM_TRAIN_TIMESTEPS = 1000
# diffusers' `FlowMatchEulerDiscreteScheduler(shift=1.0)`: the shift of a config that sets none.
DEFAULT_SHIFT = 1.0
# Options of diffusers' FlowMatchEulerDiscreteScheduler that pan2 does not run: each is refused when it is on
# (true, or any value diffusers takes for true), with what it would do.
UNSUPPORTED_OPTIONS = {
    "use_dynamic_shifting": "a resolution-dependent shift from a `mu` that PAN 2's pipeline never passes "
    "(diffusers refuses to set the timesteps without it)",
    "invert_sigmas": "the schedule turned into 1 − σ, ending at 1",
    "use_karras_sigmas": "Karras noise levels in place of the shifted linspace",
    "use_exponential_sigmas": "exponentially spaced noise levels in place of the shifted linspace",
    "use_beta_sigmas": "beta-distributed noise levels in place of the shifted linspace",
    "stochastic_sampling": "steps that draw fresh noise instead of the Euler step",
}
# Read by diffusers only with `use_dynamic_shifting` (refused above): they do nothing here, as there.
DYNAMIC_SHIFT_OPTIONS = (
    "base_shift",
    "max_shift",
    "base_image_seq_len",
    "max_image_seq_len",
    "time_shift_type",
)
_TIME_SHIFT_TYPES = ("exponential", "linear")
_HINT = "pan2 runs the release's Euler flow-matching schedule (shift, shift_terminal); use PAN 2's scheduler/ (IFM/PAN2)"


@dataclass(frozen=True)
class SchedulerConfig:
    """What pan2 runs of a checkpoint's `scheduler/scheduler_config.json` (diffusers' FlowMatchEulerDiscreteScheduler).

    Attributes:
        num_train_timesteps (`int`, defaults to 1000): the DiT's timestep is σ·num_train_timesteps.
        shift (`float`, *optional*): the config's `shift`; None when the checkpoint gives none, where
            diffusers' default (`DEFAULT_SHIFT`, 1.0) applies unless a preset or flag sets the shift.
        shift_terminal (`float`, *optional*): stretch the shifted levels so that the last one before 0 is this
            value (diffusers' `stretch_shift_to_terminal`); None: no stretch.
        source (`str`, *optional*): the file read, for messages and sidecars; None when the checkpoint has none.
    """

    num_train_timesteps: int = DEFAULT_NUM_TRAIN_TIMESTEPS
    shift: float | None = None
    shift_terminal: float | None = None
    source: str | None = None

    def resolve_shift(self, given: float | None, given_by: str | None = None) -> tuple[float, str]:
        """The shift that runs and where it comes from: `given` (a preset's or a flag's, named by `given_by`)
        wins; else the config's `shift`; else diffusers' default."""
        if given is not None:
            return float(given), given_by or "the settings"
        if self.shift is not None:
            return self.shift, self.source or "the checkpoint's scheduler config"
        where = self.source or "the checkpoint's scheduler/scheduler_config.json, which is missing"
        return DEFAULT_SHIFT, f"diffusers' default (no shift in {where})"

    def sigmas(self, steps: int, shift: float) -> torch.Tensor:
        """The `steps + 1` noise levels of a sample, float64 on the CPU (`flow_sigmas` with this config's options).

        Raises:
            InputError: one step with a `shift_terminal` (the stretch needs a level between 1 and 0).
        """
        if self.shift_terminal is not None and steps < 2:
            raise InputError(
                f"--steps {steps}: {self.source or 'the scheduler config'} sets shift_terminal "
                f"{self.shift_terminal:g}, which stretches the levels after the first one; one step has none",
                hint="pass --steps 2 or more",
            )
        return flow_sigmas(steps, shift, self.shift_terminal)


def _is_on(value: Any) -> bool:
    """Whether an option of the config is on: diffusers tests its switches by truth (null, false and 0 are off)."""
    return bool(value)


def _number(config: Mapping[str, Any], key: str, source: str) -> float | None:
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        raise CheckpointError(f"{source}: {key} must be a number, got {value!r}", hint=_HINT)
    return float(value)


def scheduler_config_from(config: Mapping[str, Any], source: str) -> SchedulerConfig:
    """Read a `scheduler_config.json`, refusing every option that would make the release's schedule other than ours.

    Args:
        config: the file's object.
        source: the file, for messages.

    Raises:
        CheckpointError: another scheduler class; an option of `UNSUPPORTED_OPTIONS` that is on; an unknown
            option that is set (a newer diffusers' option pan2 cannot honour); a bad `num_train_timesteps`,
            `shift`, `shift_terminal` or `time_shift_type` (each named, with its value).
    """
    class_name = config.get("_class_name")
    if class_name is not None and class_name != SCHEDULER_CLASS:
        raise CheckpointError(
            f"{source} describes a {class_name}; PAN 2 samples with {SCHEDULER_CLASS}", hint=_HINT
        )
    refused = [
        f"{key} = {config[key]!r} ({why})"
        for key, why in UNSUPPORTED_OPTIONS.items()
        if _is_on(config.get(key))
    ]
    known = {"num_train_timesteps", "shift", "shift_terminal", *UNSUPPORTED_OPTIONS, *DYNAMIC_SHIFT_OPTIONS}
    unknown = sorted(k for k, v in config.items() if not k.startswith("_") and k not in known and _is_on(v))
    refused += [f"{key} = {config[key]!r} (an option pan2 does not know)" for key in unknown]
    if refused:
        raise CheckpointError(f"{source} sets what pan2 does not run: {'; '.join(refused)}", hint=_HINT)

    timesteps = config.get("num_train_timesteps", DEFAULT_NUM_TRAIN_TIMESTEPS)
    if isinstance(timesteps, bool) or not isinstance(timesteps, int) or timesteps < 1:
        raise CheckpointError(
            f"{source}: num_train_timesteps must be a positive whole number, got {timesteps!r}"
        )
    shift = _number(config, "shift", source)
    if shift is not None and not (shift > 0 and shift != float("inf")):
        raise CheckpointError(f"{source}: shift must be a positive number, got {config['shift']!r}")
    terminal = _number(config, "shift_terminal", source)
    if terminal is not None and not 0 <= terminal < 1:
        raise CheckpointError(
            f"{source}: shift_terminal must be a noise level from 0 to below 1, got {config['shift_terminal']!r}"
        )
    time_shift_type = config.get("time_shift_type", _TIME_SHIFT_TYPES[0])
    if time_shift_type not in _TIME_SHIFT_TYPES:  # diffusers refuses the config too
        raise CheckpointError(
            f"{source}: time_shift_type must be one of {', '.join(_TIME_SHIFT_TYPES)}, got {time_shift_type!r}"
        )
    # 0 is off in diffusers (`if config.shift_terminal:`), as null is.
    return SchedulerConfig(timesteps, shift, terminal or None, source)


def shift_sigma(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """`σ' = s·σ / (1 + (s − 1)·σ)`: s > 1 spends more steps at high noise (PAN 2's official runner uses s = 9)."""
    return shift * sigma / (1.0 + (shift - 1.0) * sigma)


def stretch_to_terminal(sigmas: torch.Tensor, terminal: float) -> torch.Tensor:
    """Scale `1 − σ` so that the last level becomes `terminal` (diffusers' `stretch_shift_to_terminal`); σ = 1 stays."""
    one_minus = 1.0 - sigmas
    return 1.0 - one_minus * ((1.0 - terminal) / one_minus[-1])


def flow_sigmas(steps: int, shift: float, shift_terminal: float | None = None) -> torch.Tensor:
    """The `steps + 1` noise levels of the schedule, float64 on the CPU: shifted `linspace(1, 0)` (stretched to
    `shift_terminal` when given), then 0.

    Raises:
        ValueError: steps < 1, shift ≤ 0, or a `shift_terminal` outside (0, 1) or with one step.
    """
    import torch

    if steps < 1 or not shift > 0:
        raise ValueError(f"steps must be ≥ 1 and shift > 0, got {steps} and {shift}")
    sigmas = shift_sigma(torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)[:-1], shift)
    if shift_terminal is not None:
        if not 0 < shift_terminal < 1 or steps < 2:
            raise ValueError(
                f"shift_terminal must be in (0, 1) with steps ≥ 2, got {shift_terminal} and {steps}"
            )
        sigmas = stretch_to_terminal(sigmas, shift_terminal)
    return torch.cat([sigmas, sigmas.new_zeros(1)])


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
