"""Memory beside the resident models: what a device has free (`free_memory`), and whether the VAE decoder can stay
beside the transformer while a batch still has videos to denoise (`decoder_fits_beside_transformer`).

The decoder's need is an estimate made before it loads: its weights (counted from its checkpoint) plus the
activation peak of a decode, the memory plan's (`pan2cli.pipeline.memory_plan.decoder_bytes`: the peaks measured
for 704x1248, less the decoder's weights) scaled by the decoder's width against the released one's (test
decoders are narrower). The estimate is one function so that a cap on GPU memory can be added where the
decision is made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pan2cli.host_memory import read_host_memory
from pan2cli.pipeline.memory_plan import DECODER_WEIGHT_BYTES, decoder_bytes

_MEASURED_WIDTH = 256  # decoder_base_dim of the measured VAE: activations grow with the channels
# The allocator's slack (fragmentation, the CUDA context's growth) left free beside the estimate.
DECODER_MARGIN_BYTES = 2**30


def free_memory(device: torch.device, cap_gib: float | None = None) -> tuple[int | None, str]:
    """(bytes free for new tensors on `device`, how to name it): the GPU's free memory (under `--max-gpu-memory`,
    no more than the cap less what this process holds), or what the host has available (`MemAvailable` within the
    cgroup's limit; None where it cannot be read)."""
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
        if cap_gib is None:
            return free, "the GPU"
        return min(
            free, int(cap_gib * 2**30) - torch.cuda.memory_reserved(device)
        ), "the --max-gpu-memory cap"
    host = read_host_memory()
    return (host.available if host is not None else None), "the host"


@dataclass(frozen=True)
class DecoderNeed:
    """What a decode is expected to take on its device: the decoder's weights and its activation peak (bytes)."""

    weights: int
    activations: int

    @property
    def total(self) -> int:
        return self.weights + self.activations


def decoder_need(
    weight_elements: int,
    decoder_width: int,
    height: int,
    width: int,
    chunk_latent_frames: int,
    dtype: torch.dtype,
    kernel: bool,
) -> DecoderNeed:
    """The estimated need of decoding frames of `height` x `width` (module docstring).

    Args:
        weight_elements: the decoder's parameter count (`post_quant_conv` and `decoder.*` of its checkpoint).
        decoder_width: its `decoder_base_dim`.
        chunk_latent_frames: latent frames per pass after the first.
        dtype: the decode's dtype.
        kernel: whether the compiled kernel path decodes (bf16, activations bounded per frame).
    """
    element = torch.empty(0, dtype=dtype).element_size()
    released = decoder_bytes(kernel, height * width, chunk_latent_frames, element) - DECODER_WEIGHT_BYTES
    return DecoderNeed(weight_elements * element, math.ceil(released * decoder_width / _MEASURED_WIDTH))


def decoder_fits_beside_transformer(
    device: torch.device, need: DecoderNeed, cap_gib: float | None = None
) -> tuple[bool, str]:
    """Whether the decoder can load and decode beside the resident transformer (its activations released): the
    device's free memory against `need` and `DECODER_MARGIN_BYTES`. Returns the answer and, when it is no, the
    numbers in words; an unknown free memory counts as room (the host's, where /proc is missing).
    """
    free, where = free_memory(device, cap_gib)
    wanted = need.total + DECODER_MARGIN_BYTES
    if free is None or free >= wanted:
        return True, ""
    return False, (
        f"the decoder needs about {wanted / 2**30:.1f} GiB beside the transformer ({need.weights / 2**30:.1f} GiB of "
        f"weights, {need.activations / 2**30:.1f} GiB for the decode, {DECODER_MARGIN_BYTES / 2**30:.0f} GiB "
        f"margin), {where} has {free / 2**30:.1f} GiB free"
    )
