"""Write chunks of uint8 frames as an mp4, a folder of PNGs, or a .pt tensor (frame math and host copies: pan2cli.frames;
the ffmpeg behind MP4s: pan2cli.ffmpeg)."""

from __future__ import annotations

import numbers
import os
import shutil
import subprocess
import tempfile
from fractions import Fraction
from pathlib import Path
from types import TracebackType
from typing import IO

import torch

from pan2cli.atomic import save_torch, write_failure
from pan2cli.errors import InputError, Pan2Error
from pan2cli.ffmpeg import PipeFeeder, mp4_encoder, new_process_group

# Where outputs go lives in pan2cli.outputs (no torch: the CLI imports it for --help).
from pan2cli.outputs import (
    DEFAULT_CRF,
    DEFAULT_X264_PRESET,
    X264_PRESETS,
    check_format,
    check_output_path,
    fps_problem,
)


class VideoWriter:
    """Writes chunks of uint8 frames to a temporary name, then renames it into place.

    Use as a context manager: a clean exit commits, any exception (KeyboardInterrupt too)
    aborts and leaves nothing behind. Create with `open_video_writer`.
    """

    def __init__(
        self, path: Path, fmt: str, fps: float, crf: int, overwrite: bool, preset: str = DEFAULT_X264_PRESET
    ):
        self.path = Path(path)
        self.fmt = fmt
        self.fps = float(fps)
        self.crf = int(crf)
        self.preset = preset
        self.overwrite = overwrite
        name = self.path.name
        # Same folder as the target, so the final os.replace is an atomic rename on one
        # filesystem; keep the suffix so ffmpeg picks the mp4 muxer from the name.
        suffix = "" if fmt == "png" else f".{fmt}"
        self.tmp_path = self.path.with_name(f".{name}.partial-{os.getpid()}{suffix}")
        self._size: tuple[int, int] | None = None  # (H, W) of the first chunk
        self._frames_written = 0
        self._chunks: list[torch.Tensor] = []  # pt only
        self._proc: subprocess.Popen[bytes] | None = None  # mp4 only
        self._stderr: IO[bytes] | None = None
        self._feeder: PipeFeeder | None = None  # mp4 only: hands chunks to ffmpeg beside the decode
        self._finished = False  # the temporary file is complete (`finish`)
        self._closed = False

    @property
    def frames_written(self) -> int:
        """Number of frames accepted by `write` so far."""
        return self._frames_written

    def write(self, frames: torch.Tensor) -> None:
        """Append a chunk of frames.

        MP4 chunks are queued and fed to ffmpeg by a thread of their own, so this returns at once and
        the encode runs beside the decode instead of holding it up; the writer keeps a reference to `frames` until
        they are encoded, so the caller must not change them afterwards (decode_latents hands over a
        new host buffer per chunk). An ffmpeg failure is raised by a later `write` or by `commit`.

        Args:
            frames: uint8 [f, H, W, 3] CPU tensor; H and W must match earlier chunks
                (and be even for mp4).

        Raises:
            ValueError: `frames` is not a uint8 [f, H, W, 3] CPU tensor, or the writer is closed.
            InputError: H or W is odd for mp4.
            Pan2Error: ffmpeg or the filesystem failed.
        """
        if self._closed:
            raise ValueError(f"writer for {self.path} is already closed")
        if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
            raise ValueError(f"expected uint8 [f, H, W, 3] frames, got {frames.dtype} {tuple(frames.shape)}")
        if frames.device.type != "cpu":
            raise ValueError(f"frames must be on CPU (use copy_to_host), got {frames.device}")
        f, h, w, _ = frames.shape
        if self._size is None:
            self._start(h, w)
        elif (h, w) != self._size:
            raise ValueError(f"frame size changed from {self._size} to {(h, w)} while writing {self.path}")
        if f == 0:
            return
        frames = frames.contiguous()
        try:
            if self.fmt == "mp4":
                self._write_mp4(frames)
            elif self.fmt == "png":
                self._write_png(frames)
            else:
                # Own the data: the caller may reuse its (possibly pinned) buffer.
                self._chunks.append(frames.clone())
        except OSError as err:
            raise Pan2Error(f"writing {self.path} failed: {err}") from err
        self._frames_written += f

    def finish(self) -> None:
        """Complete the temporary file (an MP4's last frames encoded, a .pt saved) without moving it into place:
        what goes beside the video (its sidecar) can be written before the video appears. `commit` finishes too.

        Raises:
            Pan2Error: no frames were written, ffmpeg failed, or the disk is full (the temporary output is
                removed first).
        """
        if self._closed:
            raise ValueError(f"writer for {self.path} is already closed")
        if self._finished:
            return
        try:
            if self._frames_written == 0:
                raise Pan2Error(f"no frames were written to {self.path}")
            if self.fmt == "mp4":
                self._finish_mp4()
            elif self.fmt == "pt":
                video = self._chunks[0] if len(self._chunks) == 1 else torch.cat(self._chunks)
                self._chunks = []
                save_torch(video, self.tmp_path)
        except BaseException as err:
            self.abort()
            if isinstance(err, OSError):
                raise write_failure(self.path, err) from err
            raise
        self._finished = True

    def target_exists(self) -> bool:
        """Whether something is at the output path (another process may have written it while we decoded)."""
        return self.path.exists() or self.path.is_symlink()

    def commit(self) -> Path:
        """Finish the file (`finish`) and move it into place.

        Returns:
            The final output path.

        Raises:
            Pan2Error: no frames were written, ffmpeg failed, the disk is full, or the rename failed (the
                temporary output is removed first).
            InputError: the target appeared meanwhile and `overwrite` is False.
        """
        self.finish()
        try:
            # Re-check: another process may have created the target while we decoded.
            if self.target_exists() and not self.overwrite:
                raise InputError(f"output {self.path} already exists", hint="pass --overwrite to replace it")
            if self.fmt == "png" and self.target_exists():
                # os.replace cannot put a folder over an existing one (or over a file).
                _remove(self.path)
            os.replace(self.tmp_path, self.path)
        except BaseException as err:
            self.abort()
            if isinstance(err, OSError):
                raise write_failure(self.path, err) from err
            raise
        self._closed = True
        return self.path

    def abort(self) -> None:
        """Stop writing and remove the temporary output. Safe to call more than once."""
        self._closed = True
        self._chunks = []
        if self._proc is not None:
            # ffmpeg runs in its own process group (Ctrl-C does not reach it): kill it and
            # wait, so it cannot recreate the file after we delete it.
            if self._proc.poll() is None:
                self._proc.kill()
            self._proc.wait()
            if self._feeder is not None:  # its pipe is broken now: it drops what is left and ends
                self._feeder.finish()
                self._feeder = None
            _close_quietly(self._proc.stdin)
            self._proc = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None
        _remove(self.tmp_path)

    def __enter__(self) -> VideoWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            if not self._closed:
                self.commit()
        elif not self._closed:
            self.abort()

    def _start(self, h: int, w: int) -> None:
        """Set the frame size and create the temporary output."""
        if self.fmt == "mp4" and (h % 2 or w % 2):
            raise InputError(
                f"cannot write {self.path}: frames are {w}x{h} (WxH); H.264 with yuv420p "
                "needs an even width and height",
                hint="write --format png or pt instead, or decode a size with even sides",
            )
        self._size = (h, w)
        # A leftover from a crashed run with the same pid would block mkdir/rename.
        _remove(self.tmp_path)
        if self.fmt == "png":
            self.tmp_path.mkdir()
        elif self.fmt == "mp4":
            self._start_ffmpeg(h, w)

    def _start_ffmpeg(self, h: int, w: int) -> None:
        # The same command imageio_ffmpeg.write_frames builds, but run here so that we can
        # check ffmpeg's exit status at commit, keep its stderr for the error message (not
        # the user's terminal), and kill it on abort.
        fps = Fraction(self.fps).limit_denominator(100000)
        cmd = [
            mp4_encoder(),
            "-y",
            "-f", "rawvideo", "-vcodec", "rawvideo",
            "-s", f"{w}x{h}", "-pix_fmt", "rgb24", "-r", str(fps),
            "-i", "-", "-an",
            "-vcodec", "libx264", "-pix_fmt", "yuv420p",
            "-crf", str(self.crf), "-preset", self.preset,
            "-v", "error",
            str(self.tmp_path),
        ]  # fmt: skip
        self._stderr = tempfile.TemporaryFile()
        try:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=self._stderr,
                # Own session/process group: Ctrl-C goes to us only, and we decide to kill.
                **new_process_group(),
            )
        except OSError as err:
            raise Pan2Error(f"could not start ffmpeg to write {self.path}: {err}") from err
        self._feeder = PipeFeeder(self._proc.stdin)

    def _write_mp4(self, frames: torch.Tensor) -> None:
        assert self._feeder is not None
        if not self._feeder.put(frames):
            raise Pan2Error(f"ffmpeg stopped while writing {self.path}: {self._ffmpeg_error()}")

    def _finish_mp4(self) -> None:
        assert self._proc is not None and self._proc.stdin is not None and self._feeder is not None
        self._feeder.finish()  # every queued chunk is in the pipe (or ffmpeg stopped reading)
        self._feeder = None
        try:
            self._proc.stdin.close()
        except BrokenPipeError:
            pass  # ffmpeg already exited; its exit status below says why
        rc = self._proc.wait()
        if rc != 0 or not self.tmp_path.is_file():
            raise Pan2Error(f"ffmpeg failed to write {self.path} (exit status {rc}): {self._ffmpeg_error()}")
        self._proc = None
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def _ffmpeg_error(self) -> str:
        """The start of ffmpeg's stderr, for error messages."""
        if self._proc is not None and self._proc.poll() is None:
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self._stderr is None:
            return "no error output"
        self._stderr.seek(0)
        lines = self._stderr.read().decode("utf-8", "replace").strip().splitlines()
        # ffmpeg states the cause first; later lines are threads shutting down because of it.
        return " | ".join(lines[:3])[:400] if lines else "no error output"

    def _write_png(self, frames: torch.Tensor) -> None:
        import imageio.v3 as iio

        arr = frames.numpy()  # a view, no copy
        for i in range(arr.shape[0]):
            iio.imwrite(self.tmp_path / f"frame_{self._frames_written + i:05d}.png", arr[i])


