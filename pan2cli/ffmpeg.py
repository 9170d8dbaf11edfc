"""The ffmpeg that writes MP4s: found and checked before any work, and fed from a thread of its own."""

from __future__ import annotations

import functools
import os
import queue
import subprocess
import threading
from typing import IO

import torch

from pan2cli.errors import Pan2Error

FFMPEG_HINT = (
    "pip install imageio-ffmpeg (it brings its own ffmpeg), or set IMAGEIO_FFMPEG_EXE to an ffmpeg binary"
)


def mp4_encoder() -> str:
    """The ffmpeg that writes MP4s: imageio-ffmpeg's (or `IMAGEIO_FFMPEG_EXE`).

    Raises:
        Pan2Error: imageio-ffmpeg cannot be imported, or it finds no ffmpeg.
    """
    try:
        import imageio_ffmpeg

        return imageio_ffmpeg.get_ffmpeg_exe()
    except ImportError as exc:
        raise Pan2Error(
            f"writing MP4 needs imageio-ffmpeg, which cannot be imported: {exc}", hint=FFMPEG_HINT
        ) from exc
    except RuntimeError as exc:  # imageio-ffmpeg found no binary
        raise Pan2Error(f"writing MP4 needs ffmpeg: {exc}", hint=FFMPEG_HINT) from exc


def check_mp4_encoder() -> str:
    """`mp4_encoder`, found and run (`-version`, once per executable): checked before any work, so that a missing
    or broken ffmpeg is said in seconds rather than after a generation.

    Raises:
        Pan2Error: no ffmpeg (`mp4_encoder`), or one that does not run.
    """
    exe = mp4_encoder()
    _check_runs(exe)
    return exe


@functools.cache
def _check_runs(exe: str) -> None:
    try:
        subprocess.run([exe, "-version"], capture_output=True, check=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        raise Pan2Error(f"writing MP4 needs ffmpeg, and {exe} does not run: {exc}", hint=FFMPEG_HINT) from exc


class PipeFeeder:
    """Writes queued chunks of frames into ffmpeg's stdin from a thread of its own.

    A pipe write blocks while ffmpeg encodes (x264 at 704x1248 runs at about the decode's frame
    rate): fed from the decode's thread, ffmpeg would hold the decode up at every chunk, and under a
    row split every rank with it, since the ranks meet at each chunk's gather. The queue is not
    bounded: at worst the whole video waits in host memory, as a .pt output holds it anyway.
    """

    _DONE = None

    def __init__(self, pipe: IO[bytes]):
        self._pipe = pipe
        self._chunks: queue.SimpleQueue[torch.Tensor | None] = queue.SimpleQueue()
        self._broken = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pan2-mp4-feeder", daemon=True)
        self._thread.start()

    def put(self, frames: torch.Tensor) -> bool:
        """Queue a contiguous chunk; False once ffmpeg has stopped reading (its error says why)."""
        if self._broken.is_set():
            return False
        self._chunks.put(frames)
        return True

    def finish(self) -> None:
        """Wait until every queued chunk is written (or dropped after a broken pipe)."""
        self._chunks.put(self._DONE)
        self._thread.join()

    def _run(self) -> None:
        while (frames := self._chunks.get()) is not self._DONE:
            if self._broken.is_set():
                continue  # drop: ffmpeg is gone, commit or abort will say why
            try:
                # One write of the whole chunk: ffmpeg splits the raw rgb24 stream into frames itself.
                self._pipe.write(memoryview(frames.numpy()).cast("B"))
                self._pipe.flush()
            except (BrokenPipeError, ValueError, OSError):
                self._broken.set()


def new_process_group() -> dict[str, object]:
    """`subprocess.Popen` arguments that start ffmpeg in a session (on Windows, a process group) of its own:
    Ctrl-C in the terminal reaches pan2 alone, which decides when ffmpeg ends."""
    if os.name == "nt":
        return {"creationflags": subprocess.CREATE_NEW_PROCESS_GROUP}  # type: ignore[attr-defined]
    return {"start_new_session": True}
