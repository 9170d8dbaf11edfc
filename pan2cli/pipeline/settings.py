"""What one generation is: its settings (preset + overrides, checked before any model loads), job and result."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pan2cli.constants import (
    SIZE_MULTIPLE,
    VAE_TEMPORAL_FACTOR,
    latent_shape,
    valid_frames,
    valid_seed,
    valid_size,
)
from pan2cli.errors import InputError
from pan2cli.outputs import DEFAULT_CRF
from pan2cli.presets import Preset


def frames_for_duration(duration: float, fps: float) -> int:
    """Video frames for `duration` seconds: `4·round(duration·fps/4) + 1` (5 s at 24 fps → 121)."""
    return VAE_TEMPORAL_FACTOR * round(duration * fps / VAE_TEMPORAL_FACTOR) + 1


@dataclass(frozen=True)
class GenerationSettings:
    """Everything that decides one video (the sidecar records it)."""

    prompt: str
    negative_prompt: str
    seed: int
    frames: int
    height: int
    width: int
    fps: float
    steps: int
    guidance: float
    shift: float
    image: Path | None = None

    def check(self) -> None:
        """Bad input (exit 2) before any model loads: empty prompt, F not 1 mod 4, sizes not multiples of 32, ..."""
        if not self.prompt.strip():
            raise InputError(
                "the prompt is empty",
                hint='pass the text to generate from, e.g. pan2 generate "a cat on a skateboard"',
            )
        if not valid_frames(self.frames):
            raise InputError(
                f"--frames {self.frames} is not 1 + 4·k (the Wan2.2 VAE decodes 1 + 4·(latent frames − 1) frames)",
                hint="use e.g. 121 (5 s at 24 fps), 241 or 481, or --duration",
            )
        for name in ("height", "width"):
            value = getattr(self, name)
            if not valid_size(value):
                raise InputError(
                    f"--size: {name} {value} is not a positive multiple of {SIZE_MULTIPLE}",
                    hint="e.g. --size 704x1248",
                )
        if self.steps < 1:
            raise InputError(f"--steps {self.steps} must be ≥ 1")
        if not (math.isfinite(self.guidance) and self.guidance > 0):
            raise InputError(f"--guidance {self.guidance} must be a positive number")
        if not (math.isfinite(self.shift) and self.shift > 0):
            raise InputError(f"--shift {self.shift} must be a positive number")
        if not (math.isfinite(self.fps) and self.fps > 0):
            raise InputError(f"--fps {self.fps} must be a positive number")
        if not valid_seed(self.seed):
            raise InputError(f"--seed {self.seed} must be from 0 to 2**64 - 1")

    @property
    def latent_shape(self) -> tuple[int, int, int, int, int]:
        """`[1, 48, 1 + (F − 1)/4, H/16, W/16]`."""
        return latent_shape(self.frames, self.height, self.width)


def resolve_settings(
    prompt: str,
    preset: Preset,
    *,
    negative_prompt: str | None = None,
    seed: int | None = None,
    frames: int | None = None,
    duration: float | None = None,
    height: int | None = None,
    width: int | None = None,
    fps: float | None = None,
    steps: int | None = None,
    guidance: float | None = None,
    shift: float | None = None,
    image: str | Path | None = None,
) -> GenerationSettings:
    """Preset < overrides; `duration` (seconds) sets the frames from the fps. Checked (see `GenerationSettings.check`).

    Raises:
        InputError: both `frames` and `duration`, or any bad value.
    """
    if frames is not None and duration is not None:
        raise InputError("--frames and --duration both set the length", hint="pass one of them")
    fps = float(fps if fps is not None else preset.fps)
    if duration is not None:
        if not (math.isfinite(duration) and duration > 0):
            raise InputError(f"--duration {duration} must be a positive number of seconds")
        frames = frames_for_duration(duration, fps)
    settings = GenerationSettings(
        prompt=prompt.strip() if isinstance(prompt, str) else "",
        negative_prompt=negative_prompt if negative_prompt is not None else preset.negative_prompt,
        seed=seed if seed is not None else preset.seed,
        frames=frames if frames is not None else preset.frames,
        height=height if height is not None else preset.height,
        width=width if width is not None else preset.width,
        fps=fps,
        steps=steps if steps is not None else preset.steps,
        guidance=float(guidance if guidance is not None else preset.guidance),
        shift=float(shift if shift is not None else preset.flow_shift),
        image=Path(image) if image is not None else None,
    )
    settings.check()
    return settings


@dataclass
class GenerationJob:
    """One video: its settings and where it goes (all optional: frames are returned in memory)."""

    settings: GenerationSettings
    output: Path | None = None
    latents_path: Path | None = None
    sidecar: bool = True
    overwrite: bool = False
    crf: int = DEFAULT_CRF
    return_frames: bool = True
    metadata: dict = field(default_factory=dict)  # extra sidecar entries (preset, overrides, name)
    redo_leftovers: bool = False  # replace a sidecar / latents file whose MP4 is missing (`--skip-existing`)


@dataclass
class GenerationResult:
    """What one job produced: uint8 frames `[F, H, W, 3]` on the host (if asked), the normalised latents, per-stage seconds and peak GPU memory."""

    job: GenerationJob
    frames: torch.Tensor | None = None
    latents: torch.Tensor | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    peak_gpu_gib: dict[str, float] = field(default_factory=dict)  # per stage, CUDA only
    output: Path | None = None
    sidecar: Path | None = None
    latents_path: Path | None = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def sidecar_path(output: Path) -> Path:
    """`video.mp4` → `video.json`."""
    return output.with_suffix(".json")
