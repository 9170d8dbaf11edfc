"""One video to make (`GenerationJob`: checked settings and where they go; a round of a chain, `ChainRound`), what
making it gave (`GenerationResult`), and the job on its way through a batch (`JobState`: its result and what the
stages hand each other)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from pan2cli.config import GenerationSettings
from pan2cli.constants import MAX_FRAMES
from pan2cli.errors import InputError, Pan2Error
from pan2cli.outputs import DEFAULT_CRF, check_output_path

if TYPE_CHECKING:
    import torch

    from pan2cli.pipeline.chain_frames import StartVideo
    from pan2cli.scheduler import SchedulerConfig


class RoundNotMade(Pan2Error):
    """A round not made because its chain stopped before it: its message names it and the round that stopped it."""


@dataclass(eq=False)
class Chain:
    """Videos that continue each other, made in order by one process: the `--continue-from` video (if any), then the
    rounds; and the stitched MP4 of them all, each seam frame once.

    Attributes:
        stitched: the stitched MP4 (`<first round's name>.chain.mp4`).
        rounds: each round's MP4, in order.
        source: the video the first round continues (`--continue-from`), or None.
        write_stitched: False where the stitched MP4 exists and `--skip-existing` keeps it.
        fps: the rounds' frame rate, the stitched video's.
    """

    stitched: Path
    rounds: list[Path]
    source: StartVideo | None = None
    write_stitched: bool = True
    fps: float = 24.0


@dataclass(eq=False)
class ChainRound:
    """A job's place in its chain, and where its start frame comes from.

    Attributes:
        chain: the chain.
        position: 0 for its first round.
        previous: the round before, made in the same batch: its last frame is handed over in memory (`JobState`).
        start_file: where the start frame is read when the round before was made earlier: its `.last.png` (the exact
            frame), else its MP4's last frame. None with `previous`, and for a first round (whose start frame is
            `chain.source`'s last, or its own image or none).
    """

    chain: Chain
    position: int
    previous: GenerationJob | None = None
    start_file: Path | None = None


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
    chain: ChainRound | None = None  # a round of a chain (`pan2cli.pipeline.chains`)

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
    stitched: Path | None = None  # the chain's stitched MP4, written after this round, its last here
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
    if job.chain is not None:
        _check_round(job, extras_overwrite)


def _check_round(job: GenerationJob, extras_overwrite: bool) -> None:
    """A round's own files: its `.last.png`, the frame it starts from when read from a file, and (for the first
    round of its chain made here) the stitched MP4."""
    from pan2cli.pipeline.chain_frames import last_frame_path, read_image_frame, read_last_frame

    link = job.chain
    if job.output is not None:
        check_output_path(last_frame_path(job.output), extras_overwrite)
    if link.start_file is not None and link.start_file.suffix.lower() == ".png":
        read_image_frame(link.start_file, "the round before's last frame")
    elif link.start_file is not None:
        read_last_frame(link.start_file, "the round before")
    if link.previous is None and link.chain.write_stitched:
        check_output_path(link.chain.stitched, job.overwrite)


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
            from the image encoding to the denoising, then dropped. A round that continues one of the batch gets it
            just before its denoising, from that round's `last_frame`.
        last_frame: a round's last frame, uint8 `[H, W, 3]` on the host, the exact frame its writer received: from its
            decode to the next round's start.
    """

    result: GenerationResult
    text: tuple[torch.Tensor, torch.Tensor | None] | None = None
    image_latent: torch.Tensor | None = None
    last_frame: torch.Tensor | None = None

    @property
    def job(self) -> GenerationJob:
        return self.result.job

    @property
    def failed(self) -> bool:
        return self.result.error is not None
