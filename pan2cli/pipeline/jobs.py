"""One video to make (`GenerationJob`: checked settings and where they go), what making it gave (`GenerationResult`),
and the job on its way through a batch (`JobState`: its result and what the stages hand each other)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pan2cli.config import GenerationSettings
from pan2cli.constants import MAX_FRAMES
from pan2cli.errors import InputError
from pan2cli.outputs import DEFAULT_CRF, check_output_path

if TYPE_CHECKING:
    import torch

    from pan2cli.scheduler import SchedulerConfig


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
    skip_existing: bool = False  # an output that another process writes meanwhile is skipped, not an error
    origin: str | None = (
        None  # where the job came from, starting its errors: "prompts.json: prompt 3 (003_a-cat)"
    )
    # who set `settings.flow_shift` ("--flow-shift", "preset NAME"), for the flow-shift note and the sidecar
    flow_shift_source: str | None = None
    # the longest video accepted (`--max-frames`); None: no bound
    max_frames: int | None = MAX_FRAMES

    def __post_init__(self) -> None:
        # A preset's settings have no prompt; a job's must (bad input before any model loads). Whitespace alone
        # counts as none; otherwise the prompt goes to the text encoder as it is.
        if not self.settings.prompt.strip():
            raise InputError(
                "the prompt is empty",
                hint='pass the text to generate from, e.g. pan2 generate "a cat on a skateboard"',
            )
        settings = self.settings
        if self.max_frames is not None and settings.frames > self.max_frames:
            raise InputError(
                f"a video of {settings.frames} frames ({settings.duration_s:.4g} s at {settings.fps:g} fps) is longer "
                f"than the limit of {self.max_frames} frames ({self.max_frames / settings.fps:.4g} s)",
                hint="pass --max-frames N (max_frames in the Python API) to allow longer videos; their memory and "
                "time grow with the length (the longest preset, pan2-20s, has 481 frames)",
            )


@dataclass
class GenerationResult:
    """What one job produced: uint8 frames `[F, H, W, 3]` on the host (if asked), the normalised latents, per-stage seconds and peak GPU memory."""

    job: GenerationJob
    frames: torch.Tensor | None = None
    latents: torch.Tensor | None = None
    seconds: dict[str, float] = field(default_factory=dict)
    peak_gpu_gib: dict[str, float] = field(default_factory=dict)  # per stage, CUDA only
    # A model loaded once for several videos: {"load_transformer": {"seconds": 9.1, "videos": 3}}, not in `seconds`;
    # a load run beside other stages also names them ("overlapped_with") and what the batch then waited ("waited").
    shared_loads: dict[str, dict] = field(default_factory=dict)
    # seconds from the command's (or the batch's) start to this video's first denoising step
    time_to_first_step: float | None = None
    output: Path | None = None
    sidecar: Path | None = None
    latents_path: Path | None = None
    # where the latents were written beside the output while (or because) the video could not be written yet
    kept_latents: Path | None = None
    skipped: bool = False  # another process wrote the output meanwhile (`GenerationJob.skip_existing`)
    error: BaseException | None = None
    # What ran for this video (the sidecar's): the SDPA backend of its denoising (`pan2cli.dit.attention`), what its fp8
    # attention ran (`fp8_attention_ran`; None in bf16), and the decoder that made its frames ("compiled kernel" or
    # "reference"); the rest is the batch's (`pan2cli.pipeline.sidecar.BatchRan`).
    attention: str | None = None
    fp8_attention: dict | None = None
    decoder: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def check_job_inputs(job: GenerationJob, scheduler: SchedulerConfig) -> None:
    """What can be checked of `job` before any model loads (its settings are, on construction): its schedule with the
    checkpoint's scheduler options, its start image, its output paths.

    Raises:
        InputError: the first problem found; it starts with `job.origin` when the job has one (a prompt-file record:
            the batch reports it and makes the others).
    """
    try:
        _check_inputs(job, scheduler)
    except InputError as exc:
        if job.origin is None:
            raise
        raise InputError(f"{job.origin}: {exc}", hint=exc.hint) from exc


def _check_inputs(job: GenerationJob, scheduler: SchedulerConfig) -> None:
    from pan2cli.pipeline.image import load_start_image

    scheduler.sigmas(job.settings.steps, scheduler.resolve_shift(job.settings.flow_shift)[0])
    if job.settings.image is not None:
        load_start_image(job.settings.image, "--image" if job.origin is None else "'image'")
    if job.skip_existing and job.output is not None and job.output.exists():
        return  # written by another process since the batch was planned: skipped when its turn comes
    if job.output is not None:
        check_output_path(job.output, job.overwrite)
    # The sidecar and latents beside an MP4 that does not exist are left from a run that did not finish (or whose
    # video was deleted): redoing the video replaces them when the caller says so.
    extras_overwrite = job.overwrite or (
        job.redo_leftovers and job.output is not None and not job.output.exists()
    )
    if job.latents_path is not None:
        check_output_path(job.latents_path, extras_overwrite)
    if job.output is not None and job.sidecar:
        check_output_path(sidecar_path(job.output), extras_overwrite)


def sidecar_path(output: Path) -> Path:
    """`video.mp4` → `video.json`."""
    return output.with_suffix(".json")


def latents_path_for(output: Path) -> Path:
    """`video.mp4` → `video.latents.pt` (`--save-latents`, and where a video's latents are kept when it cannot be
    written)."""
    return output.with_name(f"{output.stem}.latents.pt")


@dataclass
class JobState:
    """One job on its way through `VideoGenerator.generate_batch`: its result (what the caller gets) and what one
    stage hands the next.

    Attributes:
        result: the job and what it has produced so far (its `error` set when it failed).
        text: the prompt's and the negative prompt's features, `[1, L, text_dim]` each (the negative None without
            guidance); from the text encoding to the denoising, then dropped.
        image_latent: the start image's normalised latent `[1, 48, 1, h, w]` float32 (image-to-video), else None;
            from the image encoding to the denoising, then dropped.
    """

    result: GenerationResult
    text: tuple[torch.Tensor, torch.Tensor | None] | None = None
    image_latent: torch.Tensor | None = None

    @property
    def job(self) -> GenerationJob:
        return self.result.job

    @property
    def failed(self) -> bool:
        return self.result.error is not None
