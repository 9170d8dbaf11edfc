"""Where `pan2 decode` writes each video: the output format and one `DecodeJob` per video (batch item) from `-o` as
typed and `--format` (`plan_outputs`), and each video's frame rate (`frame_rate`).

torch-free: checked before anything loads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pan2cli.errors import InputError
from pan2cli.outputs import check_not_stdout, default_output_path, fps_problem

if TYPE_CHECKING:
    from pan2cli.latents import LatentInput

# The frame rate of latents whose file has none and no --fps given.
DEFAULT_FPS = 24.0
_SUFFIX_FORMATS = {".mp4": "mp4", ".pt": "pt"}


@dataclass(frozen=True)
class DecodeJob:
    """One video to write: batch item `index` of `source`, to `output`."""

    source: LatentInput
    index: int
    output: Path


def _numbered(path: Path, index: int) -> Path:
    return path.with_name(f"{path.stem}_{index}{path.suffix}")


def _in_folder(folder: Path, source: Path, fmt: str) -> Path:
    """`<stem>.<fmt>` (`<stem>/` for png) in `folder`, or the default name where that would be the input."""
    plain = folder / (source.stem if fmt == "png" else f"{source.stem}.{fmt}")
    return plain if plain.resolve() != source.resolve() else folder / default_output_path(source, fmt).name


def _missing_folder(output: str, folder: Path, n_inputs: int) -> InputError:
    if n_inputs > 1 and not output.endswith(("/", os.sep)) and (folder.suffix or folder.is_file()):
        return InputError(
            f"-o {output} names one file, but there are {n_inputs} inputs",
            hint="pass an existing folder as -o (each input gets its own file there), or leave -o out to write next to each input",
        )
    if folder.exists():
        return InputError(f"-o {output}: {folder} is a file, not a folder")
    return InputError(
        f"-o {output}: folder {folder} does not exist", hint=f"create it first (mkdir -p {folder})"
    )


def _output_format(output: str, fmt: str | None) -> str:
    """The format of one named output: its suffix's (`.mp4`, `.pt`), or png (a folder) with --format png."""
    path = Path(output)
    suffix = path.suffix.lower()
    named = _SUFFIX_FORMATS.get(suffix)
    if fmt and named and fmt != named:
        raise InputError(f"-o {output} ends in {path.suffix} but --format is {fmt}", hint="make them agree")
    if named or fmt == "png":
        return named or fmt
    if suffix == ".png":
        raise InputError(
            f"-o {output}: PNG frames go to a folder, not a .png file",
            hint=f"pass --format png -o {path.with_suffix('')}/",
        )
    stem = path.with_suffix("") if suffix else path
    what = "has no suffix" if not suffix else f"ends in {path.suffix}, a format pan2 decode does not write"
    raise InputError(
        f"-o {output} {what}",
        hint=f"name the file {stem}.mp4 (H.264) or {stem}.pt (uint8 tensor), or pass --format png -o {stem}/ for a folder of PNG frames",
    )


def plan_outputs(
    sources: list[LatentInput], output: str | None, fmt: str | None
) -> tuple[str, list[DecodeJob]]:
    """The output format and one job per video (batch item) with its path, from `-o` as typed and --format.

    - no `-o`: next to each input, same stem (`default_output_path`), in --format (default mp4);
    - `-o FOLDER/` (a trailing slash) or an existing folder, for mp4 and pt or several inputs: the folder
      (which must exist) receives `<stem>.mp4`, `<stem>.pt` or `<stem>/`;
    - otherwise `-o` names the output of one input: its suffix chooses the format (`.mp4`, `.pt`), or with
      --format png it is the folder of frames (created); any other suffix, or none, is an error.
    A batch `[B, 48, T, H, W]` writes `<name>_0`, `<name>_1`, … in each case.

    Raises:
        InputError: a suffix that names no format or contradicts --format, a missing folder, a file name for
            several inputs, two videos with one name, or an output that is one of the inputs.
    """
    folder = single = None
    check_not_stdout(output)
    if output is None:
        fmt = fmt or "mp4"
    elif len(sources) > 1 or (fmt != "png" and (output.endswith(("/", os.sep)) or Path(output).is_dir())):
        folder = Path(output)
        if not folder.is_dir():
            raise _missing_folder(output, folder, len(sources))
        fmt = fmt or "mp4"
    else:
        fmt = _output_format(output, fmt)
        single = Path(output)
    jobs = []
    for source in sources:
        batch = source.latents.shape[0]
        path = single or (
            _in_folder(folder, source.path, fmt) if folder else default_output_path(source.path, fmt)
        )
        jobs.extend(DecodeJob(source, i, _numbered(path, i) if batch > 1 else path) for i in range(batch))
    seen: dict[Path, DecodeJob] = {}
    for job in jobs:
        key = job.output.resolve()
        if key in seen:
            raise InputError(
                f"{seen[key].source.path} and {job.source.path} would both be written to {job.output}",
                hint="decode them into different folders with -o",
            )
        seen[key] = job
        _check_not_an_input(job.output, [s.path for s in sources])
    return fmt, jobs


def frame_rate(fps: float | None, source: LatentInput) -> float:
    """The video's frame rate: `--fps` (checked when parsed), else the latents file's, else `DEFAULT_FPS`.

    Raises:
        InputError: the file's rate is not one an MP4 carries (`pan2cli.outputs.FPS_RANGE`).
    """
    if fps is not None:
        return fps
    if source.fps is not None and (problem := fps_problem(source.fps)) is not None:
        raise InputError(
            f"latents file {source.path}: its fps {problem}", hint="pass --fps F to choose the frame rate"
        )
    return source.fps or DEFAULT_FPS


def _check_not_an_input(output: Path, inputs: list[Path]) -> None:
    """An output must not replace an input: the same file (links included), or a folder holding one."""
    for path in inputs:
        if output.exists() and os.path.samefile(output, path):
            raise InputError(
                f"output {output} is the input {path}: writing it would destroy the latents",
                hint="choose another output name",
            )
        if output.is_dir() and path.resolve().is_relative_to(output.resolve()):
            raise InputError(
                f"output {output} holds the input {path}: replacing it would destroy the latents",
                hint="choose another output name",
            )
