"""pan2's Qwen3.5 text model (pan2cli/text/qwen3_5.py) against transformers' class and the token-by-token rule."""

from __future__ import annotations

import json

import pytest
import torch

from pan2cli.errors import CheckpointError
from pan2cli.text.gated_delta_rule import gated_delta_rule
from pan2cli.text.qwen3_5 import Qwen35TextConfig, Qwen35TextModel

# Full-attention layers early (PAN 2 runs all but the last two layers), grouped queries and grouped values.
SMALL = {
    "vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 5, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention", "linear_attention"],
}  # fmt: skip


def recurrent_rule(q, k, v, g, beta):
    """The gated delta rule token by token (gated_delta_rule's docstring), the reference."""
    batch, heads, length, d_k = k.shape
    state = torch.zeros(batch, heads, d_k, v.shape[-1], dtype=v.dtype)
    out = torch.empty_like(v)
    for t in range(length):
        state = state * g[:, :, t, None, None].exp()
        predicted = torch.einsum("bhkv,bhk->bhv", state, k[:, :, t])
        state = state + beta[:, :, t, None, None] * torch.einsum(
            "bhk,bhv->bhkv", k[:, :, t], v[:, :, t] - predicted
        )
        out[:, :, t] = torch.einsum("bhkv,bhk->bhv", state, q[:, :, t])
    return out


@pytest.mark.parametrize("length", [1, 7, 64, 65, 150])
@pytest.mark.parametrize("chunk", [16, 64])
def test_chunked_rule_equals_the_recurrence_in_float64(length, chunk):
    gen = torch.Generator().manual_seed(length)
    shape = (2, 3, length)
    q, k = (
        torch.nn.functional.normalize(torch.randn(*shape, 8, generator=gen, dtype=torch.float64), dim=-1)
        for _ in range(2)
    )
    v = torch.randn(*shape, 5, generator=gen, dtype=torch.float64)
    g = -torch.rand(shape, generator=gen, dtype=torch.float64) * 2  # decays in (e^-2, 1]
    beta = torch.rand(shape, generator=gen, dtype=torch.float64)
    expected = recurrent_rule(q, k, v, g, beta)
    got = gated_delta_rule(q, k, v, g, beta, chunk=chunk)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-11, atol=1e-11)
    # The state carries across chunks: a later chunk sees the first one's tokens.
    if length > chunk:
        cut = gated_delta_rule(
            q[:, :, chunk:], k[:, :, chunk:], v[:, :, chunk:], g[:, :, chunk:], beta[:, :, chunk:], chunk
        )
        assert not torch.allclose(cut, expected[:, :, chunk:])


def _transformers_model(overrides: dict, dtype: torch.dtype, seed: int = 0):
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    torch.manual_seed(seed)
    model = Qwen3_5TextModel(Qwen3_5TextConfig(**overrides))
    with torch.no_grad():
        for param in model.parameters():  # norms off their init, A_log / dt_bias moved: every path matters
            param.add_(0.1 * torch.randn_like(param))
    return model.to(dtype).eval()


def _ours_from(reference, dtype: torch.dtype, layers: int | None = None) -> Qwen35TextModel:
    config = Qwen35TextConfig.from_dict(json.loads(reference.config.to_json_string()), "test")
    model = Qwen35TextModel(config, layers).to(dtype)
    state = reference.state_dict()
    model.load_state_dict({key: state[key] for key in model.state_dict()}, strict=True)
    return model.eval()


@pytest.mark.parametrize(
    "overrides",
    [SMALL, {}],  # {}: transformers' defaults, the Qwen3.5-9B shape, on the meta device
    ids=["small", "qwen3.5-9b"],
)
def test_names_and_shapes_are_transformers(overrides):
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    with torch.device("meta"):
        reference = Qwen3_5TextModel(Qwen3_5TextConfig(**overrides))
        ours = Qwen35TextModel(
            Qwen35TextConfig.from_dict(json.loads(reference.config.to_json_string()), "test")
        )
    theirs = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in ours.state_dict().items()} == theirs
    if not overrides:
        assert len(theirs) > 400 and ours.config.layer_types.count("full_attention") == 8


