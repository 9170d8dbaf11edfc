"""`decode_files`: `pan2 decode`'s work in this process (the only one, or one rank of several): latents files in,
videos out, the decoder loaded once.

Every input and output is checked before the decoder loads, on every rank (a bad input fails everywhere and rank 0
alone reports it); each rank then decodes its rows of every frame and rank 0 writes (`decode_and_write`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch

from pan2cli import distributed
from pan2cli.config import RuntimeConfig, runtime_with
from pan2cli.decoding.outputs import frame_rate, plan_outputs
from pan2cli.decoding.write import Progress, VideoTarget, decode_and_write
from pan2cli.errors import Pan2Error
from pan2cli.latents import LatentInput, load_latents
from pan2cli.outputs import DEFAULT_CRF, DEFAULT_X264_PRESET, check_output_path
from pan2cli.vae.config import DEFAULT_VAE_REPO
from pan2cli.vae.decoder import DecodeStats, open_decoder


@dataclass(frozen=True)
class DecodeRequest:
    """What `pan2 decode` was asked for (its options but the run-time ones, `RuntimeConfig`).

    Attributes:
        latents: the latents files.
        output: `-o` as typed (a trailing slash names a folder: `plan_outputs`); None: next to each input.
        vae, revision: the VAE (`pan2cli.vae.checkpoint.load_vae_decoder`); None: `DEFAULT_VAE_REPO`.
        fps: the frame rate; None: each file's, else `DEFAULT_FPS`.
        crf, x264_preset: the MP4's H.264 quality and x264's speed.
        fmt: "mp4", "png" or "pt"; None: from the output's suffix, else mp4.
        raw_latents: the files hold raw VAE latents (no `z·std + mean`).
        overwrite: existing outputs may be replaced.
    """

    latents: Sequence[Path]
    output: str | None = None
    vae: str | None = None
    revision: str | None = None
    fps: float | None = None
    crf: int = DEFAULT_CRF
    x264_preset: str = DEFAULT_X264_PRESET
    fmt: str | None = None
    raw_latents: bool = False
    overwrite: bool = False


@dataclass(frozen=True)
class DecodedVideo:
    """One video written: from batch item `index` of `source` to `output`, at `fps`; the decode's statistics, the
    seconds until the file was in place (`total_seconds`: an MP4 is encoded beside the decode and ends after it),
    and the decoder that ran ("compiled kernel" or "reference decoder")."""

    source: Path
    index: int
    output: Path
    fps: float
    stats: DecodeStats
    total_seconds: float
    decoder: str


def check_row_split(latents: Iterable[LatentInput | Path], world: int) -> None:
    """Every video's latent rows can be split over `world` processes, one row each at least: in pan2's launcher
    before any process starts (`latents` as paths), and on each rank (a user's own torchrun).

    Raises:
        InputError: fewer latent rows than processes, or latents that cannot be read.
    """
    from pan2cli.vae.parallel import split_rows

    for source in latents:
        source = load_latents(source) if isinstance(source, Path) else source
        split_rows(source.latents.shape[-2], world)


def decode_files(
    request: DecodeRequest,
    config: RuntimeConfig,
    *,
    progress: Callable[[str, int], Progress] | None = None,
    status: Callable[[str], object] | None = None,
    info: Callable[[str], None] = lambda line: None,
    warn: Callable[[str], None] = lambda line: None,
    on_written: Callable[[DecodedVideo], None] = lambda video: None,
) -> list[DecodedVideo]:
    """Decode every video of `request` with the decoder loaded once; each written chunk by chunk, whole or not at all.

    Args:
        request: the files and outputs.
        config: how the decoder runs (device, dtype, `decode_kernel`, `chunk_latent_frames`, `decode_kernel_parallel`:
            the rows split over the processes of a torchrun).
        progress: `progress(name, total)` gives a video's decode progress (`decode_and_write`), `name` its input.
        status: a spinner around the decoder's load (`pan2cli.vae.decoder.open_decoder`'s `stage`).
        info, warn: one-line notes (the load, a first use) and warnings (bf16 on the CPU), said by rank 0.
        on_written: called on rank 0 with each video as soon as it is written.

    Returns:
        The videos written (on rank 0; the other ranks write nothing).

    Raises:
        InputError: a bad input or output, found before the decoder loads (every rank; rank 0 says it).
        Pan2Error: the decoder failed to load, or a decode or write failed.
    """
    from pan2cli.ffmpeg import check_mp4_encoder
    from pan2cli.vae.identity import check_latents_vae, vae_identity
    from pan2cli.vae.kernel.choice import check_decode_kernel_mode
    from pan2cli.vae.kernel.decoder import WanKernelDecoder

    main, world = distributed.is_main(), distributed.world_size()
    config = runtime_with(None, config)
    # 1. Every input and output checked before the decoder loads, on every rank.
    error = None
    try:
        sources = [load_latents(path) for path in request.latents]
        fmt, jobs = plan_outputs(sources, request.output, request.fmt)
        for job in jobs:
            check_output_path(job.output, request.overwrite)
            frame_rate(request.fps, job.source)
        device = config.torch_device()
        dtype = config.torch_dtype(device)
        check_decode_kernel_mode(config.decode_kernel, device, dtype)
        if fmt == "mp4":
            check_mp4_encoder()
        made_for = [source for source in sources if source.vae is not None]
        if made_for:  # latents that say which VAE they belong to: that VAE, or an error naming both
            vae = vae_identity(request.vae, request.revision)
            for source in made_for:
                check_latents_vae(source.path, source.vae, vae, request.vae or DEFAULT_VAE_REPO)
        if world > 1:
            check_row_split(sources, world)
    except Pan2Error as exc:
        error = exc
    distributed.raise_if_any_failed(error)
    if not main:  # progress and notes come from rank 0
        info = warn = lambda line: None
        progress = status = None
    if device.type == "cpu" and dtype == torch.bfloat16:
        # PyTorch's bf16 convolutions are much slower than fp32's on CPUs without AVX512-BF16 and close to them on
        # CPUs with it: no factor is promised.
        warn(
            "--dtype bf16 on the CPU is much slower than fp32 on most CPUs (PyTorch has fast bf16 convolutions only on "
            "some); use --dtype fp32"
        )

    # 2. The decoder, loaded once; no rank goes on to the decode's collectives if one failed here.
    start = time.perf_counter()
    decoder, note = open_decoder(
        request.vae, request.revision, dtype=dtype, device=device, decode_kernel=config.decode_kernel,
        stage=status, say=info,
    )  # fmt: skip
    if note:
        info(note)
    info(
        f"Loaded the VAE decoder in {time.perf_counter() - start:.1f} s ({device}, {str(dtype).removeprefix('torch.')})."
    )
    path_name = "compiled kernel" if isinstance(decoder, WanKernelDecoder) else "reference decoder"

    # 3. Each video decoded (each rank its rows) and written by rank 0.
    written = []
    for job in jobs:
        fps = frame_rate(request.fps, job.source)
        target = None
        if main:
            target = VideoTarget(
                job.output,
                fmt,
                fps,
                crf=request.crf,
                x264_preset=request.x264_preset,
                overwrite=request.overwrite,
            )
        started = time.perf_counter()
        video = decode_and_write(
            decoder, job.source.latents[job.index], target, normalized=not request.raw_latents,
            chunk_latent_frames=config.chunk_latent_frames, split_rows=config.decode_kernel_parallel,
            **({"progress": partial(progress, job.source.path.name)} if progress is not None else {}),
        )  # fmt: skip
        if main:
            done = DecodedVideo(
                job.source.path,
                job.index,
                job.output,
                fps,
                video.stats,
                time.perf_counter() - started,
                path_name,
            )
            written.append(done)
            on_written(done)
    return written
