"""Where a command's outputs go: the formats, the default names, and the checks made before any model loads.

No torch here: the CLI imports this to build its options, and `pan2 --help` must not load torch.
"""

from __future__ import annotations

import math
import numbers
import os
import re
from pathlib import Path

from pan2cli.errors import InputError

OUTPUT_FORMATS = ("mp4", "png", "pt")
# x264's "visually lossless" point: the decode is the product, keep it close to the frames.
DEFAULT_CRF = 17
# x264's speed/size trade-off at a given --crf (quality). x264's own default, medium, encodes 704x1248
# at about 26 frames/s on a 16-core H200 host, slower than the decode's 39: the encode then ended
# 2.1 s after a 5 s video's decode; faster keeps up (0.4 s), with the same PSNR at crf 17 and a file
# no larger in our measurements (docs/BENCHMARKS.md, 2026-12-01).
X264_PRESETS = (
    "ultrafast",
    "superfast",
    "veryfast",
    "faster",
    "fast",
    "medium",
    "slow",
    "slower",
    "veryslow",
)
DEFAULT_X264_PRESET = "faster"
# Frame rates an H.264 MP4 carries and a player shows, checked with the other settings before anything loads.
# The bundled ffmpeg (n9.0) writes 1e-5 to 1e6 fps (below, the rate rounds to 0 and it fails after the whole
# decode; 1e9 is stored as "1001k"); x264's highest level (6.2) allows 4869 fps at PAN 2's 704x1248 and 2048
# at 1080p. Below 0.01 fps a frame lasts over a minute and a half; no display shows 1000 distinct frames a second.
MIN_FPS = 0.01
MAX_FPS = 1000.0
FPS_RANGE = f"a number from {MIN_FPS:g} to {MAX_FPS:g} (frames per second)"
_FRAME_NAME = re.compile(r"frame_\d+\.png")  # the files of a PNG output (`VideoWriter._write_png`)


def default_output_path(input_path: Path, fmt: str) -> Path:
    """The output path used when none is given: next to the input, with the same stem.

    `x.pt` -> `x.mp4` (mp4), `x/` (png), `x.pt` (pt). When that would be the input file
    itself (pt output of a `.pt` input, png output of a suffix-less input, ...) `.frames`
    is added to the stem instead: `x.frames.pt`, `x.frames/`, so the input is never replaced.

    Args:
        input_path: the latents file.
        fmt: one of OUTPUT_FORMATS.

    Returns:
        The output file (mp4, pt) or folder (png).

    Raises:
        InputError: `fmt` is not one of OUTPUT_FORMATS.
    """
    check_format(fmt)
    input_path = Path(input_path)
    suffix = "" if fmt == "png" else f".{fmt}"
    out = input_path.with_suffix(suffix)
    if out == input_path:
        out = input_path.with_suffix(f".frames{suffix}")
    return out


def check_output_path(path: Path, overwrite: bool) -> None:
    """Fail early (before any model loads) if `path` cannot be written.

    Args:
        path: the output file or png folder.
        overwrite: whether an existing `path` may be replaced.

    Raises:
        InputError: the parent folder is missing, not a folder or not writable, `path`
            exists and `overwrite` is False, or `path` is a folder holding more than PNG frames.
    """
    path = Path(path)
    parent = path.parent
    if not parent.exists():
        raise InputError(
            f"output folder {parent} does not exist (for {path})",
            hint="create it first, or choose another output path",
        )
    if not parent.is_dir():
        raise InputError(f"cannot write {path}: {parent} is not a folder")
    if not os.access(parent, os.W_OK):
        raise InputError(f"cannot write {path}: output folder {parent} is not writable")
    # is_symlink: a dangling link does not "exist" but would still be replaced.
    if (path.exists() or path.is_symlink()) and not overwrite:
        raise InputError(f"output {path} already exists", hint="pass --overwrite to replace it")
    if path.is_dir() and not path.is_symlink():
        # Replacing a PNG output deletes the folder: never one that holds more than frames.
        others = sorted(p.name for p in path.iterdir() if not _FRAME_NAME.fullmatch(p.name))
        if others:
            raise InputError(
                f"output folder {path} holds {', '.join(others[:3])}{', ...' if len(others) > 3 else ''} besides PNG frames; "
                "it is not replaced",
                hint="choose another output path",
            )


def fps_problem(fps: object) -> str | None:
    """What is wrong with `fps` as the frame rate of a video (`FPS_RANGE`), or None."""
    if isinstance(fps, bool) or not isinstance(fps, numbers.Real) or not math.isfinite(fps):
        return f"{fps!r} is not a finite number"
    if not MIN_FPS <= fps <= MAX_FPS:
        return (
            f"{fps:g} is outside {MIN_FPS:g} to {MAX_FPS:g} frames per second, the rates an H.264 MP4 carries"
        )
    return None


def check_not_stdout(output: str | None) -> None:
    """`-o -` asks for the video on stdout, which pan2 does not write (MP4 needs a seekable file).

    Raises:
        InputError: `output` is "-".
    """
    if output == "-":
        raise InputError(
            "-o -: pan2 writes video to files, not to stdout (an MP4 is finished by seeking back into it)",
            hint="name a file, e.g. -o video.mp4 (the path written is printed on stdout)",
        )


def check_format(fmt: str) -> None:
    """Raise InputError unless `fmt` is one of OUTPUT_FORMATS."""
    if fmt not in OUTPUT_FORMATS:
        raise InputError(f"unknown output format {fmt!r}; expected one of {', '.join(OUTPUT_FORMATS)}")
