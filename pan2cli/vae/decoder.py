"""Open the Wan2.2 VAE decoder for a decode: the one entry point of `pan2 decode` and `pan2 generate`.

Load the weights (with Triton's start-up beside them), choose the engine (the compiled kernel where it
applies, else the reference), and, when several processes decode one video together, make every rank
learn of a failure on any of them and take the same engine (the kernel only if every rank could load it).
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Callable

import torch

from pan2cli import distributed
from pan2cli.config import DEFAULT_CHUNK_LATENT_FRAMES
from pan2cli.errors import out_of_memory
from pan2cli.vae.checkpoint import load_vae_decoder
from pan2cli.vae.kernel.choice import first_use_note, select_decode_path, start_loading_triton

OTHER_RANK_NOTE = "Using the reference decoder: another rank could not use the compiled kernel."


def open_decoder(
    spec: str | Path | None,
    revision: str | None = None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    chunk_latent_frames: int = DEFAULT_CHUNK_LATENT_FRAMES,
    decode_kernel: str = "auto",
    split_rows: bool = True,
    ranks_together: bool = True,
    stage: Callable[[str], AbstractContextManager] | None = None,
    say: Callable[[str], None] | None = None,
):
    """The decoder to run, and one line saying why the reference runs on a GPU (None otherwise).

    Args:
        spec, revision: the VAE (`load_vae_decoder`).
        dtype, device, chunk_latent_frames, decode_kernel: as `load_vae_decoder` takes them.
        split_rows: let the ranks of one decode split each frame by rows (`decode_kernel_parallel`).
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
            reference = load_vae_decoder(
                spec,
                revision,
                dtype=dtype,
                device=device,
                chunk_latent_frames=chunk_latent_frames,
                decode_kernel=decode_kernel,
            )
        reference.config = reference.config.replace(decode_kernel_parallel=split_rows)
        if triton_loading is not None:
            triton_loading.join()
        first_use = first_use_note(reference.device, reference.dtype, decode_kernel)
        if first_use and say is not None:
            say(first_use)  # said once: the decode marks the kernels compiled
        with stage("Building the decode kernel…" if first_use else "Choosing the decode path…"):
            decoder, note = select_decode_path(reference)
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
