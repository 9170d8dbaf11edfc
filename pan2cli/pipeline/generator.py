"""`VideoGenerator`: prompt (and start image) → video, each model loaded once per batch, each video written as soon as
its denoising ends.

Stages (numbered as in `generate_batch`): 1. text encoding of every prompt (the text encoder is released after it;
the transformer is read in a background thread meanwhile where the device holds both, `BackgroundLoad`);
2. start images through the VAE encoder (image-to-video only); 3. the MMDiT loaded (`offload` streams its blocks
from host memory): 1-3 in `pan2cli.pipeline.loading`; 4. video by video: flow-matching Euler sampling on
`[latents ; condition latents ; mask]` (97 channels: `pan2cli.pipeline.conditioning`), the VAE decode chunk by chunk
into uint8 host frames and an MP4, and its JSON sidecar and `latents.pt` (`pan2cli.pipeline.streaming`). The decoder
stays beside the transformer while videos are left to denoise (`pan2cli.pipeline.memory`); the transformer is
released before the last decode. A video that cannot be written keeps its latents (`pan2cli.pipeline.job_outputs`).

A batch's run-time options are the generator's `config` with the preset's `precision` and `chunk_latent_frames`
where the config leaves them to it (`runtime_with`); how the batch runs is decided once, before anything loads
(`BatchRan`). Each job's intermediates are in its `JobState`.

Which failures are a job's own (recorded in its result; a batch goes on with the others): `PER_JOB_FAILURES`, pan2's
known failures (`Pan2Error`: bad input such as a start image that cannot be read or an output that exists, the GPU
out of memory, a write that failed, ffmpeg) and torch's out of memory. Anything else (a `TypeError`, an assertion, an
unexpected `RuntimeError`: a bug, or a failed collective) stops the batch; so does Ctrl-C.

Several processes (torchrun): with `ranks_share_jobs` (one prompt, every rank given the same jobs) every rank
samples the same latents (rank 0's are broadcast) and the ranks of one machine split the decode by rows
(`decode_kernel_parallel`), rank 0 writing; otherwise (a sharded prompt file) each rank generates and writes its
own jobs alone.
"""

from __future__ import annotations

import gc
import os
import time
import warnings
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Callable, Iterator

import torch

from pan2cli import distributed
from pan2cli.components.locate import PAN2Components, resolve_components
from pan2cli.config import GenerationSettings, RuntimeConfig, settings_with
from pan2cli.constants import MAX_FRAMES
from pan2cli.cuda_allocator import configure_cuda_allocator
from pan2cli.dit.attention import attention_backend, attention_backends, attention_order
from pan2cli.dit.fp8_attention_choice import reset_fp8_attention_record
from pan2cli.errors import Pan2Error, out_of_memory
from pan2cli.outputs import DEFAULT_CRF
from pan2cli.pipeline.batch_plan import BatchRequest
from pan2cli.pipeline.batch_run import BatchOutcome, BatchReport, run_batch
from pan2cli.pipeline.conditioning import condition_latents
from pan2cli.pipeline.jobs import GenerationJob, GenerationResult, JobState, check_job_inputs
from pan2cli.pipeline.loading import ModelStages
from pan2cli.pipeline.rounds import ChainRounds
from pan2cli.pipeline.sampling import denoise, initial_noise
from pan2cli.pipeline.sidecar import BatchRan, sidecar
from pan2cli.pipeline.streaming import BatchStream
from pan2cli.presets import DEFAULT_PRESET, Preset, load_preset, preset_label

# The failures that are one job's own (module docstring); anything else stops the batch.
PER_JOB_FAILURES = (Pan2Error, torch.OutOfMemoryError)


@contextmanager
def _no_progress(description: str, total: int, unit: str) -> Iterator[Callable[[int], None]]:
    yield lambda n=1: None


