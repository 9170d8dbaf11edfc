"""`pan2cli.vae.decoder`: the run-time settings are call arguments, never part of the architecture config."""

from __future__ import annotations

import dataclasses

import torch

from pan2cli.config import RuntimeConfig
from pan2cli.testing.random_weights import random_decoder
from pan2cli.vae.config import WanVAEConfig
from pan2cli.vae.decoder import DecodeStats, decode_latents
from pan2cli.vae.model import WanVAEDecoder
from pan2cli.vae.protocol import Decoder

SMALL = WanVAEConfig(base_dim=16, decoder_base_dim=16)


class _Frames:
    """A `FrameSink` that keeps what it is given."""

    def __init__(self):
        self.chunks: list[torch.Tensor] = []

    def write(self, frames: torch.Tensor) -> None:
        self.chunks.append(frames)


def _decoder() -> WanVAEDecoder:
    return random_decoder(SMALL, seed=4, dtype=torch.float32, device="cpu")


def test_the_architecture_config_holds_no_runtime_setting():
    """Chunk size, engine and row split are `RuntimeConfig`'s; a `WanVAEConfig` field of the same name
    would be a second home for them (the issue: flag → dict → loader → config → decoder → read back)."""
    architecture = {f.name for f in dataclasses.fields(WanVAEConfig)}
    runtime = {f.name for f in dataclasses.fields(RuntimeConfig)}
    assert architecture.isdisjoint(runtime)
    assert not {"chunk_latent_frames", "decode_kernel", "decode_kernel_parallel"} & architecture


def test_the_chunk_size_is_a_call_argument():
    """One decoder, two chunk sizes: other passes (1 + 1 + 1 + 1 + 1 frames vs 1 + 3 + 1), the same video.

    Not bit-exact: another chunking is another summation order, which CPU BLAS rounds differently.
    """
    decoder = _decoder()
    assert isinstance(decoder, Decoder)  # the protocol `decode_latents` takes
    latents = torch.randn(48, 5, 2, 3, generator=torch.Generator().manual_seed(1))
    z = latents[None]
    floats = {n: decoder.decode(z, chunk_latent_frames=n) for n in (1, 3)}
    assert floats[1].shape == floats[3].shape == (1, 3, 17, 32, 48)
    assert (floats[1] - floats[3]).abs().max().item() < 1e-4

    passes, frames = {}, {}
    for n in (1, 3):
        sink = _Frames()
        stats = decode_latents(decoder, latents, sink, normalized=False, chunk_latent_frames=n)
        passes[n] = [chunk.shape[0] for chunk in sink.chunks]
        frames[n] = torch.cat(sink.chunks).int()
        assert isinstance(stats, DecodeStats) and (stats.frames, stats.height, stats.width) == (17, 32, 48)
    assert passes == {1: [1, 4, 4, 4, 4], 3: [1, 12, 4]}
    assert (frames[1] - frames[3]).abs().max().item() <= 1  # a float a hair apart may round to another level
