"""`pan2 decode`: Wan2.2 VAE latents → MP4 (or PNG frames, or a uint8 tensor).

Usage: pan2 decode LATENTS... [-o OUT] [--vae PATH|REPO] [--format mp4|png|pt] [--gpus N] [...]

With `--gpus N` the command re-launches itself in N processes (`pan2cli.distributed.launcher`); each rank then
runs `_decode`: inputs checked and the model loaded on every rank with a sync point after each, rank 0
alone writing and printing. torch and the decoder are imported inside `_decode`: `pan2 --help` does not
load them.
"""

from __future__ import annotations

import dataclasses
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

import click

from pan2cli.cli._options import (
    check_fps,
    device_option,
    dtype_option,
    gpus_option,
    ignored_revision,
    quiet_option,
)
from pan2cli.cli._output import gib, info, progress_bar, result, status, warn
from pan2cli.config import DECODE_KERNEL_MODES, DEFAULT_CHUNK_LATENT_FRAMES, RuntimeConfig
from pan2cli.distributed.run import run_on_ranks
from pan2cli.errors import InputError, Pan2Error
from pan2cli.outputs import (
    DEFAULT_CRF,
    DEFAULT_X264_PRESET,
    MAX_FPS,
    MIN_FPS,
    OUTPUT_FORMATS,
    X264_PRESETS,
    check_not_stdout,
    check_output_path,
    default_output_path,
    fps_problem,
)
from pan2cli.vae.config import DEFAULT_VAE_REPO

if TYPE_CHECKING:
    from pan2cli.latents import LatentInput

DEFAULT_FPS = 24.0
_SUFFIX_FORMATS = {".mp4": "mp4", ".pt": "pt"}


@dataclass(frozen=True)
class DecodeOptions:
    """`pan2 decode`'s parameters as parsed (see `decode_command`); each rank runs `_decode` with its own `runtime.device`."""

    latents: tuple[Path, ...]
    output: str | None
    vae: str | None
    revision: str | None
    runtime: RuntimeConfig
    fps: float | None
    crf: int
    x264_preset: str
    fmt: str | None
    raw_latents: bool
    overwrite: bool
    quiet: bool


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


def _frame_rate(fps: float | None, source: LatentInput) -> float:
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