def seconds_since_process_start() -> float | None:
    """How long this process has run (Linux: `/proc`; None elsewhere), to 1/CLK_TCK (10 ms)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
            return float(uptime.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


class VideoGenerator(ModelStages, BatchStream, ChainRounds):
    """The PAN 2 pipeline. Build with `from_pretrained`, then call `generate` (one video), `generate_file` (a prompt
    file) or `generate_batch` (jobs).

    Args:
        components: the located checkpoint (`resolve_components`).
        config: how the models run (`RuntimeConfig`); its `precision` and `chunk_latent_frames` left None are the
            preset's (`runtime_with`).
        progress: optional progress factory `(description, total, unit) → context manager yielding advance(n)`.
        info: optional callable for one-line notes (fallbacks, load times).
        warn: optional callable for warnings that must be seen (a prompt cut to the text encoder's limit);
            Python's `warnings.warn` by default.
    """

    def __init__(
        self,
        components: PAN2Components,
        config: RuntimeConfig | None = None,
        progress=None,
        info=None,
        warn=None,
    ):
        self.components = components
        self.config = config or RuntimeConfig()
        self.device = self.config.torch_device()
        self.dtype = self.config.torch_dtype(self.device)
        self.vae_dtype = self.config.torch_vae_dtype(self.device)
        self.generator_device = self.config.torch_generator_device(self.device)  # where the noise is drawn
        self.config.check_precision(self.device)  # fp8 where it cannot run: bad input before anything loads
        if self.device.type == "cuda":
            configure_cuda_allocator()  # large blocks whole: a streamed plan's long videos fit their cap
        self.progress = progress or _no_progress
        self.info = info or (lambda line: None)
        self.warn = warn or (lambda line: warnings.warn(line, stacklevel=3))
        self.dit_config = dict(components.transformer_arguments)  # checked by resolve_components
        self._shift_notes: set[tuple[float, str]] = set()  # each flow-shift note said once
        # `time_to_first_step` counts from here: the command's start where the CLI sets it, else each batch's.
        self.clock_start: float | None = None
        self._vae_identity: dict | None = None  # for latents files (`_vae_record`)
        # The batch that runs: how it runs (decided once, before anything loads) and its transformer while it denoises.
        self._ran: BatchRan | None = None
        self._dit = None
        attention_order()  # a bad PAN2_ATTENTION is bad input before anything loads

    @classmethod
    def from_pretrained(
        cls,
        path_or_repo: str | Path | None = None,
        *,
        config: RuntimeConfig | None = None,
        revision: str | None = None,
        **kwargs,
    ) -> "VideoGenerator":
        """Locate a PAN 2 checkpoint (a folder, or a repo id fetched once; default `IFM/PAN2`); models load when used.

        Raises:
            CheckpointError / InputError (exit 2), DownloadError (exit 1): see `resolve_components`.
        """
        return cls(resolve_components(path_or_repo, revision), config, **kwargs)

    # -- public API ---------------------------------------------------------------------------------
    def generate(
        self,
        prompt: str,
        *,
        preset: str | Preset = DEFAULT_PRESET,
        output: str | Path | None = None,
        save_latents: str | Path | None = None,
        overwrite: bool = False,
        **settings,
    ) -> GenerationResult:
        """Generate one video.

        Args:
            prompt: the text.
            preset: a preset name or `Preset` (defaults `pan2-10s`); `settings` (any `GenerationSettings`
                field, and `duration` in seconds) replace its values (`settings_with`; None keeps the preset's).
                Its `precision` and `chunk_latent_frames` run unless the generator's config sets them.
            output: also write an MP4 there (and a JSON sidecar beside it).
            save_latents: also write the normalised latents (`pan2 decode` reads the file).

        Returns:
            A `GenerationResult` whose `frames` are uint8 `[F, H, W, 3]` on the host.

        Raises:
            InputError: bad settings, paths or run-time options (before any model loads); any error of the run.
        """
        preset = preset if isinstance(preset, Preset) else load_preset(preset)
        shift_given = settings.get("flow_shift") is not None
        job = GenerationJob(
            settings_with(preset, {**settings, "prompt": prompt}),
            output=Path(output) if output is not None else None,
            latents_path=Path(save_latents) if save_latents is not None else None,
            overwrite=overwrite,
            metadata={"preset": preset_label(preset)},
            flow_shift_source="the flow_shift argument" if shift_given else f"preset {preset.name}",
        )
        self.check_job(job)
        result = self.generate_batch([job], preset=preset)[0]
        if result.error is not None:
            raise result.error
        return result

    def generate_file(
        self,
        prompts_file: str | Path,
        *,
        preset: str | Preset = DEFAULT_PRESET,
        output: str | Path | None = None,
        save_latents: bool = False,
        overwrite: bool = False,
        skip_existing: bool = False,
        crf: int = DEFAULT_CRF,
        max_frames: int | None = MAX_FRAMES,
        continue_from: str | Path | None = None,
        on_result: Callable[[GenerationResult], None] | None = None,
        **settings,
    ) -> BatchOutcome:
        """Generate every prompt of a prompt file (`pan2cli.pipeline.prompts`), as `pan2 generate --prompts` does:
        `NNN_<name>.mp4` and its sidecar in `output` (an existing folder; default the current one), a record that
        cannot run or whose run fails reported and the others made, `skip_existing` resuming a batch. Under
        torchrun each rank makes its share of the records.

        Args:
            prompts_file: JSON, JSON Lines or plain text.
            preset, settings: as for `generate`; a record's fields win over `settings`.
            save_latents: also write each video's `<name>.latents.pt`.
            overwrite / skip_existing: replace existing outputs / skip them (not both).
            crf: the MP4's H.264 quality.
            max_frames: the longest video accepted (None: no bound).
            continue_from: a video (MP4) or `--save-latents` file whose last frame each chain's first round starts
                from (records that continue each other are chains: `pan2cli.pipeline.chains`).
            on_result: called with each video as soon as it is written.

        Returns:
            A `BatchOutcome`: the results, the failed records and prompts (each error naming the file and the
            record), the outputs skipped. Failed records and prompts are said through `warn`.

        Raises:
            InputError: an unreadable prompt file, a bad setting, an output folder that does not exist, bad
                run-time options (before any model loads).
        """
        request = BatchRequest(
            prompts_file=Path(prompts_file), output=output, preset=preset, settings=settings,
            save_latents=save_latents, overwrite=overwrite, skip_existing=skip_existing, crf=crf, max_frames=max_frames,
            continue_from=Path(continue_from) if continue_from is not None else None,
        )  # fmt: skip
        report = BatchReport(
            warning=self.warn,
            failed=lambda error, origin: self.warn(f"{origin} failed: {error}" if origin else str(error)),
            written=on_result or (lambda result: None),
        )
        return run_batch(request, self.config, lambda: self, report)

    def check_job(self, job: GenerationJob) -> None:
        """What can be checked of `job` before any model loads, against this checkpoint (`check_job_inputs`).

        Raises:
            InputError: the first problem found, starting with `job.origin` when the job has one.
        """
        check_job_inputs(job, self.components.scheduler)
        self._check_start_video(job)

    def generate_batch(
        self,
        jobs: list[GenerationJob],
        *,
        preset: Preset | None = None,
        ranks_share_jobs: bool = True,
        on_result: Callable[[GenerationResult], None] | None = None,
    ) -> list[GenerationResult]:
        """Run every job, loading each model once; each video is written, and `on_result` called with it, as soon
        as its denoising ends; a job that fails (`PER_JOB_FAILURES`) is recorded in its result and the others go on.

        The prompts are encoded first (then the text encoder is freed), then the start images; the transformer is
        read meanwhile where the device holds both. Then job by job: denoise, decode, write (MP4, latents file,
        sidecar), `on_result`. The VAE decoder loads at the first decode and stays beside the transformer while
        videos are left to denoise; the transformer is released before the last video's decode (one video's
        peak memory is the same as a batch's). Where the decoder does not fit beside the transformer
        (`decoder_fits_beside_transformer`, said in one line), every video is denoised first, each one's latents
        written to `<name>.latents.pt` at once, and decoded after the transformer is released. A batch that is
        interrupted keeps every video written; a video denoised but not written keeps its latents (`job_outputs`).

        Args:
            jobs: the videos to make (checked with `check_job` beforehand).
            preset: the preset whose `precision` and `chunk_latent_frames` run where the config leaves them to it
                (`runtime_with`); None: the defaults.
            ranks_share_jobs: under torchrun, whether every rank was given the same jobs (they then
                cooperate: same latents, decode split by rows, rank 0 writes); False for a sharded batch, whose
                ranks each stream their own jobs.
            on_result: called with each result when its video is written (or has failed, or was skipped).

        Raises:
            InputError: run-time options that cannot run here (the preset's fp8 on the CPU), or no memory plan fits
                (before anything loads).
            Pan2Error: a model failed to load (not a per-job failure).
            Exception: anything not in `PER_JOB_FAILURES` raised by a job's run (a bug): the batch stops.
        """
        states = [JobState(GenerationResult(job)) for job in jobs]
        shared = ranks_share_jobs and distributed.world_size() > 1
        self._ran, shapes = self._decide_batch([s.job.settings for s in states], preset, shared)
        # The text encoder's weights are read in the background while the tokenizer loads, and the
        # transformer's during 1 and 2 where the device holds both models (the threads end with the batch's
        # first failure or a Ctrl-C: `BackgroundLoad`).
        text_tensors = self._start_text_read()
        transformer = self._start_transformer_load(shapes, after=text_tensors)
        with text_tensors, transformer if transformer is not None else nullcontext():
            # 1. Text encoding
            self._encode_texts(states, transformer, text_tensors)
            # 2. Start images (image-to-video)
            self._encode_images(states, transformer)
            # 3. The transformer (read again only where a round needs its room for a decode: `_make_videos`)
            self._dit_tensors = len(shapes)
            self._dit = self._load_dit(states, transformer, len(shapes))
        # 4. Each video: denoised, decoded, written, handed over
        try:
            self._make_videos(states, on_result or (lambda result: None))
        finally:
            self._dit = None
            self._release()
        return [state.result for state in states]

    # -- helpers of the stages ------------------------------------------------------------------------
    def _sync(self) -> None:
        # This thread's stream only: a device-wide sync would also wait for the transformer's copies, queued
        # by its reading threads on streams of their own (which synchronise them before handing the model over).
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def _release(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @contextmanager
    def _timed(self, result: GenerationResult, stage: str) -> Iterator[None]:
        """Seconds of a stage, and on CUDA its peak allocated memory (the resident model included)."""
        self._sync()
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        start = time.perf_counter()
        try:
            yield
        except torch.OutOfMemoryError as exc:
            raise out_of_memory(
                exc,
                f"during {stage.replace('_', ' ')}",
                hint="pass --max-gpu-memory below what the GPU has (the plan then streams more), --offload, "
                "or a smaller size or duration",
            ) from exc
        finally:
            self._sync()
            result.seconds[stage] = result.seconds.get(stage, 0.0) + time.perf_counter() - start
            if cuda:
                peak = torch.cuda.max_memory_allocated(self.device) / 2**30
                result.peak_gpu_gib[stage] = max(result.peak_gpu_gib.get(stage, 0.0), peak)

    def _run_job(self, state: JobState, stage: str | None, work: Callable[[], None]) -> None:
        """Run one job's stage, timed as `stage` (None: `work` times its own parts, or nothing). A failure in
        `PER_JOB_FAILURES` is the job's (recorded, the batch goes on); anything else, Ctrl-C too, stops the batch."""
        if state.failed:
            return
        try:
            with self._timed(state.result, stage) if stage is not None else nullcontext():
                work()
        except PER_JOB_FAILURES as exc:
            if isinstance(exc, torch.OutOfMemoryError):  # outside a timed stage: said as pan2 says it
                exc = out_of_memory(exc, f"during {stage or 'the decode'}")
            state.result.error = exc
            self._release()

    def _load_seconds(self, states: list[JobState], stage: str, seconds: float, **overlap) -> None:
        """A model loaded once for `states`: said once, as shared by them, not as a stage each one paid
        (`overlap`: `overlapped_with`, the stages it ran beside, and `waited`, the seconds they then waited)."""
        for state in states:
            state.result.shared_loads[stage] = {"seconds": seconds, "videos": len(states), **overlap}

    def flow_shift(self, settings: GenerationSettings, given_by: str | None = None) -> tuple[float, str]:
        """The flow shift a sample of `settings` runs and where it comes from: the settings' (a preset's or a
        flag's, named by `given_by`) over the checkpoint's `scheduler_config.json` (`SchedulerConfig.resolve_shift`)."""
        return self.components.scheduler.resolve_shift(settings.flow_shift, given_by)

    @torch.inference_mode()
    def sample(
        self, model, settings: GenerationSettings, cond: torch.Tensor, uncond: torch.Tensor | None,
        image_latent: torch.Tensor | None = None, on_step=None, split: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """Flow-matching Euler with classifier-free guidance; returns normalised latents `[1, 48, T, h, w]` float32 on the host.

        The seed contract: the initial noise is `torch.randn(shape, generator=torch.Generator(generator_device)
        .manual_seed(seed), device=generator_device, dtype=torch.float32)` with the generator on the model's device
        unless `RuntimeConfig.generator_device` names another (`initial_noise`), as IFM's vLLM-Omni runner and
        the diffusers reference draw it. The schedule is the checkpoint's (`SchedulerConfig`) with the settings'
        shift when they give one. The latents stay float32 through the loop and enter the model (with the
        condition) in its dtype, one timestep σ·num_train_timesteps for the whole sample; the prediction comes
        back to float32 for the guidance and the step.

        Args:
            model: the PAN 2 transformer.
            settings: steps, flow_shift, guidance, seed, size.
            cond, uncond: `[1, L, text_embed_dim]` prompt and negative-prompt features (`uncond` None
                when guidance ≤ 1: the conditional prediction alone, as the release does).
            image_latent: `[1, 48, 1, h, w]` normalised latent of the start image (image-to-video): it
                conditions latent frame 0 through the condition channels; the noisy frame 0 is
                denoised like the others.
            on_step: called with 1 after each step (progress).
            split: every rank samples this video: they share its passes (CFG-parallel and sequence
                parallel, `pan2cli.pipeline.sampling`).
        """
        shape = settings.latent_shape
        latents = initial_noise(shape, settings.seed, self.generator_device, self.device, split=split)
        condition = condition_latents(shape, image_latent).to(self.device, self.dtype)  # [1, 49, T, h, w]
        scheduler = self.components.scheduler
        sigmas = scheduler.sigmas(settings.steps, self.flow_shift(settings)[0]).tolist()
        reset_fp8_attention_record(model)  # what it ran is read after the sample (`fp8_attention_ran`)
        with attention_backends():  # cuDNN SDPA first, falling through to flash, efficient, math
            latents = denoise(
                model, latents, condition, cond, uncond, sigmas, settings.guidance, scheduler.num_train_timesteps,
                split=split, on_step=on_step,
            )  # fmt: skip
        if getattr(model, "precision", "bf16") == "fp8":  # a NaN/Inf activation gives NaN latents: say so
            from pan2cli.dit.fp8 import check_finite

            check_finite(latents, "the latents after denoising with --precision fp8")
        return latents.cpu()

    def _attention_backend(self, model, latent_shape, cond: torch.Tensor) -> str:
        """The SDPA backend a sample's joint attention ([video; text] tokens) takes, for the sidecar."""
        config = model.config
        video_tokens = 1
        for size, patch in zip(latent_shape[2:], config.patch_size):
            video_tokens *= size // patch
        return attention_backend(
            self.device,
            self.dtype,
            config.num_attention_heads,
            config.attention_head_dim,
            video_tokens + cond.shape[1],
        )

    def _chunk_latent_frames(self) -> int:
        """The decoder's chunk: the batch's, or the memory plan's where that is smaller."""
        plan = self._ran.memory_plan
        return plan.chunk_latent_frames if plan is not None else self._ran.config.chunk_latent_frames

    def sidecar(self, result: GenerationResult) -> dict:
        """The JSON record of one video of the last batch (`pan2cli.pipeline.sidecar.sidecar`), as written beside it."""
        return sidecar(
            result, self._ran, components=self.components, device=self.device, dtype=self.dtype,
            generator_device=self.generator_device, heads=self.dit_config.get("num_attention_heads", 32),
        )  # fmt: skip
