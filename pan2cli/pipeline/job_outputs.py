"""The files of a finished video beside its MP4: its latents file (`--save-latents`, and the latents kept when the video
cannot be written: `keep_latents`), and the error that says how to finish such a video with `pan2 decode`.

A video's latents are the result of its denoising, minutes to hours of work: whatever stops its MP4 (a full disk,
ffmpeg, a folder that is not writable, the output taken meanwhile), they are written to `<stem>.latents.pt` beside
the intended output (another name if that one is taken; the temporary folder if the output's folder fails), and the
error names the file and the exact `pan2 decode` command that makes the video from it.
"""

from __future__ import annotations

import os
import shlex
import tempfile
from pathlib import Path
from typing import Any

from pan2cli.atomic import replace_into, save_torch
from pan2cli.errors import Pan2Error
from pan2cli.outputs import DEFAULT_CRF
from pan2cli.pipeline.jobs import GenerationJob, GenerationResult, latents_path_for


def latents_payload(result: GenerationResult, vae: dict[str, Any] | None) -> dict[str, Any]:
    """What a latents file holds: the normalised latents `[48, T, h, w]` and the frame rate (what `pan2 decode`
    reads), the video's size, length, seed and prompt, and the identity of the VAE they belong to (`vae`, when
    known: `pan2cli.vae.identity`)."""
    settings = result.job.settings
    payload = {
        "latents": result.latents[0].contiguous(), "fps": float(settings.fps), "height": settings.height,
        "width": settings.width, "frames": settings.frames, "seed": settings.seed, "prompt": settings.prompt,
    }  # fmt: skip
    if vae is not None:
        payload["vae"] = vae
    return payload


def save_latents(path: Path, payload: dict[str, Any]) -> None:
    """Write a latents file atomically.

    Raises:
        Pan2Error: the write failed (`could not write PATH: no space left on device`).
    """
    replace_into(path, lambda tmp: save_torch(payload, tmp))


def recovery_path(job: GenerationJob) -> Path:
    """Where a video's latents are kept beside its output: `<stem>.latents.pt` (the `--save-latents` file, or a
    free name), else `<stem>.<pid>.latents.pt`, so that no other file is replaced."""
    beside = latents_path_for(job.output)
    if job.latents_path == beside or not (beside.exists() or beside.is_symlink()):
        return beside
    return beside.with_name(f"{job.output.stem}.{os.getpid()}.latents.pt")


def keep_latents(job: GenerationJob, payload: dict[str, Any]) -> Path:
    """Write a video's latents where they can be found again: beside its output (`recovery_path`), else in the
    temporary folder.

    Returns:
        The file written.

    Raises:
        Pan2Error: neither place could be written (the second place's error).
    """
    beside = recovery_path(job)
    fallback = Path(tempfile.gettempdir()) / f"{job.output.stem}.{os.getpid()}.latents.pt"
    try:
        save_latents(beside, payload)
        return beside
    except Pan2Error:
        save_latents(fallback, payload)
        return fallback


def decode_command(latents: Path, job: GenerationJob, vae: Path) -> str:
    """The `pan2 decode` command that makes `job`'s video from its latents file (the shell's quoting)."""
    words = ["pan2", "decode", str(latents), "-o", str(job.output), "--vae", str(vae)]
    if job.crf != DEFAULT_CRF:
        words += ["--crf", str(job.crf)]
    return shlex.join(words)


def finishing_hint(kept: Path | None, job: GenerationJob, vae: Path, why_not: str | None = None) -> str:
    """The hint of a video that was denoised but not written: where its latents are and how to finish it."""
    if kept is None:
        return f"its latents could not be kept either: {why_not}"
    return f"its latents are in {kept}; to make the video: {decode_command(kept, job, vae)}"


def with_hint(error: BaseException, hint: str) -> Pan2Error:
    """`error` with `hint` added (a Pan2Error keeps its class and exit code; anything else becomes a Pan2Error)."""
    if not isinstance(error, Pan2Error):
        wrapped = Pan2Error(str(error) or type(error).__name__)
        wrapped.__cause__ = error
        error = wrapped
    error.hint = f"{error.hint}; {hint}" if error.hint else hint
    return error


def remove_quietly(path: Path | None) -> None:
    if path is not None:
        try:
            path.unlink()
        except OSError:
            pass