@click.command("decode")
@click.argument("latents", nargs=-1, required=True, type=click.Path(dir_okay=False, path_type=Path))
@click.option(
    "-o",
    "--output",
    type=click.Path(),  # a str: a trailing slash (a folder) survives
    default=None,
    help="Output: a .mp4 or .pt file (the suffix chooses the format) or, with --format png, the folder of frames "
    "(created). A batch [B,48,...] writes NAME_0.mp4, NAME_1.mp4, ... An existing folder (a trailing / says you "
    "mean one) receives <stem>.mp4 or <stem>.pt; several inputs need one (PNG: <stem>/ each).  "
    "[default: next to each input, same stem]",
)
@click.option(
    "--vae",
    default=None,
    metavar="PATH|REPO",
    help=f"VAE checkpoint: Wan2.2_VAE.pth, a .safetensors file, a diffusers folder, or a Hugging Face repo id "
    "(read from the local cache when the hub is unreachable).  "
    f"[default: {DEFAULT_VAE_REPO}]",
)
@click.option(
    "--revision", default=None, help="Branch, tag or commit of the Hugging Face repo given by --vae."
)
@dtype_option
@device_option
@click.option(
    "--decode-kernel",
    type=click.Choice(DECODE_KERNEL_MODES),
    default="auto",
    show_default=True,
    help="The compiled CUDA decoder (bf16, sm_90a/sm_100a/sm_103a; built on first use and cached): auto uses it "
    "where it applies and says why not on a GPU, off always runs the reference PyTorch decoder, require fails "
    "when the kernel cannot run.",
)
@click.option(
    "--chunk-latent-frames",
    type=click.IntRange(min=1),
    default=DEFAULT_CHUNK_LATENT_FRAMES,
    show_default=True,
    help="Latent frames per decoder pass after the first (4 video frames each); smaller uses less memory, "
    "the output is the same.",
)
@click.option(
    "--fps",
    type=float,
    callback=check_fps,
    default=None,
    help=f"Frame rate of the video, {MIN_FPS:g} to {MAX_FPS:g}.  [default: the latents file's `fps`, else {DEFAULT_FPS:g}]",
)
@click.option(
    "--crf",
    type=click.IntRange(0, 51),
    default=DEFAULT_CRF,
    show_default=True,
    help="H.264 quality for MP4 (0 lossless, 51 worst; 17 is visually lossless).",
)
@click.option(
    "--x264-preset",
    type=click.Choice(X264_PRESETS),
    default=DEFAULT_X264_PRESET,
    show_default=True,
    help="x264 speed for MP4 (the quality is --crf's): slower presets squeeze the file a little more but fall "
    "behind the decode on a GPU.",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(OUTPUT_FORMATS),
    default=None,
    help="mp4 (H.264, yuv420p), png (a folder of frames) or pt (a uint8 tensor [F,H,W,3]).  "
    "[default: from the -o suffix, else mp4]",
)
@click.option(
    "--raw-latents",
    is_flag=True,
    help="The latents are raw VAE latents: skip the un-normalisation (z·std + mean) applied to the DiT's output.",
)
@click.option("--overwrite", is_flag=True, help="Replace existing outputs (otherwise they are an error).")
@gpus_option
@quiet_option
@click.pass_context
def decode_command(
    ctx,
    latents,
    output,
    vae,
    revision,
    dtype,
    device,
    decode_kernel,
    chunk_latent_frames,
    fps,
    crf,
    x264_preset,
    fmt,
    raw_latents,
    overwrite,
    gpus,
    quiet,
):
    """Decode Wan2.2 VAE latents (PAN 2 DiT output) into video.

    LATENTS are `.pt` files holding a tensor [48,T,H,W] or [B,48,T,H,W] (or a dict with `latents`
    and optional `fps`), or `.safetensors` files with a `latents` tensor. T latent frames give
    1 + 4·(T−1) video frames of 16H x 16W pixels. The model is loaded once for all inputs.
    The paths written are printed on stdout; progress and a summary go to stderr.

    \b
    Examples:
      pan2 decode latents.pt -o video.mp4
      pan2 decode run1.pt run2.pt -o videos/ --vae ./Wan2.2_VAE.pth
      pan2 decode latents.pt --format png --device cpu --dtype fp32
      pan2 decode latents.pt -o video.mp4 --gpus 2
    """
    runtime = RuntimeConfig(
        device=device, dtype=dtype, decode_kernel=decode_kernel, chunk_latent_frames=chunk_latent_frames
    )
    options = DecodeOptions(
        latents=latents, output=output, vae=vae, revision=revision, runtime=runtime, fps=fps, crf=crf,
        x264_preset=x264_preset, fmt=fmt, raw_latents=raw_latents, overwrite=overwrite, quiet=quiet,
    )  # fmt: skip

    def on_rank(rank_device) -> None:
        device = None if rank_device is None else str(rank_device)
        _decode(dataclasses.replace(options, runtime=dataclasses.replace(runtime, device=device)))

    run_on_ranks(ctx, gpus, device, on_rank, check_split=lambda world: _check_row_split(latents, world))


def _check_row_split(latents: Iterable[LatentInput | Path], world: int) -> None:
    """Every video's latent rows can be split over `world` processes, one row each at least: in pan2's
    launcher before any process starts (`latents` as paths), and on each rank (a user's own torchrun).

    Raises:
        InputError: fewer latent rows than processes, or latents that cannot be read.
    """
    from pan2cli.latents import load_latents
    from pan2cli.vae.parallel import split_rows

    for source in latents:
        source = load_latents(source) if isinstance(source, Path) else source
        split_rows(source.latents.shape[-2], world)


