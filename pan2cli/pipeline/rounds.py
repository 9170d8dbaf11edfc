"""The rounds of chains in a batch (`pan2cli.pipeline.chains`): where each round's start frame comes from, and what a
round's decode hands on (its exact last frame, its frames to the chain's stitched video).

`ChainRounds` is a part of `VideoGenerator` (a base class, not used alone), beside the stages it serves:
- step 2 (`pan2cli.pipeline.loading`): the start frames known before any denoising, through the VAE encoder as
  `--image` takes them (cover-resize, centre crop, the posterior's mode): a `--continue-from` video's last frame (a
  latents file decoded first, `decode_start_video`) and the last frame of a round made before (its `.last.png`);
- step 4 (`pan2cli.pipeline.streaming`): a round that continues one of the batch starts from that round's last frame,
  handed over in memory: the exact uint8 frame its MP4 writer received, encoded just before the round's denoising.
  The round waits for nothing else of the round before (its MP4 and sidecar are written before it begins, as
  every video of a batch is). The encoder is loaded once for the batch and waits in host memory between two start
  frames (`_park_encoder`).
"""

from __future__ import annotations

import time

from pan2cli.config import DEFAULT_CHUNK_LATENT_FRAMES
from pan2cli.decoding.write import decode_and_write
from pan2cli.errors import InputError
from pan2cli.pipeline.chain_frames import (
    FrameTap,
    StartVideo,
    Stitcher,
    frame_image,
    last_frame_path,
    read_image_frame,
    read_last_frame,
    save_frame_png,
    video_chunks,
)
from pan2cli.pipeline.image import encode_image, fit_image, load_start_image
from pan2cli.pipeline.jobs import GenerationJob, GenerationResult, JobState, RoundNotMade
from pan2cli.vae.decoder import open_decoder


def round_label(job: GenerationJob) -> str:
    """A round as the errors of the rounds after it name it: `prompt 3 (003_a-cat)`, else its output."""
    if "index" in job.metadata and job.output is not None:
        return f"prompt {job.metadata['index']} ({job.output.stem})"
    return str(job.output)


