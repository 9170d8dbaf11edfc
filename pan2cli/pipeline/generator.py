"""`VideoGenerator`: prompt (and start image) → video, each model loaded once per batch, each video written as soon as
its denoising ends.

Stages (numbered as in `generate_batch`): 1. text encoding of every prompt (the text encoder is released after it;
the transformer is read in a background thread meanwhile where the device holds both, `BackgroundLoad`);
2. start images through the VAE encoder (image-to-video only); 3. the MMDiT loaded (`offload` streams its blocks
from host memory); 4. video by video: flow-matching Euler sampling on `[latents ; condition latents ; mask]`
(97 channels: `pan2cli.pipeline.conditioning`), the VAE decode chunk by chunk into uint8 host frames (one
device-to-host copy per chunk) and an MP4, and its JSON sidecar and `latents.pt`. The decoder stays beside the
transformer while videos are left to denoise (`pan2cli.pipeline.memory`); the transformer is released before the
last decode. A video that cannot be written keeps its latents (`pan2cli.pipeline.job_outputs`).

Several processes (torchrun): with `ranks_share_jobs` (one prompt, every rank given the same jobs)
every rank samples the same latents (rank 0's are broadcast) and the ranks of one machine split the
decode by rows (`decode_kernel_parallel`), rank 0 writing; otherwise (a sharded prompt file) each
rank generates and writes its own jobs alone.
"""

from __future__ import annotations

import gc
import os
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

import torch

from pan2cli import distributed
from pan2cli.components.locate import PAN2Components, resolve_components
from pan2cli.config import GenerationSettings, RuntimeConfig, settings_with
from pan2cli.dit.attention import attention_backend, attention_backends, attention_order
from pan2cli.dit.fp8_attention_choice import fp8_attention_ran, reset_fp8_attention_record
from pan2cli.errors import InputError, Pan2Error, out_of_memory
from pan2cli.outputs import DEFAULT_X264_PRESET, check_output_path
from pan2cli.pipeline.background import BackgroundLoad
from pan2cli.pipeline.conditioning import condition_latents
from pan2cli.pipeline.image import encode_image, fit_image, load_start_image
from pan2cli.pipeline.jobs import GenerationJob, GenerationResult, sidecar_path
from pan2cli.pipeline.memory import free_memory
from pan2cli.pipeline.sampling import denoise, initial_noise, split_ranks
from pan2cli.pipeline.streaming import BatchStream
from pan2cli.presets import DEFAULT_PRESET, Preset, load_preset, preset_label
from pan2cli.scheduler import uses_guidance
from pan2cli.version import __version__

# Progress hook: (description, total, unit) → context manager yielding `advance(n)`.
ProgressFactory = Callable[[str, int, str], "contextmanager"]


@contextmanager
def _no_progress(description: str, total: int, unit: str) -> Iterator[Callable[[int], None]]:
    yield lambda n=1: None


# Room left beside the text encoder and the transformer for the text encoder's activations and the allocator.
OVERLAP_MARGIN_BYTES = 4 * 2**30


def seconds_since_process_start() -> float | None:
    """How long this process has run (Linux: `/proc`; None elsewhere), to 1/CLK_TCK (10 ms)."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
            return float(uptime.read().split()[0]) - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _rounded(entry: dict) -> dict:
    """A shared load's sidecar entry with its seconds rounded."""
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in entry.items()}


