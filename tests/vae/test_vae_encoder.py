"""The reference Wan2.2 VAE encoder: equal to diffusers' `AutoencoderKLWan.encode` (float64), original keys mapped one to one."""

from __future__ import annotations

import pytest
import torch

from pan2cli.testing.random_weights import encoder_key_map, random_vae_state_dict
from pan2cli.vae.checkpoint import load_vae_encoder, original_to_diffusers_key
from pan2cli.vae.encoder import WanVAEEncoder
from tests.conftest import SMALL_VAE


def test_original_encoder_keys_map_one_to_one():
    mapping = encoder_key_map(SMALL_VAE)
    assert {original_to_diffusers_key(o, SMALL_VAE.num_res_blocks): d for d, o in mapping.items()} == {
        d: d for d in mapping
    }


def test_encoder_equals_diffusers_in_float64():
    diffusers = pytest.importorskip("diffusers")
    state = random_vae_state_dict(SMALL_VAE, dtype=torch.float64)
    kwargs = SMALL_VAE.to_diffusers_config()
    kwargs.pop("_class_name")
    oracle = diffusers.AutoencoderKLWan(**kwargs).double().eval()
    oracle.load_state_dict(state)
    ours = WanVAEEncoder(SMALL_VAE).double()
    ours.load_state_dict(
        {k: v for k, v in state.items() if k.startswith(("encoder.", "quant_conv."))}, strict=True
    )
    video = (
        torch.rand(1, 3, 9, 64, 96, dtype=torch.float64, generator=torch.Generator().manual_seed(0)) * 2 - 1
    )
    with torch.no_grad():
        expected = oracle.encode(video).latent_dist.mean
    got = ours.encode(video)
    assert got.shape == (1, 48, 3, 4, 6)
    assert (got - expected).abs().max().item() <= 1e-10


@pytest.mark.parametrize("fmt", ["pth", "safetensors", "diffusers"])
def test_encoder_loads_from_every_layout(tiny_checkpoints, fmt):
    encoder = load_vae_encoder(tiny_checkpoints[fmt])
    reference = load_vae_encoder(tiny_checkpoints["diffusers"])
    image = torch.rand(1, 3, 1, 32, 48) * 2 - 1
    assert torch.equal(encoder.encode(image), reference.encode(image))