class ChainRounds:
    """The rounds' start frames and taps (module docstring); a base class of `VideoGenerator`, not used alone."""

    _encoder = None  # the VAE encoder of the start frames, loaded once per batch (`_frame_encoder`)

    # -- start frames -------------------------------------------------------------------------------
    def _check_start_video(self, job: GenerationJob) -> None:
        """A `--continue-from` latents file that records its VAE must be this checkpoint's (once per file).

        Raises:
            InputError: latents made for another VAE (before any model loads).
        """
        source = _source(job)
        if source is None or source.latents is None or source.latents.vae is None or source.checked:
            return
        from pan2cli.vae.identity import identity_mismatch

        ours = self._vae_record()  # None where it cannot be read: nothing to compare
        problem = identity_mismatch(source.latents.vae, ours) if ours is not None else None
        if problem is not None:
            raise InputError(
                f"--continue-from {source.path} holds latents made for the VAE {source.latents.vae.get('vae')}, and "
                f"the model's ({self.components.folder('vae')}) is another: {problem}",
                hint="continue it with the model that made it (--model), or from its MP4",
            )
        source.checked = True

    def decode_start_video(self, source: StartVideo) -> None:
        """Decode a `--continue-from` latents file with the checkpoint's VAE decoder, loaded for it and released:
        `source.decoded` (its frames, for the stitched video) and `source.last` (the frame its rounds start from).
        Every process decodes it whole (each needs the frame)."""
        ran = getattr(self, "_ran", None)
        chunk = self._chunk_latent_frames() if ran is not None else None
        decoder, note = open_decoder(
            self.components.folder("vae"), dtype=self.vae_dtype, device=self.device,
            decode_kernel=self.config.decode_kernel, ranks_together=False, say=self.info,
        )  # fmt: skip
        if note:
            self.info(note)
        video = decode_and_write(
            decoder, source.latents.latents, None, chunk_latent_frames=chunk or DEFAULT_CHUNK_LATENT_FRAMES,
            split_rows=False, keep_frames=True,
        )  # fmt: skip
        source.decoded, source.last = video.frames, video.frames[-1].clone()
        decoder = None  # released before the transformer needs the room
        self._release()

    def _starts_from_file(self, job: GenerationJob) -> bool:
        """Whether `job`'s start frame is known before any denoising (step 2): its image, or a round's file or source."""
        link = job.chain
        if job.settings.image is not None:
            return True
        return (
            link is not None
            and link.previous is None
            and (link.start_file is not None or _source(job) is not None)
        )

    def _start_image(self, job: GenerationJob):
        """The start image (PIL) of a job of `_starts_from_file`."""
        link, source = job.chain, _source(job)
        if job.settings.image is not None:
            return load_start_image(job.settings.image)
        if link.start_file is not None and link.start_file.suffix.lower() == ".png":
            return load_start_image(link.start_file, "the round before's last frame")
        if link.start_file is not None:
            return frame_image(read_last_frame(link.start_file, "the round before")[0])
        return frame_image(source.last)

    def _decode_start_videos(self, states: list[JobState]) -> None:
        """Each `--continue-from` latents file of `states` decoded once (`decode_start_video`); a failure is the
        failure of every job starting from it."""
        for state in states:
            source = _source(state.job)
            if source is None or source.latents is None or source.decoded is not None or state.failed:
                continue
            self._run_job(state, "image_encoding", lambda source=source: self.decode_start_video(source))
            for other in states:
                if _source(other.job) is source and state.failed:
                    other.result.error = state.result.error

    def _frame_encoder(self, states: list[JobState]):
        """The VAE encoder of the start frames on the device, loaded once (its load shared by `states`)."""
        if self._encoder is None:
            from pan2cli.vae.checkpoint import load_vae_encoder

            start = time.perf_counter()
            self._encoder = load_vae_encoder(
                self.components.folder("vae"), dtype=self.vae_dtype, device=self.device
            )
            self._load_seconds(states, "load_vae_encoder", time.perf_counter() - start)
        elif self._encoder.device != self.device:
            self._encoder.to(self.device)
        return self._encoder

    def _park_encoder(self) -> None:
        """Between two start frames the encoder waits in host memory (0.3 GB in bf16, moved back in milliseconds):
        beside the transformer the GPU holds what the memory plan counts, and the encode's one-frame peak (about
        4 GiB at 704x1248) runs in the room the denoising's activations leave between two videos."""
        if self._encoder is not None and self.device.type != "cpu":
            self._encoder.to("cpu")
            self._release()

    def _encode_start(self, state: JobState, image, states: list[JobState]) -> None:
        """`state.image_latent`: `image` fitted to the video and encoded, as `--image` is."""
        settings = state.job.settings
        pixels = fit_image(image, settings.height, settings.width)
        state.image_latent = encode_image(
            self._frame_encoder(states), pixels
        )  # [1, 48, 1, h, w] fp32, normalised

    def _start_round(self, state: JobState, by_job: dict[int, JobState], left: list[JobState]) -> None:
        """Before a round's denoising: its start latent from the last frame of the round before (made in this
        batch; one written by another process meanwhile is read from its files), or its failure when that round was
        not made."""
        link = state.job.chain
        if state.failed or link is None or link.previous is None:
            return
        before = by_job.get(id(link.previous))
        if before is None or before.failed:
            who = state.job.origin or str(state.job.output)
            state.result.error = RoundNotMade(
                f"{who} not made: it continues {round_label(link.previous)}, which was not made"
            )
            return

        def work():
            frame = before.last_frame
            if frame is None:  # written by another process meanwhile (`--skip-existing`): read from its files
                png = last_frame_path(before.job.output)
                what = "the round before's last frame"
                frame = (
                    read_image_frame(png, what) if png.is_file() else read_last_frame(before.job.output)[0]
                )
            rounds = [s for s in left if s.job.chain is not None and s.job.chain.previous is not None]
            self._encode_start(state, frame_image(frame), rounds)

        self._run_job(state, "image_encoding", work)
        self._park_encoder()
        before.last_frame = None  # handed over

    # -- what a round's decode hands on -------------------------------------------------------------
    def _round_tap(self, state: JobState) -> FrameTap:
        """A round's tap for its decode: its last frame kept, its frames to the chain's stitched video (opened at
        the chain's first round made here, the parts before it read back from their files)."""
        link = state.job.chain
        chain, job = link.chain, state.job
        if not chain.write_stitched:
            return FrameTap(None)
        stitcher = self._stitchers.get(id(chain))
        if stitcher is None:
            stitcher = Stitcher(
                chain.stitched,
                chain.fps,
                crf=job.crf,
                overwrite=job.overwrite,
                skip_if_taken=job.skip_existing,
            )
            self._stitchers[id(chain)] = stitcher
            if chain.source is not None:
                stitcher.add(chain.source.chunks())
        first = 1 if chain.source is not None else 0  # the part of round 0
        while stitcher.parts < first + link.position:  # rounds made before, or by another process meanwhile
            stitcher.add(video_chunks(chain.rounds[stitcher.parts - first], "the round"))
        return FrameTap(stitcher.part())

    def _save_last_frame(self, state: JobState, tap: FrameTap):
        """Write a round's exact last frame beside its MP4 (`.last.png`, before the MP4 shows); returns the file."""
        from pan2cli.atomic import replace_into

        path = last_frame_path(state.job.output)
        replace_into(path, lambda tmp: save_frame_png(tap.last, tmp))
        return path

    def _keep_last_frame(self, state: JobState, tap: FrameTap) -> None:
        """A round decoded: its last frame kept in memory where a later round of the batch starts from it."""
        if self._chain_last.get(id(state.job.chain.chain)) is not state.job:
            state.last_frame = tap.last

    def _finish_chain(self, state: JobState) -> None:
        """After a round is written: at its chain's last round made here, the rounds after it (made before) read back
        from their files and the stitched video committed (`result.stitched`)."""
        chain = state.job.chain.chain
        stitcher = self._stitchers.get(id(chain))
        if stitcher is None or self._chain_last.get(id(chain)) is not state.job:
            return
        first = 1 if chain.source is not None else 0
        while stitcher.parts < first + len(chain.rounds):
            stitcher.add(video_chunks(chain.rounds[stitcher.parts - first], "the round"))
        del self._stitchers[id(chain)]
        state.result.stitched = stitcher.commit()

    def _rounds_begin(self, states: list[JobState]) -> None:
        """Step 4 begins: no stitched video open, each chain's last round of this batch known."""
        self._stitchers: dict[int, Stitcher] = {}
        self._chain_last = {id(s.job.chain.chain): s.job for s in states if s.job.chain is not None}

    def _round_reported(self, result: GenerationResult) -> None:
        """A round that failed stops its chain: the stitched video is dropped."""
        link = result.job.chain
        if result.error is not None and link is not None and id(link.chain) in self._stitchers:
            self._stitchers.pop(id(link.chain)).abort()

    def _rounds_end(self) -> None:
        """Step 4 ends (or stops): a stitched video still open is dropped, the encoder released."""
        for stitcher in self._stitchers.values():
            stitcher.abort()
        self._stitchers = {}
        self._encoder = None


def _source(job: GenerationJob) -> StartVideo | None:
    """The `--continue-from` video `job` starts from (the first round of a chain that continues one), else None."""
    link = job.chain
    if link is None or link.position != 0:
        return None
    return link.chain.source