class VideoGenerator(BatchStream):
    """The PAN 2 pipeline. Build with `from_pretrained`, then call `generate` (or `generate_batch`).

    Args:
        components: the located checkpoint (`resolve_components`).
        config: how the models run (`RuntimeConfig`).
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
        self.fp8_attention: dict | None = (
            None  # what the last sample's fp8 attention ran (`fp8_attention_ran`)
        )
        self.progress = progress or _no_progress
        self.info = info or (lambda line: None)
        self.warn = warn or (lambda line: warnings.warn(line, stacklevel=3))
        self.dit_config = dict(components.transformer_arguments)  # checked by resolve_components
        self.attention: str | None = None  # the SDPA backend of the last sample (pan2cli.dit.attention)
        # What ran in the last batch, for the sidecar: the DiT's fused kernels, the decoder, the split over processes.
        self.dit_fused_kernels: bool | None = None
        self.decoder_path: str | None = None
        self.decode_rows_split = False
        self.ranks_share_jobs = False
        self._shift_notes: set[tuple[float, str]] = set()  # each flow-shift note said once
        self.memory_plan = None  # the batch's `pan2cli.pipeline.memory_plan.MemoryPlan` (on a GPU)
        # `time_to_first_step` counts from here: the command's start where the CLI sets it, else each batch's.
        self.clock_start: float | None = None
        self._dit = None  # the transformer while a batch denoises
        self._parallel_decode = False  # the decode of a shared job split by rows (`_open_decoder`)
        self._vae_identity: dict | None = None  # for latents files (`_vae_record`)
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
            output: also write an MP4 there (and a JSON sidecar beside it).
            save_latents: also write the normalised latents (`pan2 decode` reads the file).

        Returns:
            A `GenerationResult` whose `frames` are uint8 `[F, H, W, 3]` on the host.

        Raises:
            InputError: bad settings or paths (before any model loads); any error of the run.
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
        result = self.generate_batch([job])[0]
        if result.error is not None:
            raise result.error
        return result

    def check_job(self, job: GenerationJob) -> None:
        """Inputs that can be checked before any model loads (the settings are, on construction): the schedule
        with the checkpoint's options, start image, output paths.

        Raises:
            InputError: the first problem found; it starts with `job.origin` when the job has one (a
                prompt-file record: the batch reports it and makes the others).
        """
        try:
            self._check_job(job)
        except InputError as exc:
            if job.origin is None:
                raise
            raise InputError(f"{job.origin}: {exc}", hint=exc.hint) from exc

    def _check_job(self, job: GenerationJob) -> None:
        self.components.scheduler.sigmas(job.settings.steps, self.flow_shift(job.settings)[0])
        if job.settings.image is not None:
            load_start_image(job.settings.image, "--image" if job.origin is None else "'image'")
        if job.skip_existing and job.output is not None and job.output.exists():
            return  # written by another process since the batch was planned: skipped when its turn comes
        if job.output is not None:
            check_output_path(job.output, job.overwrite)
        # The sidecar and latents beside an MP4 that does not exist are left from a run that did not finish
        # (or whose video was deleted): redoing the video replaces them when the caller says so.
        extras_overwrite = job.overwrite or (
            job.redo_leftovers and job.output is not None and not job.output.exists()
        )
        if job.latents_path is not None:
            check_output_path(job.latents_path, extras_overwrite)
        if job.output is not None and job.sidecar:
            check_output_path(sidecar_path(job.output), extras_overwrite)

    def generate_batch(
        self,
        jobs: list[GenerationJob],
        *,
        ranks_share_jobs: bool = True,
        on_result: Callable[[GenerationResult], None] | None = None,
    ) -> list[GenerationResult]:
        """Run every job, loading each model once; each video is written, and `on_result` called with it, as soon
        as its denoising ends; a job that fails is recorded in its result and the others go on.

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
            ranks_share_jobs: under torchrun, whether every rank was given the same jobs (they then
                cooperate: same latents, decode split by rows, rank 0 writes); False for a sharded batch, whose
                ranks each stream their own jobs.
            on_result: called with each result when its video is written (or has failed, or was skipped).

        Raises:
            Pan2Error: a model failed to load (not a per-job failure).
        """
        results = [GenerationResult(job) for job in jobs]
        shared = ranks_share_jobs and distributed.world_size() > 1
        self.ranks_share_jobs = shared
        self._batch_start = time.perf_counter() if self.clock_start is None else self.clock_start
        # The text encoder's weights are read in the background while the tokenizer loads, and the
        # transformer's during 1 and 2 where the device holds both models (the threads end with the batch's
        # first failure or a Ctrl-C: `BackgroundLoad`).
        self._plan_memory([r.job.settings for r in results if r.error is None])
        text_tensors = self._start_text_read()
        transformer = self._start_transformer_load(after=text_tensors)
        with text_tensors, transformer if transformer is not None else nullcontext():
            # 1. Text encoding
            self._encode_texts(results, transformer, text_tensors)
            # 2. Start images (image-to-video)
            self._encode_images(results, transformer)
            # 3. The transformer
            self._dit = self._load_dit(results, transformer)
        # 4. Each video: denoised, decoded, written, handed over
        try:
            self._make_videos(results, shared, on_result or (lambda result: None))
        finally:
            self._dit = None
            self._release()
        return results

    # -- stages -----------------------------------------------------------------------------------------
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

    def _run_job(self, result: GenerationResult, stage: str | None, work: Callable[[], None]) -> None:
        """Run one job's stage, timed as `stage` (None: `work` times its own parts, or nothing); a failure is the
        job's (recorded, the batch goes on), Ctrl-C is everyone's."""
        if result.error is not None:
            return
        try:
            with self._timed(result, stage) if stage is not None else nullcontext():
                work()
        except (Pan2Error, ValueError, RuntimeError, OSError) as exc:
            if distributed.is_comm_error(exc):
                raise
            result.error = exc
            self._release()

    def _load_seconds(self, results: list[GenerationResult], stage: str, seconds: float, **overlap) -> None:
        """A model loaded once for `results`: said once, as shared by them, not as a stage each one paid
        (`overlap`: `overlapped_with`, the stages it ran beside, and `waited`, the seconds they then waited)."""
        for result in results:
            result.shared_loads[stage] = {"seconds": seconds, "videos": len(results), **overlap}

    def _start_text_read(self) -> BackgroundLoad:
        """The text encoder's tensors read to the device in the background (`read_text_tensors`)."""
        from pan2cli.text.checkpoint import read_text_tensors

        folder = self.components.folder("text_encoder")
        where = self._text_device()
        return BackgroundLoad(
            lambda tick: read_text_tensors(folder, where, on_tensor=tick),
            self.device,
            name="pan2-text-encoder-read",
        )

    def _text_device(self) -> torch.device:
        """Where the text model is read: the device, or host memory when the plan streams some of its layers."""
        plan = self.memory_plan
        return torch.device("cpu") if plan is not None and plan.text_encoder.streamed else self.device

    def _plan_memory(self, settings: list[GenerationSettings]) -> None:
        """The batch's memory plan (`pan2cli.pipeline.memory_plan`), before anything loads: said in one line, the
        cap applied; on the CPU none.

        Raises:
            InputError: no plan fits the GPU (or the cap), or the host lacks the memory it page-locks.
        """
        from pan2cli.dit.checkpoint import resolve_pan2_checkpoint
        from pan2cli.pipeline.planning import apply_cap, make_plan

        shapes = self._transformer_shapes = resolve_pan2_checkpoint(
            self.components.folder("transformer")
        ).shapes
        self._transformer_tensors = len(shapes)  # the load's progress bar counts them
        apply_cap(self.device, self.config.max_gpu_memory_gib)
        self.memory_plan = make_plan(
            self.config, self.device, settings, transformer_shapes=shapes,
            text_folder=self.components.folder("text_encoder"), dit_config=self.dit_config, dtype=self.dtype,
            vae_dtype=self.vae_dtype,
        )  # fmt: skip
        if self.memory_plan is not None:
            self.info(self.memory_plan.line())

    def _encode_texts(
        self,
        results: list[GenerationResult],
        transformer: BackgroundLoad | None,
        text_tensors: BackgroundLoad,
    ) -> None:
        from pan2cli.text.checkpoint import load_text_model, load_tokenizer
        from pan2cli.text.encoder import PAN2TextEncoder

        tokenizer = load_tokenizer(self.components.folder("tokenizer"))  # while the text read runs
        text_model = load_text_model(
            self.components.folder("text_encoder"),
            dtype=self.dtype,
            device=self._text_device(),
            tensors=text_tensors.result(),
        )
        plan = self.memory_plan
        if plan is not None and plan.text_encoder.streamed:  # some layers stream from host memory
            from pan2cli.pipeline.offload import LayerStreamer, stream_layers

            stream_layers(
                text_model, "layers", self.device, LayerStreamer(self.device, plan.text_encoder.streamed)
            )
        encoder = PAN2TextEncoder(tokenizer, text_model)
        text_model = None
        seconds = time.perf_counter() - text_tensors.started  # from the read's start: one stage
        self._load_seconds(results, "load_text_encoder", seconds)
        todo = [r for r in results if r.error is None]
        check = transformer.check if transformer is not None else (lambda: None)
        check()  # a transformer that cannot be read stops the batch now, not after every prompt is encoded

        def encode(prompt: str, what: str = "the prompt") -> torch.Tensor:
            features, cut = encoder.encode(prompt)
            if cut:  # the release keeps at most 1536 tokens after the chat template's user header
                short = prompt if len(prompt) <= 40 else prompt[:40] + "…"
                self.warn(
                    f"{what} {short!r} is {cut} tokens over the text encoder's limit of {encoder.max_length}; its last {cut} tokens were cut."
                )
            return features

        with self.progress("Encoding the prompts", len(todo), "prompts") as advance:
            for result in todo:
                settings = result.job.settings

                def work(result=result, settings=settings):
                    cond = encode(settings.prompt)
                    uncond = (
                        encode(settings.negative_prompt, "the negative prompt")
                        if uses_guidance(settings.guidance)
                        else None
                    )
                    result._text = (cond, uncond)

                self._run_job(result, "text_encoding", work)
                advance(1)
                check()
        encoder.release()
        encoder = None  # frees the model (the closures above share this variable, so no `del`)
        self._release()

    def _encode_images(self, results: list[GenerationResult], transformer: BackgroundLoad | None) -> None:
        todo = [r for r in results if r.error is None and r.job.settings.image is not None]
        if not todo:
            return
        if transformer is not None:
            transformer.check()
        from pan2cli.vae.checkpoint import load_vae_encoder

        start = time.perf_counter()
        encoder = load_vae_encoder(self.components.folder("vae"), dtype=self.vae_dtype, device=self.device)
        self._load_seconds(todo, "load_vae_encoder", time.perf_counter() - start)
        for result in todo:
            settings = result.job.settings

            def work(result=result, settings=settings):
                pixels = fit_image(load_start_image(settings.image), settings.height, settings.width)
                result._image_latent = encode_image(encoder, pixels)  # [1, 48, 1, h, w] fp32, normalised

            self._run_job(result, "image_encoding", work)
        encoder = None  # frees the encoder (the closure above shares this variable, so no `del`)
        self._release()

    def _start_transformer_load(self, after: BackgroundLoad) -> BackgroundLoad | None:
        """The transformer's load started in the background (`BackgroundLoad`) where the device has room for it
        beside the text encoder, its reads from the end of `after`'s (the text encoder's); else None (it loads
        after the text encoder is freed), said in one line."""
        from pan2cli.dit.checkpoint import loaded_bytes

        shapes = self._transformer_shapes  # read by `_plan_memory`
        if self.config.offload:
            self.info("Loading the transformer after the text encoder (--offload: one model at a time).")
            return None
        plan = self.memory_plan
        if plan is not None and (plan.transformer.streamed or plan.text_encoder.streamed):
            self.info(
                "Loading the transformer after the text encoder (the memory plan streams: one model at a time)."
            )
            return None
        dit_bytes = loaded_bytes(shapes, self.dtype, precision=self.config.precision)
        text_bytes = sum(
            p.stat().st_size for p in self.components.folder("text_encoder").glob("*.safetensors")
        )
        need = dit_bytes + text_bytes + OVERLAP_MARGIN_BYTES
        free, where = free_memory(self.device)
        if plan is not None and plan.cap_bytes is not None and free is not None and plan.cap_bytes < free:
            free, where = plan.cap_bytes, "--max-gpu-memory"
        if free is None or need > free:
            have = f"{free / 2**30:.1f} GiB free" if free is not None else "free memory unknown"
            self.info(
                f"Loading the transformer after the text encoder: both need {need / 2**30:.1f} GiB, {where} has {have}."
            )
            return None
        return BackgroundLoad(self._read_dit, self.device, name="pan2-transformer-load", after=after)

    def _read_dit(self, on_tensor: Callable[[], None] | None = None):
        """The transformer from its checkpoint, on the device but for the blocks the memory plan (or, on the CPU,
        `offload`) streams from host memory."""
        from pan2cli.dit.checkpoint import load_pan2_transformer
        from pan2cli.pipeline.offload import LayerStreamer, enable_block_offload

        cfg = self.config
        folder = self.components.folder("transformer")
        layers = self.dit_config.get("num_layers", 44)
        if self.memory_plan is not None:
            streamed = self.memory_plan.transformer.streamed
        else:  # the CPU: the blocks are in host memory already; --offload streams them to the CPU all the same
            streamed = range(layers) if cfg.offload else ()
        # fp8: each block quantised on the GPU as it is read (the bf16 model is never whole there); a block that
        # streams goes to host memory as soon as it is read (`LayerStreamer.stage`).
        streamer = LayerStreamer(self.device, streamed) if streamed else None
        model = load_pan2_transformer(
            folder, dtype=self.dtype, device=self.device, precision=cfg.precision, on_tensor=on_tensor,
            on_block=streamer.stage if streamer is not None else None,
        )  # fmt: skip
        if streamer is not None:
            enable_block_offload(model, self.device, streamer=streamer).compact_resident()
        return model

    def _prepare_dit(self, model):
        """The loaded transformer's kernels chosen (fused Triton ops where they run) and the fp8 attention named."""
        from pan2cli.dit.fusions import set_fused_kernels, triton_available

        cfg = self.config
        if cfg.precision == "fp8":  # the fp8 attention chosen once for the run (built now where it is ours)
            from pan2cli.dit.fp8_attention_choice import resolve_fp8_attention, use_fp8_attention

            head_dim = self.dit_config.get("attention_head_dim", 128)
            choice = resolve_fp8_attention(cfg.fp8_attention, self.device, head_dim)
            use_fp8_attention(model, choice)
            if choice.fallback:
                self.info(f"fp8 attention: pan2's Triton kernel ({choice.reason}).")
        fused = False
        if cfg.dit_fused_kernels:
            head_dim = self.dit_config.get("attention_head_dim", 128)
            reason = None
            if self.device.type != "cuda":
                reason = None  # the reference ops are the CPU path; nothing to say
            elif not triton_available():
                reason = "Triton is not installed"
            elif head_dim & (head_dim - 1):
                reason = f"head_dim {head_dim} is not a power of two"
            else:
                fused = True
            if reason:
                self.info(f"Using the PyTorch DiT ops: {reason}.")
        set_fused_kernels(model, fused)
        self.dit_fused_kernels = fused  # what ran, for the sidecar
        return model

    def _load_dit(self, results: list[GenerationResult], transformer: BackgroundLoad | None):
        """The transformer, ready to sample (None, and its background read cancelled, when no job is left)."""
        todo = [r for r in results if r.error is None]
        if not todo:
            if transformer is not None:
                transformer.cancel()  # nothing left to sample
            return None
        start = time.perf_counter()
        with self.progress("Loading the transformer", self._transformer_tensors, "tensors") as advance:
            if transformer is not None:  # read in the background since the batch began
                transformer.wait(on_tick=advance)
                # taken: the load keeps no reference, so the model goes when the batch releases it
                model = transformer.take()
                overlapped = ["load_text_encoder", "text_encoding"]
                if any(r.job.settings.image is not None for r in results):
                    overlapped += ["load_vae_encoder", "image_encoding"]
                self._load_seconds(
                    todo, "load_transformer", transformer.seconds,
                    overlapped_with=overlapped, waited=time.perf_counter() - start,
                )  # fmt: skip
            else:
                model = self._read_dit(on_tensor=lambda: advance(1))
                self._load_seconds(todo, "load_transformer", time.perf_counter() - start)
        return self._prepare_dit(model)

    def flow_shift(self, settings: GenerationSettings, given_by: str | None = None) -> tuple[float, str]:
        """The flow shift a sample of `settings` runs and where it comes from: the settings' (a preset's or a
        flag's, named by `given_by`) over the checkpoint's `scheduler_config.json` (`SchedulerConfig.resolve_shift`)."""
        return self.components.scheduler.resolve_shift(settings.flow_shift, given_by)

    def _note_flow_shift(self, job: GenerationJob) -> None:
        """One line (once per value and source) when the shift that runs overrides the checkpoint's, or is
        diffusers' default because neither the settings nor the checkpoint set one."""
        shift, source = self.flow_shift(job.settings, job.flow_shift_source)
        checkpoint = self.components.scheduler
        if checkpoint.shift is not None and shift != checkpoint.shift:
            line = f"Flow shift {shift:g} from {source}; the checkpoint's {checkpoint.source} sets {checkpoint.shift:g}."
        elif checkpoint.shift is None and job.settings.flow_shift is None:
            line = f"Flow shift {shift:g}: {source}."
        else:
            return
        if (shift, source) not in self._shift_notes:
            self._shift_notes.add((shift, source))
            self.info(line)

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
        self.attention = self._attention_backend(model, shape, cond)
        reset_fp8_attention_record(model)
        with attention_backends():  # cuDNN SDPA first, falling through to flash, efficient, math
            latents = denoise(
                model, latents, condition, cond, uncond, sigmas, settings.guidance, scheduler.num_train_timesteps,
                split=split, on_step=on_step,
            )  # fmt: skip
        self.fp8_attention = fp8_attention_ran(model)  # what ran, not what was asked for
        if getattr(model, "precision", "bf16") == "fp8":  # a NaN/Inf activation gives NaN latents: say so
            from pan2cli.dit.fp8 import check_finite

            check_finite(latents, "the latents after denoising with --precision fp8")
        return latents.cpu()

    def _attention_backend(self, model, latent_shape, cond: torch.Tensor) -> str:
        """The SDPA backend of this sample's joint attention ([video; text] tokens), for the sidecar."""
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
        """The decoder's chunk: the configured one, or the memory plan's where that is smaller."""
        plan = self.memory_plan
        return plan.chunk_latent_frames if plan is not None else self.config.chunk_latent_frames

    def sidecar(self, result: GenerationResult) -> dict:
        """The JSON record of one video: settings (the start image by its absolute path), the job's metadata
        (preset, overrides and where each came from), model, versions, the run-time options as given (`config`)
        and what ran (`ran`: the DiT's fused kernels, the decoder), the processes and how they split the work,
        this video's seconds and peak GPU memory per stage (`write`: the MP4's end and the latents file), and
        the loads it shared with the other videos of the batch (`shared_loads`, each said once)."""
        settings = asdict(result.job.settings)
        settings["image"] = os.path.abspath(settings["image"]) if settings["image"] is not None else None
        # The shift that ran (the settings' or the checkpoint's) and where it came from.
        settings["flow_shift"], shift_source = self.flow_shift(
            result.job.settings, result.job.flow_shift_source
        )
        return {
            **settings,
            "flow_shift_source": shift_source,
            "crf": result.job.crf,  # the MP4's H.264 quality and x264's speed preset
            "x264_preset": DEFAULT_X264_PRESET,
            **result.job.metadata,
            "model": self.components.model_id,
            "revision": self.components.revision,
            "pan2cli_version": __version__,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "config": asdict(self.config),
            "generator_device": self.generator_device.type,  # where the initial noise was drawn
            "attention": self.attention,  # the SDPA backend of the denoising (pan2cli.dit.attention)
            # what stayed on the GPU and what streamed from host memory (pan2cli.pipeline.memory_plan); null on the CPU
            "memory_plan": self.memory_plan.record() if self.memory_plan is not None else None,
            "ran": {
                "dit_fused_kernels": self.dit_fused_kernels,
                "decoder": self.decoder_path,
                "precision": self._ran_precision(),
                "fp8_attention": self.fp8_attention,
            },  # fmt: skip
            "processes": self._processes(result.job.settings),
            "seconds": {k: round(v, 3) for k, v in result.seconds.items()},
            "peak_gpu_memory_gib": {k: round(v, 2) for k, v in result.peak_gpu_gib.items()},
            "shared_loads": {k: _rounded(v) for k, v in result.shared_loads.items()},
            # to this video's first denoising step, from the command's start (or the batch's: `time_to_first_step_from`)
            "time_to_first_step": round(result.time_to_first_step, 3)
            if result.time_to_first_step is not None
            else None,
            "time_to_first_step_from": "batch start" if self.clock_start is None else "command start",
        }

    def _ran_precision(self) -> str:
        """The DiT's arithmetic as it ran: "fp8", else its dtype ("bf16"; "float32" on the CPU, where
        `--precision bf16` runs the float32 model)."""
        if self.config.precision == "fp8":
            return "fp8"
        name = str(self.dtype).removeprefix("torch.")
        return "bf16" if name == "bfloat16" else name

    def _processes(self, settings: GenerationSettings) -> dict:
        """How many processes made the batch (`--gpus N`, torchrun) and how they split this video's work."""
        world = distributed.world_size()
        if world == 1:
            return {"count": 1}
        if not self.ranks_share_jobs:  # a sharded prompt file: each process makes its own videos
            return {"count": world, "split": "prompts", "rank": distributed.rank()}
        heads = self.dit_config.get("num_attention_heads", 32)
        groups = split_ranks(world, 2 if uses_guidance(settings.guidance) else 1)
        return {
            "count": world,
            "split": "one video",
            "cfg_parallel": len(groups) == 2,  # the two guidance passes on the two halves of the processes
            # processes per pass that split its tokens (Ulysses; 1 where the heads do not divide evenly)
            "sequence_parallel": [len(g) if len(g) >= 2 and heads % len(g) == 0 else 1 for g in groups],
            "decode_rows_split": self.decode_rows_split,
        }
