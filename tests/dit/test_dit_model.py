"""The PAN 2 transformer: the release's tensors and parameter count, config checks, forward semantics, fused = unfused.

Exactness against an independent implementation of the release is tests/dit/test_dit_oracle.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pan2cli.dit import PAN2Transformer3DModel, set_fused_kernels
from pan2cli.dit.checkpoint import expected_shapes
from pan2cli.dit.config import config_arguments
from pan2cli.errors import CheckpointError, InputError

# TRITON_INTERPRET=1 without CUDA, set for each test of this module only (conftest.py).
pytestmark = pytest.mark.usefixtures("triton_interpreter_without_cuda")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TINY = dict(
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=1,
    text_embed_dim=24,
    rope_axes_dim=(4, 6, 6),
)


def tiny_model(dtype=torch.float32, seed: int = 0, **changes) -> PAN2Transformer3DModel:
    """Random weights everywhere (tables, norm weights and biases too), so every path shows in the output."""
    torch.manual_seed(seed)
    model = PAN2Transformer3DModel(**{**TINY, **changes})
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1 if name.endswith("norm.weight") or ".norm" in name else 0) + 0.2 * torch.randn_like(p))
    return model.eval().requires_grad_(False).to(DEVICE, dtype)


def inputs(batch=1, frames=3, height=4, width=6, text=5, seed=1, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, 97, frames, height, width, generator=gen, dtype=dtype)
    context = torch.randn(batch, text, TINY["text_embed_dim"], generator=gen, dtype=dtype)
    return hidden.to(DEVICE), context.to(DEVICE)


def test_release_config_has_the_released_tensors():
    """At the default config: 1,418 tensors, 29,201,996,992 parameters (vLLM-Omni's `pan2_transformer.py` defaults)."""
    shapes = expected_shapes({})
    assert len(shapes) == 1418
    assert sum(torch.Size(s).numel() for s in shapes.values()) == 29_201_996_992
    assert shapes["x_embedder.weight"] == (4096, 97, 1, 2, 2)
    assert shapes["context_embedder.0.weight"] == (4096,) and shapes["context_embedder.1.weight"] == (
        4096,
        4096,
    )
    assert shapes["context_refiner.3.ff.net.0.proj.weight"] == (32768, 4096)
    assert shapes["context_refiner.3.ff.net.2.weight"] == (4096, 16384)
    assert "context_refiner.0.attn.to_q.bias" not in shapes  # the refiner is bias-free
    assert shapes["transformer_blocks.43.norm1.linear.weight"] == (24576, 4096)
    assert shapes["transformer_blocks.43.scale_shift_table_context"] == (24576,)
    assert shapes["transformer_blocks.0.ff.net.0.proj.weight"] == (32768, 4096)
    assert shapes["transformer_blocks.0.ff_context.net.2.weight"] == (4096, 16384)
    assert shapes["transformer_blocks.0.attn.norm_added_k.weight"] == (128,)
    assert shapes["norm_out.linear.weight"] == (8192, 4096) and shapes["proj_out.weight"] == (192, 4096)
    assert "transformer_blocks.44.norm1.linear.weight" not in shapes


def test_config_keys_are_the_constructor_arguments():
    import inspect

    model = tiny_model()
    written = model.config.to_dict()
    assert written["_class_name"] == "PAN2Transformer3DModel"
    arguments = config_arguments({**written, "_diffusers_version": "0.37.0"})
    assert list(arguments) == [p for p in inspect.signature(PAN2Transformer3DModel).parameters]
    assert PAN2Transformer3DModel(**arguments).config == model.config
    with pytest.raises(CheckpointError, match="not PAN2Transformer3DModel config keys: depth, hidden_size"):
        config_arguments({**written, "depth": 3, "hidden_size": 5120})
    with pytest.raises(CheckpointError, match="WanTransformer3DModel"):
        config_arguments({"_class_name": "WanTransformer3DModel"})
    with pytest.raises(CheckpointError, match="sums to 30"):
        PAN2Transformer3DModel(**{**TINY, "rope_axes_dim": (10, 10, 10)})
    with pytest.raises(
        CheckpointError, match="in_channels must be a positive whole number.*mlp_ratio must be a positive"
    ):
        PAN2Transformer3DModel(**{**TINY, "in_channels": 0, "mlp_ratio": -1})


def test_patch_embedding_is_the_conv():
    model = tiny_model(dtype=torch.float64)  # float64: no TF32 convolution on a GPU
    hidden, _ = inputs(dtype=torch.float64)
    tokens = model.x_embedder(hidden).flatten(2).transpose(1, 2)
    w = model.x_embedder.weight
    patches = hidden.unfold(3, 2, 2).unfold(4, 2, 2)  # [B, C, T, H/2, W/2, 2, 2]
    patches = patches.permute(0, 2, 3, 4, 1, 5, 6).reshape(1, -1, 97 * 4)
    assert torch.allclose(tokens, F.linear(patches, w.flatten(1), model.x_embedder.bias), atol=1e-12)


def test_output_is_read_channel_major():
    """proj_out's 192 features of token (t, h, w) are (c, ph, pw): channel c of pixel (2h + ph, 2w + pw)."""
    model = tiny_model(dtype=torch.float64)
    hidden, context = inputs(dtype=torch.float64)
    captured = {}
    model.proj_out.register_forward_hook(lambda module, args, out: captured.setdefault("features", out))
    out = model(hidden, torch.tensor([500.0], device=DEVICE), context)
    features = captured["features"].view(1, 3, 2, 3, 48, 1, 2, 2)  # [B, t, h, w, c, pt, ph, pw]
    assert torch.equal(out[0, 5, 2, 2 * 1 + 1, 2 * 2 + 0], features[0, 2, 1, 2, 5, 0, 1, 0])


def test_forward_shapes_dtypes_and_bad_inputs():
    model = tiny_model()
    set_fused_kernels(model, False)
    hidden, context = inputs(batch=2)
    t = torch.tensor([700.0, 300.0], device=DEVICE)
    out = model(hidden, t, context)
    assert out.shape == (2, 48, 3, 4, 6) and out.isfinite().all() and out.dtype == torch.float32
    # a sample's output depends on its own timestep only
    assert torch.allclose(model(hidden[:1], t[:1], context[:1]), out[:1], atol=1e-5)
    assert not torch.allclose(model(hidden[:1], t[1:], context[:1]), out[:1], atol=1e-3)
    with pytest.raises(InputError, match=r"timestep must be \[2\]"):
        model(hidden, torch.zeros(2, 3, device=DEVICE), context)
    with pytest.raises(InputError, match="multiples of the patch size"):
        model(hidden[..., :5], t, context)
    with pytest.raises(InputError, match="encoder_hidden_states"):
        model(hidden, t, context[..., :7])
    with pytest.raises(InputError, match=r"\[B, 97, T, H, W\]"):
        model(hidden[:, :48], t, context)


def test_every_input_channel_and_the_text_matter():
    """The condition latents and the mask channel enter the model; so does every text token."""
    model = tiny_model(dtype=torch.float64)
    hidden, context = inputs(dtype=torch.float64)
    t = torch.tensor([400.0], device=DEVICE)
    base = model(hidden, t, context)
    for channel in (0, 50, 96):  # a noisy-latent channel, a condition channel, the mask
        changed = hidden.clone()
        changed[:, channel] += 1
        assert not torch.allclose(model(changed, t, context), base)
    changed = context.clone()
    changed[:, -1] += 1
    assert not torch.allclose(model(hidden, t, changed), base)


def test_adaln_linears_stay_float32_in_a_bf16_model(tmp_path):
    from pan2cli.dit.checkpoint import load_pan2_transformer, save_pan2_transformer

    folder = save_pan2_transformer(tiny_model(), tmp_path / "transformer")
    model = load_pan2_transformer(tmp_path, subfolder="transformer", dtype=torch.bfloat16)
    dtypes = {name: p.dtype for name, p in model.named_parameters()}
    assert dtypes["transformer_blocks.1.norm1.linear.weight"] == torch.float32
    assert dtypes["norm_out.linear.bias"] == torch.float32
    assert dtypes["transformer_blocks.1.attn.to_q.weight"] == torch.bfloat16
    assert dtypes["transformer_blocks.1.scale_shift_table_context"] == torch.bfloat16
    hidden, context = inputs()
    out = model.to(DEVICE)(hidden, torch.tensor([300.0], device=DEVICE), context)
    assert out.dtype == torch.bfloat16 and out.isfinite().all()
    all_bf16 = load_pan2_transformer(folder, dtype=torch.bfloat16, keep_fp32_modules=False)
    assert all(p.dtype == torch.bfloat16 for p in all_bf16.parameters())


def test_fused_model_equals_unfused():
    """The whole tiny model with the Triton kernels (interpreter on CPU) equals the reference path, fp32."""
    pytest.importorskip("triton")
    model = tiny_model()
    hidden, context = inputs(frames=3, height=4, width=6, text=7)
    t = torch.tensor([600.0], device=DEVICE)
    assert set_fused_kernels(model, False) == 4  # two blocks, one refiner attention, the final modulation
    reference = model(hidden, t, context)
    set_fused_kernels(model, True)
    fused = model(hidden, t, context)
    assert ((fused - reference).norm() / reference.norm()).item() <= 1e-5


def test_float64_never_takes_the_float32_kernels():
    from pan2cli.dit.fusions import use_fused

    assert use_fused(True, torch.zeros(1, dtype=torch.float64)) is False
    assert use_fused(None, torch.zeros(1)) is False
    if torch.cuda.is_available():
        from pan2cli.dit.fusions import triton_available

        assert use_fused(None, torch.zeros(1, device="cuda")) is triton_available()


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
def test_block_compiles_as_one_graph(fused):
    """Dynamo traces a block through the `pan2_fusions` custom ops (their fakes) without graph breaks."""
    if fused:
        pytest.importorskip("triton")
    from pan2cli.dit.model import PAN2TransformerBlock
    from pan2cli.dit.rope import rope_table

    torch.manual_seed(0)
    block = PAN2TransformerBlock(64, 2, 32, 8.0, 4.0, 1e-6).eval().requires_grad_(False).to(DEVICE)
    set_fused_kernels(block, fused)
    args = (
        torch.randn(1, 24, 64, device=DEVICE),
        torch.randn(1, 5, 64, device=DEVICE),
        torch.randn(1, 64, device=DEVICE),
        *rope_table((3, 2, 4), (8, 12, 12), 256.0, 16 / 24, device=DEVICE),
    )
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    for got, want in zip(compiled(*args), block(*args)):
        assert torch.equal(got, want)