def open_video_writer(
    path: Path,
    fmt: str,
    fps: float,
    crf: int = DEFAULT_CRF,
    overwrite: bool = False,
    preset: str = DEFAULT_X264_PRESET,
) -> VideoWriter:
    """Open a writer for chunks of uint8 frames.

    Args:
        path: the output file (mp4, pt) or folder (png).
        fmt: one of OUTPUT_FORMATS.
        fps: frames per second (`pan2cli.outputs.FPS_RANGE`); used by mp4 only.
        crf: x264 constant rate factor, 0 (lossless) .. 51; used by mp4 only.
        overwrite: whether an existing `path` may be replaced at commit.
        preset: x264's speed/size preset (`X264_PRESETS`); used by mp4 only.

    Returns:
        A `VideoWriter`; nothing is created on disk before the first `write`.

    Raises:
        InputError: bad format, fps or crf, or `path` cannot be written (see
            `check_output_path`), or `path` is a folder and fmt is not png.
    """
    check_format(fmt)
    # numbers.Real/Integral also admit numpy scalars; bool is excluded on purpose.
    if (problem := fps_problem(fps)) is not None:
        raise InputError(f"fps {problem}")
    if isinstance(crf, bool) or not isinstance(crf, numbers.Integral) or not 0 <= crf <= 51:
        raise InputError(f"crf must be an integer from 0 to 51, got {crf!r}", hint="17 is visually lossless")
    if preset not in X264_PRESETS:
        raise InputError(f"x264 preset must be one of {', '.join(X264_PRESETS)}, got {preset!r}")
    path = Path(path)
    check_output_path(path, overwrite)
    if fmt != "png" and path.is_dir():
        raise InputError(f"output {path} is a folder; {fmt} output needs a file path")
    return VideoWriter(path, fmt, fps, crf, overwrite, preset)


def write_video(
    frames: torch.Tensor,
    path: Path,
    fmt: str,
    fps: float,
    crf: int = DEFAULT_CRF,
    overwrite: bool = False,
) -> Path:
    """Write a whole video that is already on the host.

    Args:
        frames: uint8 [F, H, W, 3] CPU tensor.
        path, fmt, fps, crf, overwrite: as for `open_video_writer`.

    Returns:
        The final output path.

    Raises:
        InputError, Pan2Error: as for `open_video_writer`, `VideoWriter.write` and `commit`.
    """
    with open_video_writer(path, fmt, fps, crf=crf, overwrite=overwrite) as writer:
        writer.write(frames)
    return writer.path


def _remove(path: Path) -> None:
    """Delete a file, link or folder if it is there."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass


def _close_quietly(stream: object) -> None:
    try:
        stream.close()  # type: ignore[attr-defined]
    except Exception:
        pass
