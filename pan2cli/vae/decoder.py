"""The Wan2.2 VAE decode of `pan2 decode` and `pan2 generate`: open the decoder, then decode latents into frames.

`open_decoder` loads the weights (with Triton's start-up beside them), chooses the engine (the compiled
kernel where it applies, else the reference), and, when several processes decode one video together,
makes every rank learn of a failure on any of them and take the same engine (the kernel only if every
rank could load it). `decode_latents` runs the chunk loop: un-normalise, decode, uint8 on the device,
one copy to host per chunk. Under several processes (torchrun) each rank decodes a band of rows of
every frame and the uint8 rows are all-gathered per chunk (`pan2cli.vae.parallel`); the rank given a
writer writes the frames.

The run-time settings (`RuntimeConfig`: chunk size, engine, row split) are arguments here, never part
of the architecture (`WanVAEConfig`).
"""

from __future__ import annotations

import time
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

import torch

from pan2cli import distributed
from pan2cli.config import DEFAULT_CHUNK_LATENT_FRAMES
from pan2cli.errors import out_of_memory
from pan2cli.frames import HostCopy, copy_to_host_async
from pan2cli.latents import unnormalize
from pan2cli.vae.checkpoint import load_vae_decoder
from pan2cli.vae.kernel.choice import first_use_note, select_decode_path, start_loading_triton
from pan2cli.vae.parallel import row_split_for
from pan2cli.vae.protocol import Decoder

OTHER_RANK_NOTE = "Using the reference decoder: another rank could not use the compiled kernel."


class FrameSink(Protocol):
    """Where decoded frames go (a `pan2cli.video` writer, or the generator's frame collector): typed here
    so that the VAE package does not import the writers."""

    def write(self, frames: torch.Tensor) -> None:
        """Take uint8 `(f, H, W, 3)` CPU frames; the caller does not change them afterwards."""
        ...


@dataclass(frozen=True)
class DecodeStats:
    """What one decode did: frames and size written, seconds spent, peak GPU memory (bytes, CUDA only).

    `seconds` runs from the start of the decode until its last chunk was handed to the writer (an MP4
    writer encodes beside the decode and may finish later: the caller times its commit);
    `first_frame_seconds` until the first frame was handed over.
    """

    frames: int
    height: int
    width: int
    seconds: float
    first_frame_seconds: float | None = None
    peak_allocated: int | None = None
    peak_reserved: int | None = None


