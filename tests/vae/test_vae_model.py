"""The reference decoder against diffusers' AutoencoderKLWan (the oracle) and the spec's closed forms."""

from __future__ import annotations

import pytest
import torch

from pan2cli.vae.config import WanVAEConfig
from pan2cli.vae.model import WanDupUp3D, WanRMSNorm, WanVAEDecoder, chunk_bounds, unpatchify

diffusers = pytest.importorskip("diffusers")

SMALL = WanVAEConfig(base_dim=16, decoder_base_dim=16)


@pytest.fixture(scope="module")
def models():
    """diffusers' VAE with random weights (γ and biases perturbed) and our decoder holding the same tensors, float64."""
    torch.manual_seed(0)
    config = {k: v for k, v in SMALL.to_diffusers_config().items() if not k.startswith("_")}
    oracle = diffusers.AutoencoderKLWan(**config).double().eval()
    with torch.no_grad():
        for name, tensor in oracle.state_dict().items():
            if name.endswith("gamma"):
                tensor.copy_(1 + 0.3 * torch.randn_like(tensor))
            elif name.endswith("bias"):
                tensor.copy_(0.1 * torch.randn_like(tensor))
    ours = WanVAEDecoder(SMALL).double()
    decoder_state = {
        k: v for k, v in oracle.state_dict().items() if k.startswith(("decoder.", "post_quant_conv."))
    }
    ours.load_state_dict(decoder_state, strict=True)
    return oracle, ours


@pytest.mark.parametrize("shape", [(1, 48, 1, 3, 5), (1, 48, 2, 5, 3), (2, 48, 5, 3, 5)])
def test_matches_diffusers_float64(models, shape):
    oracle, ours = models
    z = torch.randn(shape, dtype=torch.float64)
    with torch.no_grad():
        expected = oracle.decode(z).sample
    got = ours.decode(z)
    assert got.shape == (shape[0], 3, 1 + 4 * (shape[2] - 1), 16 * shape[3], 16 * shape[4])
    assert got.shape == expected.shape
    # Random weights must not saturate the clamp, or the comparison would prove little.
    assert (got.abs() < 1).float().mean() > 0.5
    assert (got - expected).abs().max().item() <= 1e-10


def test_chunk_size_does_not_change_the_output(models):
    _, ours = models
    z = torch.randn(1, 48, 6, 3, 4, dtype=torch.float64)
    outputs = [ours.decode(z, chunk_latent_frames=n) for n in (1, 2, 4, 30)]
    for out in outputs[1:]:
        assert (out - outputs[0]).abs().max().item() <= 1e-12


def test_decode_chunks_yield_one_frame_then_four_per_latent_frame(models):
    _, ours = models
    z = torch.randn(1, 48, 6, 2, 3, dtype=torch.float64)
    frames = [chunk.shape[2] for chunk in ours.decode_chunks(z, chunk_latent_frames=2)]
    assert frames == [1, 8, 8, 4]


def test_decoding_is_causal(models):
    """Changing latent frames ≥ 3 first changes output frame 9 = 1 + 4·2 (wan22_vae.md §4)."""
    _, ours = models
    z = torch.randn(1, 48, 5, 2, 3, dtype=torch.float64)
    z2 = z.clone()
    z2[:, :, 3:] += torch.randn_like(z2[:, :, 3:])
    a, b = ours.decode(z), ours.decode(z2)
    assert torch.equal(a[:, :, :9], b[:, :, :9])
    assert not torch.equal(a[:, :, 9:], b[:, :, 9:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_runs_and_stays_close(models, dtype):
    _, ours = models
    z = torch.randn(1, 48, 2, 3, 4, dtype=torch.float64)
    reference = ours.decode(z)
    low = WanVAEDecoder(SMALL).to(dtype)
    low.load_state_dict(ours.state_dict())
    got = low.decode(z)
    assert got.dtype == dtype
    tolerance = 1e-4 if dtype == torch.float32 else 0.1
    assert (got.double() - reference).abs().max().item() < tolerance


def test_chunk_bounds_first_chunk_is_one_frame():
    assert chunk_bounds(1, 4) == [(0, 1)]
    assert chunk_bounds(31, 4)[:3] == [(0, 1), (1, 5), (5, 9)]
    assert chunk_bounds(31, 4)[-1] == (29, 31)
    assert chunk_bounds(6, 30) == [(0, 1), (1, 6)]


def test_rms_norm_formula():
    norm = WanRMSNorm(8, images=False).double()
    with torch.no_grad():
        norm.gamma.copy_(torch.randn(8, 1, 1, 1))
    x = torch.randn(2, 8, 3, 4, 5, dtype=torch.float64)
    expected = x / x.pow(2).mean(dim=1, keepdim=True).sqrt() * norm.gamma
    assert torch.allclose(norm(x), expected, atol=1e-12)


def test_dupup3d_closed_forms():
    x = torch.randn(1, 8, 3, 2, 5)
    # Plain 2x2x2 duplication: out[c, 2t+a, 2h+i, 2w+j] = in[c, t, h, w]
    dup = WanDupUp3D(8, 8, factor_t=2, factor_s=2)(x, first_chunk=False)
    assert torch.equal(dup, x.repeat_interleave(2, 2).repeat_interleave(2, 3).repeat_interleave(2, 4))
    # First chunk keeps the last of the two duplicated frames.
    assert torch.equal(WanDupUp3D(8, 8, 2, 2)(x, first_chunk=True), dup[:, :, 1:])
    # Channel-to-row (up_blocks.2): out[c, t, 2h+i, 2w+j] = in[2c+i, t, h, w]
    rows = WanDupUp3D(8, 4, factor_t=1, factor_s=2)(x, first_chunk=False)
    for c in range(4):
        for i in range(2):
            assert torch.equal(rows[0, c, :, i::2, 0::2], x[0, 2 * c + i])
            assert torch.equal(rows[0, c, :, i::2, 1::2], x[0, 2 * c + i])


def test_unpatchify_channel_order():
    x = torch.randn(1, 12, 2, 3, 4)
    out = unpatchify(x, 2)
    assert out.shape == (1, 3, 2, 6, 8)
    for c in range(3):
        for q in range(2):  # row offset
            for r in range(2):  # column offset
                assert torch.equal(out[0, c, :, q::2, r::2], x[0, c * 4 + r * 2 + q])


def test_full_size_parameter_count():
    with torch.device("meta"):
        model = WanVAEDecoder(WanVAEConfig())
    assert sum(p.numel() for p in model.parameters()) == 555_051_580
    assert len(model.state_dict()) == 110