def _decode(options: DecodeOptions):
    """The decode command's work in this process: the only one, or one rank of several (`device` then set)."""
    import torch

    from pan2cli import distributed
    from pan2cli.ffmpeg import check_mp4_encoder
    from pan2cli.latents import load_latents
    from pan2cli.vae.decoder import decode_latents, open_decoder
    from pan2cli.vae.identity import check_latents_vae, vae_identity
    from pan2cli.vae.kernel.choice import check_decode_kernel_mode
    from pan2cli.vae.kernel.decoder import WanKernelDecoder
    from pan2cli.video import open_video_writer

    main = distributed.is_main()
    quiet = options.quiet or not main  # progress and summaries come from rank 0
    world = distributed.world_size()

    # 1. Check every input and output before any model loads. Every rank runs the same checks, so a
    #    bad input fails everywhere and rank 0 alone reports it (distributed.raise_if_any_failed).
    error = None
    try:
        sources = [load_latents(path) for path in options.latents]
        fmt, jobs = plan_outputs(sources, options.output, options.fmt)
        for job in jobs:
            check_output_path(job.output, options.overwrite)
            _frame_rate(options.fps, job.source)
        device = options.runtime.torch_device()
        torch_dtype = options.runtime.torch_dtype(device)
        check_decode_kernel_mode(options.runtime.decode_kernel, device, torch_dtype)
        if fmt == "mp4":
            check_mp4_encoder()
        made_for = [source for source in sources if source.vae is not None]
        if made_for:  # latents that say which VAE they belong to: that VAE, or an error naming both
            vae = vae_identity(options.vae, options.revision)
            for source in made_for:
                check_latents_vae(source.path, source.vae, vae, options.vae or DEFAULT_VAE_REPO)
        if world > 1:
            _check_row_split(sources, world)
    except Pan2Error as exc:
        error = exc
    distributed.raise_if_any_failed(error)
    if main and (line := ignored_revision(options.revision, options.vae, "--vae")):
        warn(line)
    if main and device.type == "cpu" and torch_dtype == torch.bfloat16:
        # PyTorch's bf16 convolutions are much slower than fp32's on CPUs without AVX512-BF16 and close to them on
        # CPUs with it: no factor is promised.
        warn(
            "--dtype bf16 on the CPU is much slower than fp32 on most CPUs (PyTorch has fast bf16 convolutions only on "
            "some); use --dtype fp32"
        )

    # 2. Load the decoder once; no rank goes on to the decode's collectives if one failed here.
    start = time.perf_counter()
    decoder, note = open_decoder(
        options.vae,
        options.revision,
        dtype=torch_dtype,
        device=device,
        decode_kernel=options.runtime.decode_kernel,
        stage=lambda message: status(message, quiet),
        say=lambda line: info(line, quiet),
    )
    if note:
        info(note, quiet)
    info(
        f"Loaded the VAE decoder in {time.perf_counter() - start:.1f} s ({device}, {str(torch_dtype).removeprefix('torch.')}).",
        quiet,
    )

    # 3. Decode each video, writing it chunk by chunk (rank 0 writes; the others decode their rows).
    for job in jobs:
        z = job.source.latents[job.index]
        frame_rate = _frame_rate(options.fps, job.source)
        started = time.perf_counter()
        writing = (
            open_video_writer(
                job.output,
                fmt,
                frame_rate,
                crf=options.crf,
                overwrite=options.overwrite,
                preset=options.x264_preset,
            )
            if main
            else nullcontext()
        )
        with writing as writer, distributed.partial_output(writer.tmp_path if writer is not None else None):
            total = decoder.config.frames_out(z.shape[1])
            with progress_bar(
                f"Decoding {job.source.path.name}",
                total=total,
                unit="frames",
                quiet=quiet,
                first="first frame",
            ) as advance:
                stats = decode_latents(
                    decoder,
                    z,
                    writer,
                    normalized=not options.raw_latents,
                    chunk_latent_frames=options.runtime.chunk_latent_frames,
                    split_rows=options.runtime.decode_kernel_parallel,
                    on_chunk=advance,
                )
        if not main:
            continue
        # total: until the file is in place (an MP4's encode runs beside the decode and ends after it)
        total_seconds = time.perf_counter() - started
        result(str(job.output))
        path_name = "compiled kernel" if isinstance(decoder, WanKernelDecoder) else "reference decoder"
        summary = (
            f"{job.output}: {stats.frames} frames, {stats.height}x{stats.width}, {frame_rate:g} fps; "
            f"decode {stats.seconds:.2f} s ({path_name}, {stats.frames / stats.seconds:.1f} frames/s, "
            f"first frame after {stats.first_frame_seconds:.2f} s), total {total_seconds:.2f} s"
        )
        if stats.peak_allocated is not None:
            summary += f"; peak GPU memory {gib(stats.peak_allocated)} allocated, {gib(stats.peak_reserved)} reserved"
            if world > 1:
                summary += f" (rank 0 of {world})"
        info(summary, quiet)
