"""The PAN 2 MMDiT: config checks, patchify, per-frame timesteps, fused = unfused on a tiny model."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernel modules are imported (lazily)

from pan2cli.dit import PAN2Transformer3DModel, PAN2TransformerConfig, set_fused_kernels  # noqa: E402
from pan2cli.dit.rope import apply_rope, rope_table  # noqa: E402
from pan2cli.errors import CheckpointError, InputError  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = PAN2TransformerConfig(
    hidden_size=64, num_attention_heads=2, num_layers=2, text_dim=24, freq_dim=32, rope_axes_dim=(12, 10, 10)
)


def tiny_model(config: PAN2TransformerConfig = TINY, seed: int = 0) -> PAN2Transformer3DModel:
    """Random weights with norm weights and biases perturbed away from ones and zeros."""
    torch.manual_seed(seed)
    model = PAN2Transformer3DModel(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm_q.weight", "norm_k.weight", "norm_added_q.weight", "norm_added_k.weight")):
                p.copy_(1 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
    return model.eval().requires_grad_(False).to(DEVICE)


def inputs(batch=1, frames=3, height=4, width=6, text=5, seed=1):
    gen = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, 48, frames, height, width, generator=gen)
    text_states = torch.randn(batch, text, TINY.text_dim, generator=gen)
    return latents.to(DEVICE), text_states.to(DEVICE)


def test_config_round_trip_and_checks():
    assert PAN2TransformerConfig.from_config_dict(TINY.to_config_dict()) == TINY
    assert PAN2TransformerConfig().head_dim == 128 and PAN2TransformerConfig().ffn_dim == 20480
    with pytest.raises(CheckpointError, match="sums to 30"):
        TINY.replace(rope_axes_dim=(10, 10, 10))
    with pytest.raises(CheckpointError, match="not a multiple"):
        TINY.replace(num_attention_heads=3)
    with pytest.raises(CheckpointError, match="unknown keys: depth"):
        PAN2TransformerConfig.from_config_dict({**TINY.to_config_dict(), "depth": 3})
    with pytest.raises(CheckpointError, match="WanTransformer3DModel"):
        PAN2TransformerConfig.from_config_dict({"_class_name": "WanTransformer3DModel"})


def test_rope_table_layout():
    """Angles: t channels from the frame index, then h, then w; rotation by halves."""
    cos, sin = rope_table((2, 3, 4), (4, 2, 2), theta=100.0)
    assert cos.shape == (24, 4) and cos.dtype == torch.float32
    token = 1 * 12 + 2 * 4 + 3  # (t, h, w) = (1, 2, 3)
    expected = torch.tensor([1.0, 1.0 / 10.0, 2.0, 3.0], dtype=torch.float64)
    assert torch.allclose(cos[token].double(), expected.cos(), atol=1e-7)
    assert torch.allclose(sin[token].double(), expected.sin(), atol=1e-7)
    x = torch.randn(1, 24, 2, 8)
    rotated = apply_rope(x, cos, sin)
    assert torch.allclose(rotated.norm(dim=-1), x.norm(dim=-1), atol=1e-5)  # a rotation
    assert torch.equal(apply_rope(x, cos, sin)[:, 0], x[:, 0])  # position (0, 0, 0): identity


def test_patch_embedding_is_the_conv():
    model = tiny_model()
    latents, _ = inputs()
    tokens = model.patch_embedding(latents).flatten(2).transpose(1, 2)
    w = model.patch_embedding.weight
    patches = latents.unfold(3, 2, 2).unfold(4, 2, 2)  # [B, C, T, H/2, W/2, 2, 2]
    patches = patches.permute(0, 2, 3, 4, 1, 5, 6).reshape(1, -1, 48 * 4)
    assert torch.allclose(tokens, F.linear(patches, w.flatten(1), model.patch_embedding.bias), atol=1e-5)


def test_forward_shapes_and_timestep_forms():
    model = tiny_model()
    set_fused_kernels(model, False)
    latents, text = inputs(batch=2)
    t = torch.tensor([700.0, 300.0], device=DEVICE)
    out = model(latents, t, text)
    assert out.shape == latents.shape and out.isfinite().all()
    # per-frame timesteps that are all equal = per-sample timesteps
    per_frame = model(latents, t[:, None].expand(2, 3), text)
    assert torch.allclose(per_frame, out, atol=1e-5)
    # ... and so are per-token timesteps
    per_token = model(latents, t[:, None].expand(2, 3 * 2 * 3), text)
    assert torch.allclose(per_token, out, atol=1e-5)
    # image-to-video: a clean start frame changes the prediction
    i2v = model(latents, torch.tensor([[0.0, 700.0, 700.0], [0.0, 300.0, 300.0]], device=DEVICE), text)
    assert not torch.allclose(i2v, out, atol=1e-3)
    with pytest.raises(InputError, match="timestep has shape"):
        model(latents, torch.zeros(2, 4, device=DEVICE), text)
    with pytest.raises(InputError, match="multiples of the patch size"):
        model(latents[..., :5], t, text)
    with pytest.raises(InputError, match="encoder_hidden_states"):
        model(latents, t, text[..., :7])


def test_fused_model_equals_unfused():
    """The whole tiny model with the Triton kernels (interpreter on CPU) equals the reference path, fp32."""
    pytest.importorskip("triton")
    model = tiny_model()
    latents, text = inputs(frames=3, height=4, width=6, text=7)
    t = torch.tensor([[0.0, 600.0, 600.0]], device=DEVICE)  # image-to-video: per-frame modulation
    assert set_fused_kernels(model, False) == 3  # two blocks + the final AdaLN
    reference = model(latents, t, text)
    set_fused_kernels(model, True)
    fused = model(latents, t, text)
    assert ((fused - reference).norm() / reference.norm()).item() <= 1e-5


def test_default_fused_setting_follows_the_device():
    from pan2cli.dit.fusions import triton_available, use_fused

    model = tiny_model()
    assert all(m.fused_kernels is None for m in model.modules() if hasattr(m, "fused_kernels"))
    assert use_fused(None, torch.zeros(1)) is False
    if torch.cuda.is_available():
        assert use_fused(None, torch.zeros(1, device="cuda")) is triton_available()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_block_compiles_as_one_graph(fused):
    """Dynamo traces a block through the `pan2_fusions` custom ops (their fakes) without graph breaks."""
    if fused:
        pytest.importorskip("triton")
    from pan2cli.dit.model import PAN2TransformerBlock

    torch.manual_seed(0)
    block = PAN2TransformerBlock(TINY).eval().requires_grad_(False).to(DEVICE)
    set_fused_kernels(block, fused)
    args = (
        torch.randn(1, 24, 64, device=DEVICE),
        torch.randn(1, 5, 64, device=DEVICE),
        torch.randn(1, 3, 6 * 64, device=DEVICE),  # per-frame modulation: 3 frames of 8 tokens
        torch.randn(1, 1, 6 * 64, device=DEVICE),
        *rope_table((3, 2, 4), TINY.rope_axes_dim, device=DEVICE),
    )
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(*args), block(*args)):
        assert torch.equal(got, want)
