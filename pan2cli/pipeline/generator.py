"""`VideoGenerator`: prompt (and start image) → video, stage by stage, each model loaded once per batch.

Stages (numbered as in `generate_batch`): 1. text encoding (the text encoder is released after it);
2. start images through the VAE encoder (image-to-video only); 3. flow-matching Euler sampling with the
MMDiT on `[latents ; condition latents ; mask]` (97 channels: `pan2cli.pipeline.conditioning`),
released before the decode (`offload` streams its blocks from host memory); 4. VAE decode
chunk by chunk into uint8 host frames (one device-to-host copy per chunk) and, optionally, an MP4,
its JSON sidecar and a `latents.pt`.

Several processes (torchrun): with `ranks_share_jobs` (one prompt, every rank given the same jobs)
every rank samples the same latents (rank 0's are broadcast) and the ranks of one machine split the
decode by rows (`decode_kernel_parallel`), rank 0 writing; otherwise (a sharded prompt file) each
rank generates and writes its own jobs alone.
"""

from __future__ import annotations

import gc
import json
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import Callable, Iterator

import torch

import pan2cli
from pan2cli import distributed, launch
from pan2cli.atomic import replace_into
from pan2cli.config import GenerationSettings, RuntimeConfig, settings_with
from pan2cli.constants import video_frames
from pan2cli.dit.attention import attention_backend, attention_backends, attention_order
from pan2cli.errors import Pan2Error, out_of_memory
from pan2cli.outputs import check_output_path
from pan2cli.pipeline.components import PAN2Components, resolve_components
from pan2cli.pipeline.conditioning import condition_latents
from pan2cli.pipeline.image import encode_image, fit_image, load_image
from pan2cli.pipeline.jobs import GenerationJob, GenerationResult, sidecar_path
from pan2cli.pipeline.sampling import denoise
from pan2cli.pipeline.scheduler import flow_sigmas, uses_guidance
from pan2cli.presets import DEFAULT_PRESET, Preset, load_preset
from pan2cli.vae.decoder import decode_latents, open_decoder
from pan2cli.video import open_video_writer

# Progress hook: (description, total, unit) → context manager yielding `advance(n)`.
ProgressFactory = Callable[[str, int, str], "contextmanager"]


@contextmanager
def _no_progress(description: str, total: int, unit: str) -> Iterator[Callable[[int], None]]:
    yield lambda n=1: None


class _FrameSink:
    """Collects the decoder's host chunks (and passes them on to a file writer)."""

    def __init__(self, keep: bool, writer=None):
        self.keep, self.writer, self.chunks = keep, writer, []

    def write(self, frames: torch.Tensor) -> None:
        if self.keep:
            self.chunks.append(frames)
        if self.writer is not None:
            self.writer.write(frames)

    def frames(self) -> torch.Tensor | None:
        return torch.cat(self.chunks) if self.keep and self.chunks else None


