"""Decode one video's latents and write it: the one routine of `pan2 decode` (each of its videos) and of `pan2 generate`
(each video as soon as it is denoised, `pan2cli.pipeline.streaming`).

The frames go to the writer chunk by chunk (an MP4 is encoded beside the decode) under a temporary name; the file
is complete (`VideoWriter.finish`), checked against an output that another process wrote meanwhile, joined by
what goes beside it (a generated video's latents file and sidecar, `before_commit`), and renamed into place last,
so no video ever shows before it is whole, or without its sidecar. Any failure or interrupt removes the temporary
file; under several processes the temporary file is named to the launcher (`distributed.partial_output`), which removes
it if this rank dies.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ContextManager, Iterator

import torch

from pan2cli import distributed
from pan2cli.errors import InputError
from pan2cli.outputs import DEFAULT_CRF, DEFAULT_X264_PRESET
from pan2cli.vae.decoder import DecodeStats, FrameSink, decode_latents
from pan2cli.vae.protocol import Decoder
from pan2cli.video import open_video_writer

# (total frames) → a context manager yielding `advance(n)`, called with each chunk's frames.
Progress = Callable[[int], ContextManager[Callable[[int], None]]]
# (stage name: "decode", "write") → a context manager around that stage (timing, memory).
Stage = Callable[[str], ContextManager[None]]


@dataclass(frozen=True)
class VideoTarget:
    """Where and how one video is written (`pan2cli.video.open_video_writer`'s arguments).

    Attributes:
        path: the output file (mp4, pt) or folder (png).
        fmt: one of `pan2cli.outputs.OUTPUT_FORMATS`.
        fps: the frame rate (checked when the writer opens).
        crf, x264_preset: the MP4's H.264 quality and x264's speed.
        overwrite: an existing output may be replaced.
        skip_if_taken: an output that another process wrote while this one decoded is left as it is and the video
            is skipped (`--skip-existing`); otherwise it is an error (unless `overwrite`).
    """

    path: Path
    fmt: str
    fps: float
    crf: int = DEFAULT_CRF
    x264_preset: str = DEFAULT_X264_PRESET
    overwrite: bool = False
    skip_if_taken: bool = False


@dataclass(frozen=True)
class WrittenVideo:
    """What `decode_and_write` did: the decode's statistics, the output (None when nothing was written: no target,
    or `skipped`), and the frames (uint8 `[F, H, W, 3]` on the host) when they were kept."""

    stats: DecodeStats
    output: Path | None = None
    skipped: bool = False
    frames: torch.Tensor | None = None


class _FrameSink:
    """Passes the decoder's host chunks on to the writer (and the caller's `tap`), keeping them when the caller wants
    the frames."""

    def __init__(self, writer, keep: bool, tap: FrameSink | None = None):
        self.writer, self.keep, self.tap, self.chunks = writer, keep, tap, []

    def write(self, frames: torch.Tensor) -> None:
        if self.keep:
            self.chunks.append(frames)
        if self.writer is not None:
            self.writer.write(frames)
        if self.tap is not None:
            self.tap.write(frames)

    def frames(self) -> torch.Tensor | None:
        return torch.cat(self.chunks) if self.keep and self.chunks else None


@contextmanager
def _no_progress(total: int) -> Iterator[Callable[[int], None]]:
    yield lambda n=1: None


def decode_and_write(
    decoder: Decoder,
    latents: torch.Tensor,
    target: VideoTarget | None,
    *,
    normalized: bool = True,
    chunk_latent_frames: int,
    split_rows: bool = True,
    keep_frames: bool = False,
    progress: Progress = _no_progress,
    stage: Stage = lambda name: nullcontext(),
    before_commit: Callable[[], None] | None = None,
    tap: FrameSink | None = None,
) -> WrittenVideo:
    """Decode `latents` into `target`, written whole or not at all.

    Args:
        decoder: the VAE decoder (`pan2cli.vae.decoder.open_decoder`).
        latents: `(48, T, h, w)` or `(1, 48, T, h, w)` latents (`decode_latents`).
        target: where the video goes; None writes nothing (another rank of a split decode, which decodes its rows,
            or frames kept in memory only).
        normalized: the DiT's normalised latents (False: raw VAE latents).
        chunk_latent_frames, split_rows: as `decode_latents` takes them.
        keep_frames: return the frames (`WrittenVideo.frames`).
        progress: the decode's progress, given its total frames.
        stage: wraps the "decode" and the "write" (the file completed) stages.
        before_commit: called once the video is complete, before it shows (what goes beside it is written here);
            its failure leaves no video.
        tap: also receives every chunk the writer does, as it does (a round's last frame, a chain's stitched video).

    Returns:
        A `WrittenVideo`.

    Raises:
        InputError: the output exists (or appeared meanwhile) and may not be replaced; or as `open_video_writer`.
        Pan2Error: the write failed (ffmpeg, a full disk), or the decode did (out of memory: `decode_latents`).
    """
    writer = None
    if target is not None:
        writer = open_video_writer(
            target.path, target.fmt, target.fps, crf=target.crf, overwrite=target.overwrite,
            preset=target.x264_preset,
        )  # fmt: skip
    try:
        with distributed.partial_output(writer.tmp_path if writer is not None else None):
            sink = _FrameSink(writer, keep_frames, tap) if writer is not None or keep_frames or tap else None
            total = decoder.config.frames_out(latents.shape[-3])  # T latent frames
            with stage("decode"), progress(total) as advance:
                stats = decode_latents(
                    decoder, latents, sink, normalized=normalized, chunk_latent_frames=chunk_latent_frames,
                    split_rows=split_rows, on_chunk=advance,
                )  # fmt: skip
            frames = sink.frames() if sink is not None else None
            if writer is not None:
                with stage("write"):
                    writer.finish()  # the MP4's last frames: complete under its temporary name
                    if writer.target_exists() and not target.overwrite:
                        if target.skip_if_taken:  # another process wrote it meanwhile
                            writer.abort()
                            return WrittenVideo(stats, skipped=True, frames=frames)
                        raise InputError(
                            f"output {target.path} already exists", hint="pass --overwrite to replace it"
                        )
            if before_commit is not None:
                before_commit()
            output = writer.commit() if writer is not None else None
    except BaseException:
        if writer is not None:
            writer.abort()
        raise
    return WrittenVideo(stats, output=output, frames=frames)
