"""Transformer checkpoints: round trips (single file, sharded with index, `model*` names), strict key and config checks."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from pan2cli.dit import PAN2Transformer3DModel, load_pan2_transformer, save_pan2_transformer
from pan2cli.errors import CheckpointError, InputError

TINY = dict(
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=1,
    text_embed_dim=8,
    rope_axes_dim=(4, 6, 6),
)


@pytest.fixture(scope="module")
def model() -> PAN2Transformer3DModel:
    model = PAN2Transformer3DModel(**TINY).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for (
            p
        ) in model.parameters():  # every parameter drawn again: the initialisation's randomness is not kept
            p.normal_(0, 0.2, generator=g)
    return model


def assert_same_weights(loaded, model, dtype):
    """Every tensor equal to the saved one in `dtype`; the AdaLN linears float32 unless the dtype is float64."""
    want = model.state_dict()
    got = loaded.state_dict()
    assert got.keys() == want.keys()
    for key, tensor in got.items():
        adaln = ".norm1.linear." in key or key.startswith("norm_out.linear.")
        expected_dtype = torch.float32 if adaln and dtype != torch.float64 else dtype
        assert tensor.dtype == expected_dtype, key
        assert torch.equal(tensor, want[key].to(expected_dtype)), (
            key
        )  # kept float32: never rounded through bf16


@pytest.mark.parametrize("stem", ["diffusion_pytorch_model", "model"])
@pytest.mark.parametrize("shard_bytes", [None, 40_000])
def test_round_trip(tmp_path, model, stem, shard_bytes):
    folder = save_pan2_transformer(model, tmp_path / "transformer", max_shard_bytes=shard_bytes, stem=stem)
    if shard_bytes:
        index = json.loads((folder / f"{stem}.safetensors.index.json").read_text())
        assert len(set(index["weight_map"].values())) > 2  # really sharded
    loaded = load_pan2_transformer(tmp_path, dtype=torch.float32)  # a repository root with transformer/
    assert loaded.config == model.config
    assert_same_weights(loaded, model, torch.float32)
    bf16 = load_pan2_transformer(folder)  # bf16 by default
    assert_same_weights(bf16, model, torch.bfloat16)
    assert not any(p.requires_grad for p in bf16.parameters()) and not bf16.training


def test_loaded_model_runs(tmp_path, model):
    loaded = load_pan2_transformer(save_pan2_transformer(model, tmp_path), dtype=torch.float32)
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, 97, 2, 2, 4, generator=g)
    text = torch.randn(1, 3, TINY["text_embed_dim"], generator=g)
    t = torch.tensor([500.0])
    with torch.no_grad():
        got, want = loaded(latents, t, text), model(latents, t, text)
    # The weights are equal bit for bit (test_round_trip); the outputs agree to fp32 rounding only: the
    # loaded tensors sit at other addresses (safetensors' buffers), and CPU BLAS kernels pick their
    # summation order by alignment, so bit-equality here would test the BLAS, not the loader.
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, torch.zeros_like(got))


def test_float64_takes_every_tensor(tmp_path, model):
    assert_same_weights(
        load_pan2_transformer(save_pan2_transformer(model, tmp_path), dtype=torch.float64),
        model,
        torch.float64,
    )


def test_missing_and_unexpected_keys_are_named(tmp_path, model):
    folder = save_pan2_transformer(model, tmp_path)
    weights = folder / "diffusion_pytorch_model.safetensors"
    state = load_file(weights)
    del state["transformer_blocks.1.attn.norm_added_k.weight"]
    state["transformer_blocks.1.attn.to_qkv.weight"] = torch.zeros(96, 32)
    state["proj_out.bias"] = torch.zeros(7)
    save_file(state, str(weights))
    with pytest.raises(CheckpointError) as err:
        load_pan2_transformer(folder)
    message = str(err.value)
    assert "missing keys: transformer_blocks.1.attn.norm_added_k.weight" in message
    assert "unexpected keys: transformer_blocks.1.attn.to_qkv.weight" in message
    assert "proj_out.bias [7] (expected [192])" in message


def test_broken_folders(tmp_path, model):
    with pytest.raises(InputError, match="no such folder"):
        load_pan2_transformer(tmp_path / "nowhere")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_pan2_transformer(tmp_path)
    folder = save_pan2_transformer(model, tmp_path / "sharded", max_shard_bytes=40_000)
    index_path = folder / "diffusion_pytorch_model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first_shard = sorted(set(index["weight_map"].values()))[0]
    (folder / first_shard).unlink()
    with pytest.raises(CheckpointError, match=f"lists {first_shard}"):
        load_pan2_transformer(folder)
    (folder / "config.json").write_text(json.dumps({**model.config.to_dict(), "num_layers": "deep"}))
    with pytest.raises(CheckpointError, match="num_layers must be a positive whole number"):
        load_pan2_transformer(folder)
    (folder / "config.json").write_text(json.dumps({**model.config.to_dict(), "hidden_size": 5120}))
    with pytest.raises(CheckpointError, match="not PAN2Transformer3DModel config keys: hidden_size"):
        load_pan2_transformer(folder)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(model.config.to_dict()))
    with pytest.raises(CheckpointError, match="no diffusion_pytorch_model"):
        load_pan2_transformer(empty)


def test_loaded_bytes_are_what_the_loaded_model_holds():
    """The memory the overlapped load plans with (`loaded_bytes`) equals the loaded model's own count: exactly on a
    tiny model loaded both ways, and at the release config the weights `scripts/bench_dit.py` measured on an H200
    (bf16 62.71 GiB with float32 AdaLN, fp8 40.72 GiB)."""
    from pan2cli.dit.checkpoint import expected_shapes, loaded_bytes, release_defaults
    from pan2cli.dit.quantize import quantize_transformer

    model = PAN2Transformer3DModel(**TINY).eval().requires_grad_(False)
    held = lambda m: sum(t.numel() * t.element_size() for t in [*m.parameters(), *m.buffers()])  # noqa: E731
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    bf16 = model.to(torch.bfloat16)
    for name, p in bf16.named_parameters():
        if "norm1.linear" in name or "norm_out.linear" in name:
            p.data = p.data.float()
    assert loaded_bytes(shapes, torch.bfloat16) == held(bf16)
    assert loaded_bytes(shapes, torch.bfloat16, precision="fp8") == held(quantize_transformer(bf16))
    release = expected_shapes(release_defaults())
    assert round(loaded_bytes(release) / 2**30, 2) == 62.71
    assert round(loaded_bytes(release, precision="fp8") / 2**30, 2) == 40.72