class VideoGenerator:
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
        self.progress = progress or _no_progress
        self.info = info or (lambda line: None)
        self.warn = warn or (lambda line: warnings.warn(line, stacklevel=3))
        self.dit_config = dict(components.transformer_arguments)  # checked by resolve_components
        self.attention: str | None = None  # the SDPA backend of the last sample (pan2cli.dit.attention)
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
        job = GenerationJob(
            settings_with(preset, {**settings, "prompt": prompt}),
            output=Path(output) if output is not None else None,
            latents_path=Path(save_latents) if save_latents is not None else None,
            overwrite=overwrite,
            metadata={"preset": preset.name},
        )
        self.check_job(job)
        result = self.generate_batch([job])[0]
        if result.error is not None:
            raise result.error
        return result

    def check_job(self, job: GenerationJob) -> None:
        """Inputs that can be checked before any model loads (the settings are, on construction): start image, output paths."""
        if job.settings.image is not None:
            load_image(job.settings.image)
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
        """Run every job, loading each model once; a job that fails is recorded in its result and the others go on.

        Args:
            jobs: the videos to make (checked with `check_job` beforehand).
            ranks_share_jobs: under torchrun, whether every rank was given the same jobs (they then
                cooperate: same latents, decode split by rows, rank 0 writes); False for a sharded batch.
            on_result: called with each result when its video is done (or has failed).

        Raises:
            Pan2Error: a model failed to load (not a per-job failure).
        """
        results = [GenerationResult(job) for job in jobs]
        shared = ranks_share_jobs and distributed.world_size() > 1
        # 1. Text encoding
        self._encode_texts(results)
        # 2. Start images (image-to-video)
        self._encode_images(results)
        # 3. Sampling
        self._sample(results, shared)
        # 4. Decode and write
        self._decode(results, shared, on_result)
        return results

    # -- stages -----------------------------------------------------------------------------------------
    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

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
                exc, f"during {stage.replace('_', ' ')}", hint="pass --offload, or a smaller size or duration"
            ) from exc
        finally:
            self._sync()
            result.seconds[stage] = result.seconds.get(stage, 0.0) + time.perf_counter() - start
            if cuda:
                peak = torch.cuda.max_memory_allocated(self.device) / 2**30
                result.peak_gpu_gib[stage] = max(result.peak_gpu_gib.get(stage, 0.0), peak)

    def _run_job(self, result: GenerationResult, stage: str, work: Callable[[], None]) -> None:
        """Run one job's stage; a failure is the job's (recorded, the batch goes on), Ctrl-C is everyone's."""
        if result.error is not None:
            return
        try:
            with self._timed(result, stage):
                work()
        except (Pan2Error, ValueError, RuntimeError, OSError) as exc:
            if distributed.is_comm_error(exc):
                raise
            result.error = exc
            self._release()

    def _load_seconds(self, results: list[GenerationResult], stage: str, seconds: float) -> None:
        for result in results:
            result.seconds[stage] = seconds

    def _encode_texts(self, results: list[GenerationResult]) -> None:
        from pan2cli.pipeline.text import PAN2TextEncoder

        start = time.perf_counter()
        encoder = PAN2TextEncoder.load(
            self.components.folder("text_encoder"),
            self.components.folder("tokenizer"),
            dtype=self.dtype,
            device=self.device,
        )
        self._load_seconds(results, "load_text_encoder", time.perf_counter() - start)
        todo = [r for r in results if r.error is None]

        def encode(prompt: str) -> torch.Tensor:
            features, cut = encoder.encode(prompt)
            if cut:  # the release keeps at most 1536 tokens after the chat template's user header
                short = prompt if len(prompt) <= 40 else prompt[:40] + "…"
                self.warn(
                    f"the prompt {short!r} is {cut} tokens over the text encoder's limit of {encoder.max_length}; its last {cut} tokens were cut."
                )
            return features

        with self.progress("Encoding the prompts", len(todo), "prompts") as advance:
            for result in todo:
                settings = result.job.settings

                def work(result=result, settings=settings):
                    cond = encode(settings.prompt)
                    uncond = encode(settings.negative_prompt) if uses_guidance(settings.guidance) else None
                    result._text = (cond, uncond)

                self._run_job(result, "text_encoding", work)
                advance(1)
        encoder.release()
        encoder = None  # frees the model (the closures above share this variable, so no `del`)
        self._release()

    def _encode_images(self, results: list[GenerationResult]) -> None:
        todo = [r for r in results if r.error is None and r.job.settings.image is not None]
        if not todo:
            return
        from pan2cli.vae.checkpoint import load_vae_encoder

        start = time.perf_counter()
        encoder = load_vae_encoder(self.components.folder("vae"), dtype=self.vae_dtype, device=self.device)
        self._load_seconds(todo, "load_vae_encoder", time.perf_counter() - start)
        for result in todo:
            settings = result.job.settings

            def work(result=result, settings=settings):
                pixels = fit_image(load_image(settings.image), settings.height, settings.width)
                result._image_latent = encode_image(encoder, pixels)  # [1, 48, 1, h, w] fp32, normalised

            self._run_job(result, "image_encoding", work)
        encoder = None  # frees the encoder (the closure above shares this variable, so no `del`)
        self._release()

    def _load_dit(self):
        from pan2cli.dit.checkpoint import load_pan2_transformer
        from pan2cli.dit.fusions import set_fused_kernels, triton_available
        from pan2cli.pipeline.offload import enable_block_offload

        cfg = self.config
        folder = self.components.folder("transformer")
        if cfg.offload:
            model = load_pan2_transformer(folder, dtype=self.dtype, device="cpu")
            enable_block_offload(model, self.device)
        else:
            model = load_pan2_transformer(folder, dtype=self.dtype, device=self.device)
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
        return model

    def _sample(self, results: list[GenerationResult], shared: bool) -> None:
        todo = [r for r in results if r.error is None]
        if not todo:
            return
        start = time.perf_counter()
        model = self._load_dit()
        self._load_seconds(todo, "load_transformer", time.perf_counter() - start)
        for result in todo:
            settings = result.job.settings

            def work(result=result, settings=settings):
                with self.progress(f"Denoising ({settings.steps} steps)", settings.steps, "steps") as advance:
                    result.latents = self.sample(
                        model,
                        settings,
                        *result._text,
                        getattr(result, "_image_latent", None),
                        on_step=advance,
                        split=shared,
                    )

            self._run_job(result, "denoising", work)
            result._text = None
        model = None  # frees the transformer (the closure above shares this variable, so no `del`)
        self._release()  # the DiT's memory goes back before the decode
        if shared:
            # Every rank sampled the same latents; rank 0's are the ones everyone decodes (bit-identical decodes).
            for result in results:
                if result.latents is not None:
                    result.latents = distributed.broadcast_from_main(result.latents)

    @torch.inference_mode()
    def sample(
        self, model, settings: GenerationSettings, cond: torch.Tensor, uncond: torch.Tensor | None,
        image_latent: torch.Tensor | None = None, on_step=None, split: bool = False,
    ) -> torch.Tensor:  # fmt: skip
        """Flow-matching Euler with classifier-free guidance; returns normalised latents `[1, 48, T, h, w]` float32 on the host.

        The seed contract: the initial noise is `torch.randn(shape, generator=torch.Generator("cpu").manual_seed(seed),
        dtype=torch.float32)`, so a seed gives the same video on any device. The latents stay float32
        through the loop and enter the model (with the condition) in its dtype, one timestep σ·1000 for
        the whole sample; the prediction comes back to float32 for the guidance and the step.

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
        generator = torch.Generator(device="cpu").manual_seed(settings.seed)
        latents = torch.randn(shape, generator=generator, dtype=torch.float32).to(self.device)
        condition = condition_latents(shape, image_latent).to(self.device, self.dtype)  # [1, 49, T, h, w]
        sigmas = flow_sigmas(settings.steps, settings.flow_shift).tolist()
        self.attention = self._attention_backend(model, shape, cond)
        with attention_backends():  # cuDNN SDPA first, falling through to flash, efficient, math
            latents = denoise(
                model, latents, condition, cond, uncond, sigmas, settings.guidance, self.components.num_train_timesteps,
                split=split, on_step=on_step,
            )  # fmt: skip
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

    def _load_decoder(self, shared: bool):
        cfg = self.config
        world = distributed.world_size()
        # Ranks split a decode by rows only when they share the job and sit on one machine.
        parallel = cfg.decode_kernel_parallel and shared and launch.env_local_world_size(world) == world
        decoder, note = open_decoder(
            self.components.folder("vae"),
            dtype=self.vae_dtype,
            device=self.device,
            decode_kernel=cfg.decode_kernel,
            ranks_together=shared,
            say=self.info,
        )
        if note:
            self.info(note)
        return decoder, parallel

    def _decode(self, results: list[GenerationResult], shared: bool, on_result) -> None:
        todo = [r for r in results if r.error is None]
        if todo:
            start = time.perf_counter()
            decoder, parallel = self._load_decoder(shared)
            self._load_seconds(todo, "load_vae_decoder", time.perf_counter() - start)
            # Shared jobs: rank 0 writes; the others decode their rows (parallel) or nothing.
            writes = not shared or distributed.is_main()
            decodes = writes or parallel
            for result in todo:
                if decodes:
                    self._run_job(
                        result,
                        "decode",
                        lambda result=result: self._decode_one(decoder, result, writes, parallel),
                    )
                if writes and result.error is None:
                    self._run_job(result, "write", lambda result=result: self._write_extras(result))
            del decoder
            self._release()
        for result in results:
            if on_result is not None:
                on_result(result)

    def _decode_one(self, decoder, result: GenerationResult, writes: bool, parallel: bool) -> None:
        job, settings = result.job, result.job.settings
        writing = (
            open_video_writer(job.output, "mp4", settings.fps, crf=job.crf, overwrite=job.overwrite)
            if writes and job.output is not None
            else nullcontext()
        )
        with writing as writer, launch.partial_output(writer.tmp_path if writer is not None else None):
            sink = _FrameSink(job.return_frames and writes, writer)
            total = video_frames(result.latents.shape[2])
            with self.progress("Decoding", total, "frames") as advance:
                decode_latents(
                    decoder,
                    result.latents,
                    sink if writes else None,
                    normalized=True,
                    chunk_latent_frames=self.config.chunk_latent_frames,
                    split_rows=parallel,
                    on_chunk=advance,
                )
        result.frames = sink.frames()
        result.output = job.output if writes else None

    def _write_extras(self, result: GenerationResult) -> None:
        job, settings = result.job, result.job.settings
        if job.latents_path is not None:
            data = {
                "latents": result.latents[0].contiguous(), "fps": float(settings.fps), "height": settings.height,
                "width": settings.width, "frames": settings.frames, "seed": settings.seed, "prompt": settings.prompt,
            }  # fmt: skip
            replace_into(job.latents_path, lambda p: torch.save(data, p))
            result.latents_path = job.latents_path
        if job.output is not None and job.sidecar:
            path = sidecar_path(job.output)
            text = json.dumps(self.sidecar(result), indent=2) + "\n"
            replace_into(path, lambda p: p.write_text(text))
            result.sidecar = path

    def sidecar(self, result: GenerationResult) -> dict:
        """The JSON record of one video: settings, model, versions, per-stage seconds."""
        settings = asdict(result.job.settings)
        settings["image"] = str(settings["image"]) if settings["image"] is not None else None
        return {
            **settings,
            **result.job.metadata,
            "model": self.components.model_id,
            "revision": self.components.revision,
            "pan2cli_version": pan2cli.__version__,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "config": asdict(self.config),
            "attention": self.attention,  # the SDPA backend of the denoising (pan2cli.dit.attention)
            "seconds": {k: round(v, 3) for k, v in result.seconds.items()},
            "peak_gpu_memory_gib": {k: round(v, 2) for k, v in result.peak_gpu_gib.items()},
        }
