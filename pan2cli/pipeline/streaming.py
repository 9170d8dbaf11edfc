"""Step 4 of `VideoGenerator.generate_batch`: the denoised jobs become written videos, one after another.

`BatchStream` is a part of `VideoGenerator` (its base class), kept here because it is one job of its own: per job,
denoise, decode, write (MP4, latents file, sidecar, in an order that never shows a video without its sidecar) and
hand the result over; the decoder beside the transformer where it fits (`pan2cli.pipeline.memory`), else every
job's latents kept until the transformer is gone; a video that cannot be written keeps its latents and says how to
finish it (`pan2cli.pipeline.job_outputs`). It uses the generator's stages and helpers (`sample`, `_timed`,
`_run_job`, `sidecar`, ...).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from pan2cli import distributed
from pan2cli.atomic import replace_into, write_text
from pan2cli.constants import video_frames
from pan2cli.errors import InputError, Pan2Error
from pan2cli.pipeline.job_outputs import (
    finishing_hint,
    keep_latents,
    latents_payload,
    remove_quietly,
    save_latents,
    with_hint,
)
from pan2cli.pipeline.jobs import GenerationResult, sidecar_path
from pan2cli.pipeline.memory import decoder_fits_beside_transformer, decoder_need
from pan2cli.vae.decoder import decode_latents, open_decoder
from pan2cli.video import open_video_writer


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


class BatchStream:
    """Step 4 of `generate_batch` (module docstring); a base class of `VideoGenerator`, not used alone."""

    def _make_videos(self, results: list[GenerationResult], shared: bool, on_result) -> None:
        """4. of `generate_batch`: each job denoised, decoded, written and handed to `on_result` in turn."""
        for result in results:
            if result.error is not None:  # failed in 1 or 2: said now, before the long part
                on_result(result)
        todo = [r for r in results if r.error is None]
        decoder = None  # loaded at the first decode, kept to the end
        beside = None  # whether the decoder stays beside the transformer; decided after the first denoising
        # denoised, their latents kept, decoded once the transformer is gone
        waiting: list[GenerationResult] = []
        try:
            for i, result in enumerate(todo):
                if self._appeared(result, shared):
                    on_result(result)
                    continue
                self._denoise(result, shared)
                last = i == len(todo) - 1
                if last:
                    self._release_dit()  # before the last video's decode, as for a batch of one
                if result.error is not None:
                    on_result(result)
                    continue
                if not last and beside is None:
                    beside = self._decoder_fits_beside_transformer(todo[i:], shared)
                if not last and not beside:
                    if (why := self._keep_latents(result)) is not None:
                        self.warn(f"the latents of {result.job.output} are kept in memory only: {why}")
                    waiting.append(result)
                    continue
                left = [*waiting, result, *todo[i + 1 :]]  # the videos the decoder is loaded for
                for ready in [*waiting, result]:
                    decoder = decoder or self._open_decoder(left, shared)
                    self._decode_and_write(decoder, ready, shared)
                    on_result(ready)
                waiting = []
            self._release_dit()
            for ready in waiting:  # the last job failed or was skipped
                decoder = decoder or self._open_decoder(waiting, shared)
                self._decode_and_write(decoder, ready, shared)
                on_result(ready)
            waiting = []
        except BaseException:
            self._say_kept(waiting)
            raise

    def _denoise(self, result: GenerationResult, shared: bool) -> None:
        """One job's sample (`result.latents`, on the host; under a shared job rank 0's, broadcast to every rank)."""
        settings = result.job.settings
        self._note_flow_shift(result.job)

        def work():
            result.time_to_first_step = time.perf_counter() - self._batch_start
            with self.progress(f"Denoising ({settings.steps} steps)", settings.steps, "steps") as advance:
                result.latents = self.sample(
                    self._dit, settings, *result._text, getattr(result, "_image_latent", None),
                    on_step=advance, split=shared,
                )  # fmt: skip

        self._run_job(result, "denoising", work)
        result._text = None
        if shared and result.latents is not None:
            # Every rank sampled the same latents; rank 0's are the ones everyone decodes (bit-identical decodes).
            result.latents = distributed.broadcast_from_main(result.latents)

    def _release_dit(self) -> None:
        if self._dit is not None:
            self._dit = None
            self._release()  # the DiT's memory goes back before the decode

    def _appeared(self, result: GenerationResult, shared: bool) -> bool:
        """A job whose output another process wrote since the batch began (`skip_existing`): skipped, not made."""
        job = result.job
        if shared or not job.skip_existing or job.output is None or not job.output.exists():
            return False
        result.skipped = True
        return True

    def _decoder_fits_beside_transformer(self, todo: list[GenerationResult], shared: bool) -> bool:
        """Whether the VAE decoder can load and decode beside the resident transformer, for the largest of the
        videos left (`pan2cli.pipeline.memory`); no is said in one line (every rank agrees on a shared job)."""
        from pan2cli.vae.checkpoint import read_decoder_tensors, resolve_vae_checkpoint
        from pan2cli.vae.kernel.build import why_not_applicable

        vae = read_decoder_tensors(resolve_vae_checkpoint(self.components.folder("vae")))
        kernel = (
            self.config.decode_kernel != "off" and why_not_applicable(self.device, self.vae_dtype) is None
        )
        largest = max(todo, key=lambda r: r.job.settings.height * r.job.settings.width).job.settings
        need = decoder_need(
            sum(math.prod(shape) for shape in vae.shapes.values()), vae.config.decoder_base_dim,
            largest.height, largest.width, self._chunk_latent_frames(), self.vae_dtype, kernel,
        )  # fmt: skip
        self._release()  # the last sample's activations are gone: what is left is the transformer
        fits, why = decoder_fits_beside_transformer(self.device, need, self.config.max_gpu_memory_gib)
        if shared:
            fits = distributed.agree_all(fits)
        if not fits:
            self.info(
                f"Decoding after the last video is denoised: {why or 'another rank has no room'}; each video's "
                "latents are written to its <name>.latents.pt meanwhile."
            )
        return fits

    def _keep_latents(self, result: GenerationResult) -> str | None:
        """Write a denoised video's latents where they can be found again (`job_outputs.keep_latents`), once, in the
        video's `write` seconds; returns None, or why they could not be written."""
        job = result.job
        if job.output is None or result.kept_latents is not None or result.latents is None:
            return None
        if self.ranks_share_jobs and not distributed.is_main():
            return None  # rank 0 writes a shared job's files
        try:
            with self._timed(result, "write"):
                result.kept_latents = keep_latents(job, latents_payload(result, self._vae_record()))
        except Pan2Error as exc:
            return str(exc)
        return None

    def _say_kept(self, waiting: list[GenerationResult]) -> None:
        """On the way out of an interrupted batch: the videos denoised but not written, and where their latents are."""
        vae = self.components.folder("vae")
        for result in waiting:
            if result.kept_latents is not None and result.error is None:
                self.warn(
                    f"{result.job.output} was not written; {finishing_hint(result.kept_latents, result.job, vae)}"
                )

    def _open_decoder(self, results: list[GenerationResult], shared: bool):
        """The VAE decoder (the compiled kernel where it runs), loaded once for `results`, the videos left."""
        cfg = self.config
        world = distributed.world_size()
        # Ranks split a decode by rows only when they share the job and sit on one machine.
        parallel = cfg.decode_kernel_parallel and shared and distributed.env_local_world_size(world) == world
        start = time.perf_counter()
        try:
            decoder, note = open_decoder(
                self.components.folder("vae"),
                dtype=self.vae_dtype,
                device=self.device,
                decode_kernel=cfg.decode_kernel,
                ranks_together=shared,
                say=self.info,
            )
        except Exception as exc:  # the batch stops: the latents of the video at hand are kept first
            if not shared or distributed.is_main():
                self._keep_after_failure(results[0], exc)
            if results[0].error is None or results[0].error is exc:
                raise
            raise results[0].error from exc
        if note:
            self.info(note)
        from pan2cli.vae.kernel.decoder import WanKernelDecoder

        self.decoder_path = "compiled kernel" if isinstance(decoder, WanKernelDecoder) else "reference"
        self.decode_rows_split = parallel
        alive = [r for r in results if r.error is None and not r.skipped]
        self._load_seconds(alive, "load_vae_decoder", time.perf_counter() - start)
        self._parallel_decode = parallel
        return decoder

    def _decode_and_write(self, decoder, result: GenerationResult, shared: bool) -> None:
        """Decode one denoised video and write its files (`_decode_one`); a video that cannot be written keeps its
        latents, and its error says where and how to finish it."""
        # Shared jobs: rank 0 writes; the others decode their rows (parallel) or nothing.
        writes = not shared or distributed.is_main()
        if writes or self._parallel_decode:  # timed inside: the decode, then the writes
            self._run_job(result, None, lambda: self._decode_one(decoder, result, writes))
        if writes and result.error is not None and not result.skipped:
            self._keep_after_failure(result, result.error)
        elif result.error is None and result.kept_latents not in (None, result.job.latents_path):
            remove_quietly(result.kept_latents)  # the video is written: its latents were kept for nothing
            result.kept_latents = None
        if self._dit is not None:
            self._release()  # the decode's cached blocks go back before the next denoising needs the room

    def _keep_after_failure(self, result: GenerationResult, error: BaseException) -> None:
        """`result` fails with `error`, its latents kept (`_keep_latents`) and the way to finish it in the hint."""
        result.error = error
        if result.job.output is None or result.latents is None:
            return
        why = self._keep_latents(result)
        hint = finishing_hint(result.kept_latents, result.job, self.components.folder("vae"), why)
        result.error = with_hint(error, hint)

    def _decode_one(self, decoder, result: GenerationResult, writes: bool) -> None:
        """The decode into the MP4's temporary file (ffmpeg encodes beside it), then the files in an order that never
        shows a video without its sidecar: the MP4's end, the latents file, the sidecar, and last the MP4's rename.
        An output that another process wrote meanwhile is skipped under `skip_existing` (else an error)."""
        job, settings = result.job, result.job.settings
        writer = None
        if writes and job.output is not None:
            if (
                not self.ranks_share_jobs
                and job.skip_existing
                and (job.output.exists() or job.output.is_symlink())
            ):
                result.skipped = True  # another batch wrote it while this one denoised it
                return
            writer = open_video_writer(job.output, "mp4", settings.fps, crf=job.crf, overwrite=job.overwrite)
        written: list[Path] = []  # beside the video in this attempt: removed if the video is not committed
        try:
            with distributed.partial_output(writer.tmp_path if writer is not None else None):
                sink = _FrameSink(job.return_frames and writes, writer)
                total = video_frames(result.latents.shape[2])
                with self._timed(result, "decode"), self.progress("Decoding", total, "frames") as advance:
                    decode_latents(
                        decoder, result.latents, sink if writes else None, normalized=True,
                        chunk_latent_frames=self._chunk_latent_frames(), split_rows=self._parallel_decode,
                        on_chunk=advance,
                    )  # fmt: skip
                result.frames = sink.frames()
                if not writes:
                    return
                with self._timed(result, "write"):
                    if writer is not None:
                        writer.finish()  # ffmpeg's last frames: the MP4 is complete under its temporary name
                        if writer.target_exists() and not job.overwrite:
                            if job.skip_existing:  # another batch wrote it meanwhile
                                writer.abort()
                                result.skipped = True
                                return
                            raise InputError(
                                f"output {job.output} already exists", hint="pass --overwrite to replace it"
                            )
                    if job.latents_path is not None and result.kept_latents != job.latents_path:
                        save_latents(job.latents_path, latents_payload(result, self._vae_record()))
                    if job.latents_path is not None:
                        result.kept_latents = result.latents_path = job.latents_path
                if writer is None:
                    return
                if job.sidecar:  # after the stages' seconds, before the video shows
                    path = sidecar_path(job.output)
                    replace_into(
                        path, lambda tmp: write_text(tmp, json.dumps(self.sidecar(result), indent=2) + "\n")
                    )
                    written.append(path)
                    result.sidecar = path
                writer.commit()
                result.output = job.output
        except BaseException:
            if writer is not None:
                writer.abort()
            for path in written:
                remove_quietly(path)
            result.sidecar = None
            raise

    def _vae_record(self) -> dict | None:
        """The identity of the pipeline's VAE for latents files (`pan2cli.vae.identity`), once; None when it cannot
        be read (the file then decodes with any VAE, as one written by another tool)."""
        if self._vae_identity is None:
            from pan2cli.vae.identity import vae_identity

            folder = self.components.folder("vae")
            try:
                identity = vae_identity(folder, name=str(folder))
            except Pan2Error:
                return None
            self._vae_identity = {
                **identity, "model": self.components.model_id, "model_revision": self.components.revision,
            }  # fmt: skip
        return self._vae_identity
