"""Decode latents into a frame writer, chunk by chunk: un-normalise, decode, uint8 on the device, one copy to host.

Under several processes (torchrun) each rank decodes a band of rows of every frame and the uint8 rows
are all-gathered per chunk (`pan2cli.vae.parallel`); the rank given a writer writes the frames.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from pan2cli.errors import out_of_memory
from pan2cli.frames import HostCopy, copy_to_host_async
from pan2cli.latents import unnormalize
from pan2cli.vae.kernel.decoder import WanKernelDecoder
from pan2cli.vae.model import WanVAEDecoder
from pan2cli.vae.parallel import row_split_for
from pan2cli.video import VideoWriter


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


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_latents(
    decoder: WanVAEDecoder | WanKernelDecoder,
    latents: torch.Tensor,
    writer: VideoWriter | None,
    *,
    normalized: bool = True,
    chunk_latent_frames: int | None = None,
    on_chunk: Callable[[int], None] | None = None,
) -> DecodeStats:
    """Decode one video's latents and hand its frames to `writer`, one host copy per chunk.

    Args:
        decoder: the Wan2.2 VAE decoder, reference or kernel path (`select_decode_path`); its device is used.
        latents: `(48, T, h, w)` or `(1, 48, T, h, w)` float latents, on any device.
        writer: receives uint8 `(f, 16h, 16w, 3)` CPU frames chunk by chunk; None decodes without
            writing (the other ranks of a split decode, which still all-gather the whole frames).
        normalized: the latents are the DiT's normalised ones (un-normalised here with the VAE
            config's per-channel mean/std: `z·std + mean`); False for raw VAE latents.
        chunk_latent_frames: latent frames per pass after the first (default: the decoder config's).
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
    chunk = chunk_latent_frames or decoder.config.chunk_latent_frames
    rows = row_split_for(decoder.config, z.shape[-2])  # None in one process
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
        for pixels in decoder.decode_uint8_chunks(z, chunk, rows=rows):
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
            f"while decoding {tuple(z.shape)} latents with {chunk} latent frames per chunk",
            hint="pass a smaller --chunk-latent-frames (1 uses the least memory), or free the GPU",
        ) from exc
    seconds = time.perf_counter() - start
    peak = (
        (torch.cuda.max_memory_allocated(device), torch.cuda.max_memory_reserved(device))
        if device.type == "cuda"
        else (None, None)
    )
    return DecodeStats(frames, height, width, seconds, first_frame_at, *peak)
