"""The frames a chain of rounds hands on: a video's frames and last frame read from a file (an MP4, a round's
`.last.png`), the video a chain continues (`StartVideo`, `--continue-from`), the tap on a round's decode that keeps its
last frame (`FrameTap`), and a chain's stitched MP4 (`Stitcher`), written as its rounds are decoded.

Why a PNG beside each round: an MP4 is H.264 (yuv420p and the encoder's quantisation: lossy), so a frame read back
from it is not the frame its writer received. A round starts from the exact uint8 frame its previous round wrote:
from memory in the batch that made that round, from its `.last.png` in a later one (a resumed batch), the same bytes
either way.
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

from pan2cli import distributed
from pan2cli.constants import VAE_SPATIAL_FACTOR, video_frames
from pan2cli.errors import InputError
from pan2cli.latents import LatentInput, load_latents
from pan2cli.outputs import DEFAULT_CRF
from pan2cli.pipeline.image import load_image
from pan2cli.video import open_video_writer

# A `--continue-from` file with one of these suffixes is a latents file (`--save-latents`); any other, a video.
LATENTS_SUFFIXES = (".pt", ".pth", ".safetensors")
_CHUNK_FRAMES = 8  # frames per chunk read from a video (a few MB at 704x1248)


def last_frame_path(output: Path) -> Path:
    """`round.mp4` → `round.last.png`: the exact last frame of a round, written beside it."""
    return output.with_name(f"{output.stem}.last.png")


def video_chunks(path: Path, what: str = "video") -> Iterator[torch.Tensor]:
    """The frames of a video file (MP4, or any video ffmpeg reads) as uint8 `[f, H, W, 3]` chunks, decoded by
    imageio-ffmpeg's ffmpeg.

    Raises:
        InputError: the file is missing or is no video ffmpeg can read (the message ends with ffmpeg's reason).
    """
    import imageio_ffmpeg

    if not path.is_file():
        raise InputError(f"{what} {path} does not exist (or is not a file)")
    reader = imageio_ffmpeg.read_frames(str(path))
    try:
        width, height = next(reader)["size"]
        chunk = []
        for data in reader:
            chunk.append(torch.frombuffer(bytearray(data), dtype=torch.uint8).view(height, width, 3))
            if len(chunk) == _CHUNK_FRAMES:
                yield torch.stack(chunk)
                chunk = []
        if chunk:
            yield torch.stack(chunk)
    except (OSError, RuntimeError, StopIteration, KeyError) as exc:
        # imageio-ffmpeg's message holds ffmpeg's whole stderr: its last line says why
        lines = [line for line in str(exc).splitlines() if line.strip()]
        raise InputError(
            f"{what} {path} could not be read as a video: {lines[-1] if lines else type(exc).__name__}",
            hint="pass an MP4 (pan2 generate's output), or a --save-latents file (.pt)",
        ) from None
    finally:
        reader.close()


def read_last_frame(path: Path, what: str = "video") -> tuple[torch.Tensor, int]:
    """`(frame, count)`: the last frame of a video file, uint8 `[H, W, 3]`, and its number of frames.

    Raises:
        InputError: as `video_chunks`, or a video without frames.
    """
    last, count = None, 0
    for chunk in video_chunks(path, what):
        last, count = chunk[-1].clone(), count + chunk.shape[0]
    if last is None:
        raise InputError(f"{what} {path} holds no frames")
    return last, count


def read_image_frame(path: Path, what: str) -> torch.Tensor:
    """An image file (a round's `.last.png`) as uint8 `[H, W, 3]`.

    Raises:
        InputError: missing or not an image (`load_image`).
    """
    image = load_image(path, what)
    return torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(image.height, image.width, 3)


def frame_image(frame: torch.Tensor):
    """uint8 `[H, W, 3]` → a PIL image, the start image of a round (`pan2cli.pipeline.image.fit_image` takes it)."""
    from PIL import Image

    return Image.fromarray(frame.numpy())


def save_frame_png(frame: torch.Tensor, path: Path) -> None:
    """Write uint8 `[H, W, 3]` as a PNG (lossless: the same bytes come back). zlib level 1: 0.06 s for a 704x1248
    frame against level 6's 0.24 s (measured on this project's CPU host), about 1.2x the bytes; it is written
    while the next round waits."""
    frame_image(frame).save(path, format="PNG", compress_level=1)


@dataclass(eq=False)
class StartVideo:
    """`--continue-from VIDEO`: the video the first round of each chain continues, read before any model loads.

    Attributes:
        path: the file.
        frames: its number of frames.
        height, width: its size in pixels.
        last: its last frame, uint8 `[H, W, 3]`; for a latents file None until decoded (`decoded` set).
        exact: the `.last.png` pan2 wrote beside an MP4 round, whose exact frame is `last` (None: the MP4's own).
        latents: a latents file's contents, else None (an MP4).
        decoded: a latents file's frames `[F, H, W, 3]` uint8 once decoded, for the stitched video.
        checked: a latents file's VAE was found to be the checkpoint's.
    """

    path: Path
    frames: int
    height: int
    width: int
    last: torch.Tensor | None = None
    exact: Path | None = None
    latents: LatentInput | None = None
    decoded: torch.Tensor | None = None
    checked: bool = False

    def chunks(self) -> Iterable[torch.Tensor]:
        """Its frames, for the stitched video: a latents file's as decoded, an MP4's read back from it."""
        return [self.decoded] if self.latents is not None else video_chunks(self.path, "--continue-from")


def read_start_video(path: Path) -> StartVideo:
    """Read what `--continue-from` names: a latents file (`.pt`, `.pth`, `.safetensors`: checked, decoded later by
    the batch's VAE) or a video (its frames counted, its last frame kept; a `.last.png` beside it gives the exact
    frame).

    Raises:
        InputError: missing, unreadable or corrupt; latents of several videos; a `.last.png` of another size.
    """
    what = "--continue-from"
    if path.suffix.lower() in LATENTS_SUFFIXES:
        try:
            latents = load_latents(path)
        except InputError as exc:
            raise InputError(f"{what}: {exc}", hint=exc.hint) from exc
        batch, _, count, rows, cols = latents.latents.shape
        if batch != 1:
            raise InputError(f"{what} {path} holds the latents of {batch} videos; it continues one")
        return StartVideo(
            path, video_frames(count), rows * VAE_SPATIAL_FACTOR, cols * VAE_SPATIAL_FACTOR, latents=latents
        )
    last, count = read_last_frame(path, what)
    height, width = last.shape[:2]
    exact = last_frame_path(path)
    if not exact.is_file():
        return StartVideo(path, count, height, width, last=last)
    frame = read_image_frame(exact, f"{what}'s last frame")
    if frame.shape != last.shape:
        raise InputError(
            f"{exact} beside --continue-from {path} is {frame.shape[1]}x{frame.shape[0]} pixels, the video "
            f"{width}x{height}: it is not that video's last frame",
            hint=f"remove {exact} to start from the MP4's own last frame",
        )
    return StartVideo(path, count, height, width, last=frame, exact=exact)


class FrameTap:
    """What a round's decode hands on beside its MP4: its last frame (kept for the next round and the round's
    `.last.png`) and its frames to the chain's stitched video (`part`, None where none is written)."""

    def __init__(self, part: "StitchedPart | None"):
        self.part = part
        self.last: torch.Tensor | None = None

    def write(self, frames: torch.Tensor) -> None:
        if frames.shape[0]:  # a copy of its own: the writer may hold the chunk until it is encoded
            self.last = frames[-1].clone()
        if self.part is not None:
            self.part.write(frames)


class StitchedPart:
    """One part of a stitched video as it arrives: its frames to the writer, the first left out after the first
    part (it repeats the frame the part before ends on)."""

    def __init__(self, writer, drop_first: bool):
        self.writer, self.drop_first = writer, drop_first

    def write(self, frames: torch.Tensor) -> None:
        if self.drop_first and frames.shape[0]:
            frames, self.drop_first = frames[1:], False
        self.writer.write(frames)


class Stitcher:
    """A chain's stitched MP4: its parts (the `--continue-from` video, then each round) in order, the seam frame
    each part shares with the part before written once, under a temporary name renamed when complete (`commit`).

    Args:
        path: the stitched MP4.
        fps, crf: the rounds' frame rate and the MP4's H.264 quality.
        overwrite: an existing file may be replaced.
        skip_if_taken: a file another process wrote meanwhile is kept and this one dropped (`--skip-existing`).
    """

    def __init__(
        self,
        path: Path,
        fps: float,
        crf: int = DEFAULT_CRF,
        overwrite: bool = False,
        skip_if_taken: bool = False,
    ):
        self.path, self.overwrite, self.skip_if_taken = path, overwrite, skip_if_taken
        self.writer = open_video_writer(path, "mp4", fps, crf=crf, overwrite=overwrite)
        self.parts = 0  # parts begun
        self._noted = (
            ExitStack()
        )  # the temporary file named to the launcher while it exists (a rank that dies)
        self._noted.enter_context(distributed.partial_output(self.writer.tmp_path))

    def part(self) -> StitchedPart:
        """The next part, fed as it is decoded (a round's `FrameTap`)."""
        self.parts += 1
        return StitchedPart(self.writer, drop_first=self.parts > 1)

    def add(self, chunks: Iterable[torch.Tensor]) -> None:
        """The next part, whole (a video read back from its file, or decoded frames)."""
        part = self.part()
        for chunk in chunks:
            part.write(chunk)

    def commit(self) -> Path | None:
        """The stitched MP4 complete and in place; None where another process wrote it meanwhile (`skip_if_taken`).

        Raises:
            InputError: the output appeared meanwhile and may not be replaced.
            Pan2Error: ffmpeg or the disk failed (nothing is left).
        """
        try:
            self.writer.finish()
            if self.skip_if_taken and self.writer.target_exists() and not self.overwrite:
                self.writer.abort()
                return None
            return self.writer.commit()
        finally:
            self._noted.close()

    def abort(self) -> None:
        """Stop: the temporary file removed."""
        self.writer.abort()
        self._noted.close()