def open_decoder(
    spec: str | Path | None,
    revision: str | None = None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    decode_kernel: str = "auto",
    ranks_together: bool = True,
    stage: Callable[[str], AbstractContextManager] | None = None,
    say: Callable[[str], None] | None = None,
) -> tuple[Decoder, str | None]:
    """The decoder to run, and one line saying why the reference runs on a GPU (None otherwise).

    Args:
        spec, revision: the VAE (`load_vae_decoder`).
        dtype, device: as `load_vae_decoder` takes them.
        decode_kernel: "auto" | "off" | "require" (`select_decode_path`).
        ranks_together: every process of the group opens the decoder at this point for one decode
            (`pan2 decode --gpus N`, a shared `generate`): a failure on any rank is raised on all of them
            (`distributed.raise_if_any_failed`) and they agree on the engine. False: this process alone.
        stage: a spinner around the slow steps, called with what runs ("Loading the VAE decoder…").
        say: shows the one-line note of a first use (the kernel built, its convolutions compiled).

    Returns:
        `(decoder, note)`: a `WanKernelDecoder` or the reference `WanVAEDecoder`.
    """
    stage = stage or (lambda message: nullcontext())
    error = decoder = reference = note = None
    triton_loading = start_loading_triton(device, dtype, decode_kernel)  # beside the weights' loading
    try:
        with stage("Loading the VAE decoder…"):
            reference = load_vae_decoder(spec, revision, dtype=dtype, device=device)
        if triton_loading is not None:
            triton_loading.join()
        first_use = first_use_note(reference.device, reference.dtype, decode_kernel)
        if first_use and say is not None:
            say(first_use)  # said once: the decode marks the kernels compiled
        with stage("Building the decode kernel…" if first_use else "Choosing the decode path…"):
            decoder, note = select_decode_path(reference, decode_kernel)
    except torch.OutOfMemoryError as exc:
        error = out_of_memory(exc, "while loading the VAE decoder")
    except Exception as exc:  # a Pan2Error or the unexpected: either way the other ranks must not wait
        error = exc
    if not ranks_together:
        if error is not None:
            raise error
        return decoder, note
    distributed.raise_if_any_failed(error)
    # Every rank takes the same engine: the compiled kernel only if all of them could load it.
    if not distributed.agree_all(decoder is not reference):
        if decoder is not reference:
            note = OTHER_RANK_NOTE
        decoder = reference
    return decoder, note


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_latents(
    decoder: Decoder,
    latents: torch.Tensor,
    writer: FrameSink | None,
    *,
    normalized: bool = True,
    chunk_latent_frames: int = DEFAULT_CHUNK_LATENT_FRAMES,
    split_rows: bool = True,
    on_chunk: Callable[[int], None] | None = None,
) -> DecodeStats:
    """Decode one video's latents and hand its frames to `writer`, one host copy per chunk.

    Args:
        decoder: the Wan2.2 VAE decoder, reference or kernel path (`open_decoder`); its device is used.
        latents: `(48, T, h, w)` or `(1, 48, T, h, w)` float latents, on any device.
        writer: receives uint8 `(f, 16h, 16w, 3)` CPU frames chunk by chunk; None decodes without
            writing (the other ranks of a split decode, which still all-gather the whole frames).
        normalized: the latents are the DiT's normalised ones (un-normalised here with the VAE
            config's per-channel mean/std: `z·std + mean`); False for raw VAE latents.
        chunk_latent_frames: latent frames per pass after the first (the first pass is always one
            frame). The output does not depend on it; larger chunks use more memory and give larger GEMMs.
        split_rows: when several processes decode together (torchrun, `--gpus N`), split every frame
            by rows across them, exchanging one halo row per 3x3 convolution (exact); False makes every
            rank decode the whole video (`RuntimeConfig.decode_kernel_parallel`). No effect in one process.
        on_chunk: called with the number of video frames of each finished chunk (progress).

    Returns:
        `DecodeStats` with the decode seconds (device-synchronised) and, on CUDA, the peak memory.

    Raises:
        OutOfMemoryError: the GPU ran out of memory (exit 1, with a hint to use smaller chunks).
        InputError: the latents have fewer rows than there are ranks.
    """
    device = decoder.device
    z = latents if latents.dim() == 5 else latents.unsqueeze(0)
    # Un-normalise in fp32 before casting to the decoder dtype: bf16 has 8 bits of mantissa.
    z = z.to(device=device, dtype=torch.float32)
    if normalized:
        z = unnormalize(z, decoder.config.latents_mean, decoder.config.latents_std)
    rows = row_split_for(z.shape[-2], split_rows)  # None in one process
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _synchronize(device)
    start = time.perf_counter()
    frames = height = width = 0
    first_frame_at = None

    def deliver(copy: HostCopy) -> None:
        host = copy.wait()
        if writer is not None:
            writer.write(host)
        if on_chunk is not None:
            on_chunk(host.shape[0])

    try:
        pending = None
        for pixels in decoder.decode_uint8_chunks(z, chunk_latent_frames, rows=rows):
            # pixels: (1, f, H, W, 3) uint8 on the device (the band of rows of this rank under a split)
            pixels = pixels[0]
            if rows is not None:
                # uint8 is per pixel, so converting before the gather is exact and moves 1 byte each
                pixels = rows.gather_rows(pixels, dim=1)
            # ONE copy per chunk, on a side stream: the previous chunk is handed to the writer while
            # this one travels and the next one decodes. Ranks without a writer copy nothing.
            copy = copy_to_host_async(pixels) if writer is not None else HostCopy(pixels, None)
            if pending is not None:
                deliver(pending)
            pending = copy
            if frames == 0:  # the first chunk (one frame) goes out at once: the output file starts now
                deliver(pending)
                pending = None
                first_frame_at = time.perf_counter() - start
            frames += pixels.shape[0]
            height, width = pixels.shape[1], pixels.shape[2]
        if pending is not None:
            deliver(pending)
        _synchronize(device)
    except torch.OutOfMemoryError as exc:
        raise out_of_memory(
            exc,
            f"while decoding {tuple(z.shape)} latents with {chunk_latent_frames} latent frames per chunk",
            hint="pass a smaller --chunk-latent-frames (1 uses the least memory), or free the GPU",
        ) from exc
    seconds = time.perf_counter() - start
    peak = (
        (torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device))
        if device.type == "cuda"
        else (None, None)
    )
    return DecodeStats(frames, height, width, seconds, first_frame_at, *peak)
