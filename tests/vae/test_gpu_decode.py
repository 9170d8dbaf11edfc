"""The reference decoder on a CUDA GPU: full-size weights, bf16 chunk invariance, agreement with fp64 on the CPU."""

from __future__ import annotations

import pytest
import torch

from pan2cli.frames import frames_to_uint8
from pan2cli.testing.random_weights import decoder_from_state, random_vae_state_dict
from pan2cli.vae.config import WanVAEConfig

# Up to 12 GiB (full-width fp32 decodes): in turn with the other full-size tests (docs/TESTING.md).
pytestmark = [pytest.mark.gpu, pytest.mark.xdist_group("full-size-gpu-memory")]


def _decoder(state, dtype, device, config=None):
    return decoder_from_state(state, config, dtype=dtype, device=device)


def test_fp32_output_does_not_depend_on_the_chunk_size(full_size_state):
    """IEEE fp32 (TF32 off) on the GPU: chunk sizes 1, 2, 4, 8 give frames within 1 of each other.

    (In bf16 the reference path's cuDNN convolutions pick different algorithms for different chunk
    shapes and random-weight rounding differences grow past 1 level; the kernel path's bf16 invariance
    is tested in test_kernel_decoder.py.)
    """
    decoder = _decoder(full_size_state, torch.float32, "cuda")
    z = torch.randn(1, 48, 9, 6, 10, device="cuda")
    frames = [frames_to_uint8(decoder.decode(z, chunk_latent_frames=n)[0]).int() for n in (1, 2, 4, 8)]
    assert frames[0].shape == (33, 96, 160, 3)
    for other in frames[1:]:
        assert (other - frames[0]).abs().max().item() <= 1


def test_cuda_fp32_matches_cpu_fp64():
    config = WanVAEConfig(base_dim=32, decoder_base_dim=32)
    state = {
        k: v
        for k, v in random_vae_state_dict(config, seed=5, encoder=False).items()
        if k.startswith(("decoder.", "post_quant_conv."))
    }
    z = torch.randn(1, 48, 5, 4, 6, dtype=torch.float64)
    reference = _decoder(state, torch.float64, "cpu", config).decode(z)
    torch.backends.cudnn.allow_tf32 = False
    try:
        got = _decoder(state, torch.float32, "cuda", config).decode(z.cuda()).cpu().double()
    finally:
        torch.backends.cudnn.allow_tf32 = True
    assert (got - reference).abs().max().item() < 1e-3
