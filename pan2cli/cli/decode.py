"""`pan2 decode`: Wan2.2 VAE latents → MP4 (or PNG frames, or a uint8 tensor).

Usage: pan2 decode LATENTS... [-o OUT] [--vae PATH|REPO] [--format mp4|png|pt] [--gpus N] [...]

The options, printing and progress; the work is `pan2cli.decoding.files.decode_files`. With `--gpus N` the command
re-launches itself in N processes (`pan2cli.distributed.launcher`) and each rank runs it, rank 0 alone writing and printing. torch
and the decoder are imported when the command runs: `pan2 --help` does not load them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import click

from pan2cli.cli._options import (
    check_fps,
    crf_option,
    decode_kernel_option,
    device_option,
    dtype_option,
    gpus_option,
    ignored_revision,
    overwrite_option,
    quiet_option,
)
from pan2cli.cli._output import gib, info, progress_bar, result, status, warn
from pan2cli.config import DEFAULT_CHUNK_LATENT_FRAMES, RuntimeConfig
from pan2cli.decoding.outputs import DEFAULT_FPS
from pan2cli.distributed.run import run_on_ranks
from pan2cli.outputs import DEFAULT_X264_PRESET, MAX_FPS, MIN_FPS, OUTPUT_FORMATS, X264_PRESETS
from pan2cli.vae.config import DEFAULT_VAE_REPO


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
@decode_kernel_option
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
@crf_option
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
@overwrite_option
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
    from pan2cli.decoding.files import DecodeRequest, check_row_split

    runtime = RuntimeConfig(
        device=device, dtype=dtype, decode_kernel=decode_kernel, chunk_latent_frames=chunk_latent_frames
    )
    request = DecodeRequest(
        latents=latents, output=output, vae=vae, revision=revision, fps=fps, crf=crf, x264_preset=x264_preset,
        fmt=fmt, raw_latents=raw_latents, overwrite=overwrite,
    )  # fmt: skip

    def on_rank(rank_device) -> None:
        device = None if rank_device is None else str(rank_device)
        _decode(request, dataclasses.replace(runtime, device=device), quiet)

    run_on_ranks(ctx, gpus, device, on_rank, check_split=lambda world: check_row_split(latents, world))


def _decode(request, runtime: RuntimeConfig, quiet: bool) -> None:
    """The command's work in this process (`decode_files`), its results and summaries printed by rank 0."""
    from pan2cli import distributed
    from pan2cli.decoding.files import decode_files

    main = distributed.is_main()
    quiet = quiet or not main
    if main and (line := ignored_revision(request.revision, request.vae, "--vae")):
        warn(line)
    world = distributed.world_size()

    def written(video) -> None:
        result(str(video.output))
        stats = video.stats
        summary = (
            f"{video.output}: {stats.frames} frames, {stats.height}x{stats.width}, {video.fps:g} fps; "
            f"decode {stats.seconds:.2f} s ({video.decoder}, {stats.frames / stats.seconds:.1f} frames/s, "
            f"first frame after {stats.first_frame_seconds:.2f} s), total {video.total_seconds:.2f} s"
        )
        if stats.peak_allocated is not None:
            summary += f"; peak GPU memory {gib(stats.peak_allocated)} allocated, {gib(stats.peak_reserved)} reserved"
            if world > 1:
                summary += f" (rank 0 of {world})"
        info(summary, quiet)

    def progress(name: str, total: int):
        return progress_bar(f"Decoding {name}", total=total, unit="frames", quiet=quiet, first="first frame")

    decode_files(
        request, runtime, progress=progress, status=lambda message: status(message, quiet),
        info=lambda line: info(line, quiet), warn=warn, on_written=written,
    )  # fmt: skip
