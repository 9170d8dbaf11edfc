"""Step 4 of `VideoGenerator.generate_batch`: the denoised jobs become written videos, one after another.

`BatchStream` is a part of `VideoGenerator` (its base class), kept here because it is one job of its own: per job,
denoise, decode and write (`pan2cli.decoding.write.decode_and_write`: MP4, then latents file and sidecar before the
video shows) and hand the result over; the decoder beside the transformer where it fits (`pan2cli.pipeline.memory`),
else every job's latents kept until the transformer is gone; a video that cannot be written keeps its latents and
says how to finish it (`pan2cli.pipeline.job_outputs`). It uses the generator's stages and helpers (`sample`,
`_timed`, `_run_job`, `sidecar`, ...) and the batch's `BatchRan` (`self._ran`).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from pan2cli import distributed
from pan2cli.atomic import replace_into, write_text
from pan2cli.decoding.write import VideoTarget, decode_and_write
from pan2cli.dit.fp8_attention_choice import fp8_attention_ran
from pan2cli.errors import Pan2Error
from pan2cli.pipeline.job_outputs import (
    finishing_hint,
    keep_latents,
    latents_payload,
    remove_quietly,
    save_latents,
    with_hint,
)
from pan2cli.pipeline.jobs import JobState, sidecar_path
from pan2cli.pipeline.memory import decoder_fits_beside_transformer, decoder_need
from pan2cli.vae.decoder import open_decoder


class BatchStream:
    """Step 4 of `generate_batch` (module docstring); a base class of `VideoGenerator`, not used alone."""

    def _make_videos(self, states: list[JobState], report) -> None:
        """4. of `generate_batch`: each job denoised, decoded, written and handed to `report` in turn (a round of a
        chain starting from the last frame of the round before: `pan2cli.pipeline.rounds`)."""

        def on_result(result) -> None:
            self._round_reported(result)
            report(result)

        for state in states:
            if state.failed:  # failed in 1 or 2: said now, before the long part
                on_result(state.result)
        todo = [s for s in states if not s.failed]
        by_job = {id(s.job): s for s in states}
        self._rounds_begin(todo)
        decoder = None  # loaded at the first decode, kept to the end
        beside = None  # whether the decoder stays beside the transformer; decided after the first denoising
        # denoised, their latents kept, decoded once the transformer is gone
        waiting: list[JobState] = []
        try:
            for i, state in enumerate(todo):
                if self._appeared(state):
                    on_result(state.result)
                    continue
                self._start_round(state, by_job, todo[i:])
                self._denoise(state)
                last = i == len(todo) - 1
                if last:
                    self._release_dit()  # before the last video's decode, as for a batch of one
                if state.failed:
                    on_result(state.result)
                    continue
                if not last and beside is None:
                    beside = self._decoder_fits_beside_transformer(todo[i:])
                # a round that a later one starts from cannot wait for the transformer's end
                link = state.job.chain
                continued = link is not None and self._chain_last.get(id(link.chain)) is not state.job
                if not last and not beside and not continued:
                    if (why := self._keep_latents(state)) is not None:
                        self.warn(f"the latents of {state.job.output} are kept in memory only: {why}")
                    waiting.append(state)
                    continue
                if not last and not beside:  # decoded in the transformer's room, which is read again after
                    self.info(
                        f"Decoding {state.job.output.name} now, as the next round starts from it: the transformer is "
                        "released for its decode and read again."
                    )
                    self._release_dit()
                left = [*waiting, state, *todo[i + 1 :]]  # the videos the decoder is loaded for
                for ready in [*waiting, state]:
                    decoder = decoder or self._open_decoder(left)
                    self._decode_and_write(decoder, ready)
                    on_result(ready.result)
                waiting = []
                if self._dit is None and not last:
                    decoder = None
                    self._release()
                    self._dit = self._load_dit(todo[i + 1 :], None, self._dit_tensors)
            self._release_dit()
            for ready in waiting:  # the last job failed or was skipped
                decoder = decoder or self._open_decoder(waiting)
                self._decode_and_write(decoder, ready)
                on_result(ready.result)
            waiting = []
        except BaseException:
            self._say_kept(waiting)
            raise
        finally:
            self._rounds_end()

    def _denoise(self, state: JobState) -> None:
        """One job's sample (`result.latents`, on the host; under a shared job rank 0's, broadcast to every rank) and
        what its attention ran."""
        result, settings, shared = state.result, state.job.settings, self._ran.ranks_share_jobs
        self._note_flow_shift(state.job)

        def work():
            result.time_to_first_step = time.perf_counter() - self._ran.clock_start
            with self.progress(f"Denoising ({settings.steps} steps)", settings.steps, "steps") as advance:
                result.latents = self.sample(
                    self._dit, settings, *state.text, state.image_latent, on_step=advance, split=shared
                )
            result.attention = self._attention_backend(self._dit, settings.latent_shape, state.text[0])
            result.fp8_attention = fp8_attention_ran(self._dit)  # what ran, not what was asked for

        self._run_job(state, "denoising", work)
        state.text = state.image_latent = None
        if shared and result.latents is not None:
            # Every rank sampled the same latents; rank 0's are the ones everyone decodes (bit-identical decodes).
            result.latents = distributed.broadcast_from_main(result.latents)

    def _note_flow_shift(self, job) -> None:
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

    def _release_dit(self) -> None:
        if self._dit is not None:
            self._dit = None
            self._release()  # the DiT's memory goes back before the decode

    def _appeared(self, state: JobState) -> bool:
        """A job whose output another process wrote since the batch began (`skip_existing`): skipped, not made."""
        job = state.job
        if (
            self._ran.ranks_share_jobs
            or not job.skip_existing
            or job.output is None
            or not job.output.exists()
        ):
            return False
        state.result.skipped = True
        return True

    def _decoder_fits_beside_transformer(self, todo: list[JobState]) -> bool:
        """Whether the VAE decoder can load and decode beside the resident transformer, for the largest of the
        videos left (`pan2cli.pipeline.memory`); no is said in one line (every rank agrees on a shared job)."""
        from pan2cli.vae.checkpoint import read_decoder_tensors, resolve_vae_checkpoint
        from pan2cli.vae.kernel.build import why_not_applicable

        config = self._ran.config
        vae = read_decoder_tensors(resolve_vae_checkpoint(self.components.folder("vae")))
        kernel = config.decode_kernel != "off" and why_not_applicable(self.device, self.vae_dtype) is None
        largest = max(todo, key=lambda s: s.job.settings.height * s.job.settings.width).job.settings
        need = decoder_need(
            sum(math.prod(shape) for shape in vae.shapes.values()), vae.config.decoder_base_dim,
            largest.height, largest.width, self._chunk_latent_frames(), self.vae_dtype, kernel,
        )  # fmt: skip
        self._release()  # the last sample's activations are gone: what is left is the transformer
        fits, why = decoder_fits_beside_transformer(self.device, need, config.max_gpu_memory_gib)
        if self._ran.ranks_share_jobs:
            fits = distributed.agree_all(fits)
        if not fits:
            self.info(
                f"Decoding after the last video is denoised: {why or 'another rank has no room'}; each video's "
                "latents are written to its <name>.latents.pt meanwhile."
            )
        return fits

    def _keep_latents(self, state: JobState) -> str | None:
        """Write a denoised video's latents where they can be found again (`job_outputs.keep_latents`), once, in the
        video's `write` seconds; returns None, or why they could not be written."""
        job, result = state.job, state.result
        if job.output is None or result.kept_latents is not None or result.latents is None:
            return None
        if self._ran.ranks_share_jobs and not distributed.is_main():
            return None  # rank 0 writes a shared job's files
        try:
            with self._timed(result, "write"):
                result.kept_latents = keep_latents(job, latents_payload(result, self._vae_record()))
        except Pan2Error as exc:
            return str(exc)
        return None

    def _say_kept(self, waiting: list[JobState]) -> None:
        """On the way out of an interrupted batch: the videos denoised but not written, and where their latents are."""
        vae = self.components.folder("vae")
        for state in waiting:
            if state.result.kept_latents is not None and not state.failed:
                self.warn(
                    f"{state.job.output} was not written; {finishing_hint(state.result.kept_latents, state.job, vae)}"
                )

    def _open_decoder(self, states: list[JobState]):
        """The VAE decoder (the compiled kernel where it runs), loaded once for `states`, the videos left."""
        shared = self._ran.ranks_share_jobs
        start = time.perf_counter()
        try:
            decoder, note = open_decoder(
                self.components.folder("vae"), dtype=self.vae_dtype, device=self.device,
                decode_kernel=self._ran.config.decode_kernel, ranks_together=shared, say=self.info,
            )  # fmt: skip
        except Exception as exc:  # the batch stops: the latents of the video at hand are kept first
            first = states[0].result
            if not shared or distributed.is_main():
                self._keep_after_failure(states[0], exc)
            if first.error is None or first.error is exc:
                raise
            raise first.error from exc
        if note:
            self.info(note)
        alive = [s for s in states if not s.failed and not s.result.skipped]
        self._load_seconds(alive, "load_vae_decoder", time.perf_counter() - start)
        return decoder

    def _decode_and_write(self, decoder, state: JobState) -> None:
        """Decode one denoised video and write its files (`_decode_one`); a video that cannot be written keeps its
        latents, and its error says where and how to finish it."""
        result = state.result
        # Shared jobs: rank 0 writes; the others decode their rows (a row split) or nothing.
        writes = not self._ran.ranks_share_jobs or distributed.is_main()
        if writes or self._ran.decode_rows_split:  # timed inside: the decode, then the writes
            self._run_job(state, None, lambda: self._decode_one(decoder, state, writes))
        if writes and result.error is not None and not result.skipped:
            self._keep_after_failure(state, result.error)
        elif result.error is None and result.kept_latents not in (None, state.job.latents_path):
            remove_quietly(result.kept_latents)  # the video is written: its latents were kept for nothing
            result.kept_latents = None
        if writes and state.job.chain is not None:  # the stitched video, after its chain's last round here
            self._run_job(state, None, lambda: self._finish_chain(state))
        if self._dit is not None:
            self._release()  # the decode's cached blocks go back before the next denoising needs the room

    def _keep_after_failure(self, state: JobState, error: BaseException) -> None:
        """`state` fails with `error`, its latents kept (`_keep_latents`) and the way to finish it in the hint."""
        result = state.result
        result.error = error
        if state.job.output is None or result.latents is None:
            return
        why = self._keep_latents(state)
        hint = finishing_hint(result.kept_latents, state.job, self.components.folder("vae"), why)
        result.error = with_hint(error, hint)

    def _decode_one(self, decoder, state: JobState, writes: bool) -> None:
        """The decode into the MP4 (`decode_and_write`), then, before the video shows, its latents file and its
        sidecar. An output that another process wrote meanwhile is skipped under `skip_existing` (else an error)."""
        from pan2cli.vae.kernel.decoder import WanKernelDecoder

        job, result = state.job, state.result
        target = None
        if writes and job.output is not None:
            if (
                not self._ran.ranks_share_jobs
                and job.skip_existing
                and (job.output.exists() or job.output.is_symlink())
            ):
                result.skipped = True  # another batch wrote it while this one denoised it
                return
            target = VideoTarget(
                job.output, "mp4", job.settings.fps, crf=job.crf, overwrite=job.overwrite,
                skip_if_taken=job.skip_existing,
            )  # fmt: skip
        result.decoder = "compiled kernel" if isinstance(decoder, WanKernelDecoder) else "reference"
        written: list[Path] = []  # beside the video in this attempt: removed if the video is not committed
        # a round's last frame and its frames to the stitched video (`pan2cli.pipeline.rounds`)
        tap = self._round_tap(state) if target is not None and job.chain is not None else None

        def before_commit() -> None:
            if not writes:
                return
            with self._timed(result, "write"):
                if job.latents_path is not None and result.kept_latents != job.latents_path:
                    save_latents(job.latents_path, latents_payload(result, self._vae_record()))
                if job.latents_path is not None:
                    result.kept_latents = result.latents_path = job.latents_path
                if tap is not None:
                    written.append(self._save_last_frame(state, tap))
            if target is not None and job.sidecar:  # after the stages' seconds, before the video shows
                path = sidecar_path(job.output)
                replace_into(
                    path, lambda tmp: write_text(tmp, json.dumps(self.sidecar(result), indent=2) + "\n")
                )
                written.append(path)
                result.sidecar = path

        try:
            video = decode_and_write(
                decoder, result.latents, target, chunk_latent_frames=self._chunk_latent_frames(),
                split_rows=self._ran.decode_rows_split, keep_frames=job.return_frames and writes,
                progress=lambda total: self.progress("Decoding", total, "frames"),
                stage=lambda name: self._timed(result, name), before_commit=before_commit, tap=tap,
            )  # fmt: skip
        except BaseException:
            for path in written:
                remove_quietly(path)
            result.sidecar = None
            raise
        result.frames, result.skipped, result.output = video.frames, video.skipped, video.output
        if tap is not None:
            self._keep_last_frame(state, tap)

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