@pytest.mark.parametrize("length", [1, 70, 131])
def test_every_hidden_state_matches_transformers(length):
    """In float64 ours runs everything in float64, transformers' class drops to float32 in its norms, RoPE
    table and delta rule: agreement to float32's precision, for every hidden state it returns."""
    reference = _transformers_model(SMALL, torch.float64)
    ids = torch.randint(0, SMALL["vocab_size"], (1, length), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        hidden = reference(input_ids=ids, output_hidden_states=True).hidden_states
        assert len(hidden) == SMALL["num_hidden_layers"] + 1
        for layers in range(SMALL["num_hidden_layers"] + 1):
            got = _ours_from(reference, torch.float64, layers)(ids)
            torch.testing.assert_close(got, hidden[layers], rtol=2e-5, atol=2e-5)


def test_bf16_is_as_close_to_float64_as_transformers_bf16():
    """Ours in bf16 rounds where transformers rounds: its error against float64 is of the same size."""
    reference = _transformers_model(SMALL, torch.float64)
    ids = torch.randint(0, SMALL["vocab_size"], (1, 90), generator=torch.Generator().manual_seed(1))
    layers = SMALL["num_hidden_layers"] - 2
    with torch.no_grad():
        exact = _ours_from(reference, torch.float64, layers)(ids)
        ours = _ours_from(reference, torch.bfloat16, layers)(ids).double()
        theirs = (
            reference.to(torch.bfloat16)(input_ids=ids, output_hidden_states=True)
            .hidden_states[layers]
            .double()
        )

    def rel(x):
        return ((x - exact).norm() / exact.norm()).item()

    # Random weights: bf16's own error is a few per cent here; the two bf16 models sit closer to each other
    # than either to float64 (0.2-0.35 of it over seeds 0-2), which different roundings would not.
    assert 0 < rel(ours) < 0.1 and 0 < rel(theirs) < 0.1
    assert rel(ours) < 1.25 * rel(theirs)
    assert ((ours - theirs).norm() / exact.norm()).item() < 0.5 * rel(theirs)


def test_partial_model_has_no_final_norm_and_checks_its_layer_count():
    config = Qwen35TextConfig.from_dict(SMALL, "test")
    assert Qwen35TextModel(config).norm is not None
    part = Qwen35TextModel(config, 3)
    assert part.norm is None and len(part.layers) == 3
    assert not any(k.startswith(("norm.", "layers.3.", "layers.4.")) for k in part.state_dict())
    with pytest.raises(ValueError, match="layers"):
        Qwen35TextModel(config, 6)


def test_config_from_a_transformers_config_json():
    from transformers import Qwen3_5TextConfig

    saved = json.loads(Qwen3_5TextConfig(**{**SMALL, "layer_types": None}).to_json_string())
    config = Qwen35TextConfig.from_dict(saved, "test")
    assert config.layer_types == ("linear_attention",) * 3 + ("full_attention", "linear_attention")
    assert (config.rope_theta, config.partial_rotary_factor, config.rotary_dim) == (10000.0, 0.25, 4)
    assert config.num_key_value_heads == 2 and isinstance(config.rms_norm_eps, float)
    # Older config files: rope_theta / partial_rotary_factor at the top level, and the interval rule.
    old = {
        **SMALL,
        "layer_types": None,
        "full_attention_interval": 2,
        "rope_theta": 1e7,
        "partial_rotary_factor": 0.5,
    }
    config = Qwen35TextConfig.from_dict(old, "test")
    assert config.layer_types[:2] == ("linear_attention", "full_attention") and config.rope_theta == 1e7
    assert config.rotary_dim == 8


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0}}, "RoPE type 'yarn'"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"hidden_size": "4096"}, "hidden_size = '4096' is not a int"),
        ({"num_hidden_layers": 4.5}, "num_hidden_layers = 4.5"),
        ({"attention_bias": 1}, "attention_bias = 1 is not a bool"),
        ({"layer_types": ["linear_attention"] * 4}, "layer_types must list 5"),
        ({"linear_num_value_heads": 3}, "multiple of the key heads"),
    ],
)
def test_config_errors_name_the_field(change, message):
    with pytest.raises(CheckpointError, match=message.replace("(", r"\(")):
        Qwen35TextConfig.from_dict({**SMALL, **change}, "config.json")
