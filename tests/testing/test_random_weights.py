"""Tests for pan2cli.testing.random_weights: key layouts against diffusers, the written files, the script."""

from __future__ import annotations

import gc
import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from pan2cli.testing.random_weights import (
    decoder_key_map,
    encoder_key_map,
    encoder_key_shapes,
    original_decoder_key_shapes,
    random_vae_state_dict,
    vae_key_map,
    vae_key_shapes,
    write_test_checkpoints,
)
from pan2cli.vae.checkpoint import load_vae_decoder, original_to_diffusers_key, resolve_vae_checkpoint
from pan2cli.vae.config import WanVAEConfig
from pan2cli.vae.model import WanVAEDecoder
from tests.subprocess_env import python_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "make_test_checkpoint.py"
SMALL = WanVAEConfig(base_dim=16, decoder_base_dim=16)
FULL = WanVAEConfig()

# docs/wan22_vae.md §3: whole VAE and its parts, TI2V-5B.
FULL_PARAMS, FULL_TENSORS = 704_688_668, 196
FULL_ENCODER_PARAMS, FULL_QUANT_CONV_PARAMS = 149_627_776, 9_312
FULL_DECODER_SIDE_PARAMS, FULL_DECODER_SIDE_TENSORS = 555_051_580, 110


def _numel(shapes) -> int:
    return sum(math.prod(s) for s in shapes.values())


@pytest.fixture(scope="module")
def autoencoder_cls():
    """diffusers' AutoencoderKLWan, the oracle (skip where diffusers is not installed)."""
    return pytest.importorskip("diffusers").AutoencoderKLWan


def _diffusers_vae(autoencoder_cls, config: WanVAEConfig):
    kwargs = config.to_diffusers_config()
    kwargs.pop("_class_name")
    return autoencoder_cls(**kwargs)


def _shapes(state) -> dict[str, tuple[int, ...]]:
    return {k: tuple(v.shape) for k, v in state.items()}


def _assert_same_tensors(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


# ---------------------------------------------------------------- key layouts vs diffusers


def test_reduced_layout_equals_diffusers(autoencoder_cls) -> None:
    expected = _shapes(_diffusers_vae(autoencoder_cls, SMALL).state_dict())
    expected_encoder = {k: s for k, s in expected.items() if k.startswith(("encoder.", "quant_conv."))}
    assert encoder_key_shapes(SMALL) == expected_encoder
    assert vae_key_shapes(SMALL) == expected


def test_full_layout_equals_diffusers_on_meta(autoencoder_cls) -> None:
    with torch.device("meta"):
        expected = _shapes(_diffusers_vae(autoencoder_cls, FULL).state_dict())
    shapes = vae_key_shapes(FULL)
    assert shapes == expected
    assert (len(shapes), _numel(shapes)) == (FULL_TENSORS, FULL_PARAMS)
    encoder = encoder_key_shapes(FULL)
    assert _numel({k: s for k, s in encoder.items() if k.startswith("encoder.")}) == FULL_ENCODER_PARAMS
    assert _numel({k: s for k, s in encoder.items() if k.startswith("quant_conv.")}) == FULL_QUANT_CONV_PARAMS
    decoder_side = vae_key_shapes(FULL, encoder=False)
    assert (len(decoder_side), _numel(decoder_side)) == (FULL_DECODER_SIDE_TENSORS, FULL_DECODER_SIDE_PARAMS)


# ---------------------------------------------------------------- original names


@pytest.mark.parametrize("config", [SMALL, FULL], ids=["reduced", "full"])
def test_decoder_original_names_map_one_to_one_onto_the_decoder(config: WanVAEConfig) -> None:
    originals = original_decoder_key_shapes(config)
    mapped = {original_to_diffusers_key(k, config.num_res_blocks): s for k, s in originals.items()}
    assert len(mapped) == len(originals)  # one-to-one
    with torch.device("meta"):
        expected = _shapes(WanVAEDecoder(config).state_dict())
    assert mapped == expected
    assert decoder_key_map(config) == {
        original_to_diffusers_key(k, config.num_res_blocks): k for k in originals
    }


def _convert_vae_22_key(key: str) -> str:
    """diffusers `scripts/convert_wan_to_diffusers.py::convert_vae_22`, paraphrased, for encoder and quant keys.

    Applied to our original names, it must give our diffusers names: an independent check of the
    hand-written encoder layout against the rules used to make the published diffusers weights.
    """
    whole = {
        "conv1.": "quant_conv.",
        "conv2.": "post_quant_conv.",
        "encoder.conv1.": "encoder.conv_in.",
        "encoder.head.0.": "encoder.norm_out.",
        "encoder.head.2.": "encoder.conv_out.",
        "encoder.middle.0.": "encoder.mid_block.resnets.0.",
        "encoder.middle.1.": "encoder.mid_block.attentions.0.",
        "encoder.middle.2.": "encoder.mid_block.resnets.1.",
    }
    for old, new in whole.items():
        if key.startswith(old):
            key = new + key[len(old) :]
            break
    if key.startswith("encoder.downsamples."):
        key = "encoder.down_blocks." + key[len("encoder.downsamples.") :]
        if "residual" in key or "shortcut" in key:
            key = key.replace(".downsamples.", ".resnets.")
        elif "resample" in key or "time_conv" in key:
            parts = key.split(".")  # encoder.down_blocks.i.downsamples.j.rest -> ...i.downsampler.rest
            key = ".".join([*parts[:3], "downsampler", *parts[5:]])
    for old, new in ((".residual.0.", ".norm1."), (".residual.2.", ".conv1."), (".residual.3.", ".norm2."),
                     (".residual.6.", ".conv2."), (".shortcut.", ".conv_shortcut.")):  # fmt: skip
        key = key.replace(old, new)
    return key


@pytest.mark.parametrize("config", [SMALL, FULL], ids=["reduced", "full"])
def test_encoder_original_names_follow_the_conversion_rules(config: WanVAEConfig) -> None:
    mapping = encoder_key_map(config)
    assert len(set(mapping.values())) == len(mapping)  # one-to-one
    assert {d: _convert_vae_22_key(o) for d, o in mapping.items()} == {d: d for d in mapping}
    originals = set(mapping.values())
    # Literal names of the original layout (vae2_2.py: Down_ResidualBlock.downsamples = [ResBlock × 2, Resample]).
    for name in (
        "conv1.weight",
        "encoder.conv1.weight",
        "encoder.downsamples.0.downsamples.0.residual.0.gamma",
        "encoder.downsamples.1.downsamples.0.shortcut.weight",
        "encoder.downsamples.0.downsamples.2.resample.1.weight",
        "encoder.downsamples.1.downsamples.2.time_conv.weight",
        "encoder.downsamples.3.downsamples.1.residual.6.bias",
        "encoder.middle.1.to_qkv.weight",
        "encoder.head.0.gamma",
        "encoder.head.2.weight",
    ):
        assert name in originals, name
    # Block 0 keeps the width (dim_mult[0] = 1): no shortcut conv. It downsamples only in space
    # (temperal_downsample[0] is False); the last block does not downsample at all.
    assert "encoder.downsamples.0.downsamples.0.shortcut.weight" not in originals
    assert "encoder.downsamples.0.downsamples.2.time_conv.weight" not in originals
    assert not any(o.startswith("encoder.downsamples.3.downsamples.2.") for o in originals)


def test_original_names_carry_comfyui_markers() -> None:
    # ComfyUI recognises the original layout by these keys (docs/wan22_vae.md §7.1).
    originals = set(vae_key_map(SMALL).values())
    assert {
        "decoder.middle.0.residual.0.gamma",
        "decoder.upsamples.0.upsamples.0.residual.2.weight",
    } <= originals


# ---------------------------------------------------------------- random values


def test_values_are_deterministic_and_independent_of_naming() -> None:
    state = random_vae_state_dict(SMALL, seed=0)
    _assert_same_tensors(state, random_vae_state_dict(SMALL, seed=0))
    other = random_vae_state_dict(SMALL, seed=1)
    assert all(not torch.equal(state[k], other[k]) for k in state)
    original = random_vae_state_dict(SMALL, seed=0, key_names="original")
    _assert_same_tensors(original, {o: state[d] for d, o in vae_key_map(SMALL).items()})
    # Per-tensor seeds: the decoder's values do not depend on whether the encoder is drawn too.
    no_encoder = random_vae_state_dict(SMALL, seed=0, encoder=False)
    _assert_same_tensors(no_encoder, {k: state[k] for k in decoder_key_map(SMALL)})
    bf16 = random_vae_state_dict(SMALL, seed=0, dtype=torch.bfloat16, encoder=False)
    _assert_same_tensors(bf16, {k: v.to(torch.bfloat16) for k, v in no_encoder.items()})


def test_value_statistics() -> None:
    state = random_vae_state_dict(SMALL, seed=0)
    weight = state["decoder.mid_block.resnets.0.conv1.weight"]  # [64, 64, 3, 3, 3]: fan_in 1728
    assert weight.std().item() == pytest.approx(1 / math.sqrt(64 * 27), rel=0.03)
    biases = torch.cat([v for k, v in state.items() if k.endswith(".bias")])
    assert biases.std().item() == pytest.approx(0.02, rel=0.05)
    gammas = torch.cat([v.flatten() for k, v in state.items() if k.endswith(".gamma")])
    assert gammas.mean().item() == pytest.approx(1.0, abs=0.01)
    assert gammas.std().item() == pytest.approx(0.1, rel=0.05)
    assert all(v.is_contiguous() and v.device.type == "cpu" for v in state.values())


def test_bad_arguments() -> None:
    with pytest.raises(ValueError, match="key_names"):
        random_vae_state_dict(SMALL, key_names="comfy")
    with pytest.raises(ValueError, match="unknown checkpoint format"):
        write_test_checkpoints(Path("unused"), SMALL, formats=("pth", "gguf"))


# ---------------------------------------------------------------- written files


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return write_test_checkpoints(tmp_path_factory.mktemp("ckpt"), SMALL, seed=1)


def test_files_hold_the_generated_tensors(written: dict[str, Path]) -> None:
    root = written["pth"].parent
    assert written == {
        "pth": root / "Wan2.2_VAE.pth",
        "safetensors": root / "wan2.2_vae.safetensors",
        "diffusers": root / "diffusers" / "vae",
    }
    original = random_vae_state_dict(SMALL, seed=1, key_names="original")
    pth = torch.load(written["pth"], map_location="cpu", weights_only=True)
    assert list(pth) == list(original)  # file order kept
    _assert_same_tensors(dict(pth), original)
    _assert_same_tensors(load_file(written["safetensors"]), original)
    diffusers_weights = load_file(written["diffusers"] / "diffusion_pytorch_model.safetensors")
    _assert_same_tensors(diffusers_weights, random_vae_state_dict(SMALL, seed=1))
    config = json.loads((written["diffusers"] / "config.json").read_text())
    assert config["_class_name"] == "AutoencoderKLWan"
    assert WanVAEConfig.from_diffusers_config(config) == SMALL
    assert not list(root.rglob(".*.tmp"))  # temporary names renamed away


def test_diffusers_reads_the_diffusers_folder(autoencoder_cls, written: dict[str, Path]) -> None:
    vae = autoencoder_cls.from_pretrained(written["diffusers"])
    _assert_same_tensors(vae.state_dict(), random_vae_state_dict(SMALL, seed=1))


def test_every_format_decodes_like_diffusers(autoencoder_cls, written: dict[str, Path]) -> None:
    for fmt in ("pth", "safetensors"):
        assert resolve_vae_checkpoint(written[fmt]).layout == "single file"
    paths = {
        "pth": written["pth"],
        "safetensors": written["safetensors"],
        "diffusers vae/": written["diffusers"],
        "diffusers root": written["diffusers"].parent,
    }
    # Single files carry no config: the loader reads their (reduced) widths from the tensors.
    decoders = {name: load_vae_decoder(path, dtype=torch.float64) for name, path in paths.items()}
    assert all(d.config.decoder_dims == (64, 64, 64, 32, 16) for d in decoders.values())
    z = torch.randn(1, 48, 2, 3, 4, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    outputs = {name: decoder.decode(z) for name, decoder in decoders.items()}
    reference = outputs["pth"]
    assert reference.shape == (1, 3, 5, 48, 64)
    for name, out in outputs.items():
        assert (out - reference).abs().max().item() == 0.0, name
    # The random weights give a non-trivial picture: varied, mostly inside the clamp range.
    assert reference.std().item() > 0.05
    assert (reference.abs() == 1).double().mean().item() < 0.5

    vae = _diffusers_vae(autoencoder_cls, SMALL)
    vae.load_state_dict(random_vae_state_dict(SMALL, seed=1), strict=True)
    vae = vae.to(torch.float64).eval()
    with torch.no_grad():
        expected = vae.decode(z).sample
    assert (reference - expected).abs().max().item() <= 1e-10


# ---------------------------------------------------------------- the script


def test_script_writes_loadable_files(tmp_path: Path) -> None:
    env = python_env(PYTHONDONTWRITEBYTECODE="1")
    out = tmp_path / "out"
    args = [sys.executable, str(SCRIPT), str(out), "--decoder-base-dim", "16", "--base-dim", "16", "--seed", "5",
            "--dtype", "bf16", "--formats", "pth,diffusers", "--no-encoder"]  # fmt: skip
    result = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [str(out / "Wan2.2_VAE.pth"), str(out / "diffusers" / "vae")]
    expected = random_vae_state_dict(SMALL, seed=5, dtype=torch.bfloat16, key_names="original", encoder=False)
    _assert_same_tensors(dict(torch.load(out / "Wan2.2_VAE.pth", weights_only=True)), expected)
    assert load_vae_decoder(out / "Wan2.2_VAE.pth").dtype == torch.float32
    assert load_vae_decoder(out / "diffusers").config.decoder_base_dim == 16


def _script_command():
    spec = importlib.util.spec_from_file_location("make_test_checkpoint", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def test_script_defaults_and_usage_errors(tmp_path: Path) -> None:
    main = _script_command()
    result = CliRunner().invoke(main, [str(tmp_path), "--decoder-base-dim", "16", "--base-dim", "16"])
    assert result.exit_code == 0, result.output
    paths = [Path(p) for p in result.stdout.splitlines()]
    assert paths == [
        tmp_path / "Wan2.2_VAE.pth",
        tmp_path / "wan2.2_vae.safetensors",
        tmp_path / "diffusers" / "vae",
    ]
    _assert_same_tensors(load_file(paths[1]), random_vae_state_dict(SMALL, key_names="original"))
    for bad in (
        ["--formats", "pth,gguf"],
        ["--formats", ","],
        ["--dtype", "fp16"],
        ["--decoder-base-dim", "0"],
    ):
        result = CliRunner().invoke(main, [str(tmp_path / "bad"), *bad])
        assert result.exit_code == 2, bad
        assert not (tmp_path / "bad").exists()


# ---------------------------------------------------------------- full size (kept out of CI)


@pytest.mark.slow
def test_full_size_checkpoints_decode_identically(tmp_path: Path) -> None:
    written = write_test_checkpoints(tmp_path, FULL, seed=0)
    gc.collect()
    # safetensors: 8-byte length + JSON header + 704,688,668 fp32 values.
    assert 4 * FULL_PARAMS < written["safetensors"].stat().st_size < 4 * FULL_PARAMS + 100_000
    z = torch.randn(1, 48, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    outputs = {}
    for fmt, path in written.items():
        decoder = load_vae_decoder(path)  # single files: the loader's TI2V-5B config
        assert decoder.config.decoder_dims == (1024, 1024, 1024, 512, 256)
        outputs[fmt] = decoder.decode(z)
        del decoder
        gc.collect()
    reference = outputs["pth"]
    assert reference.shape == (1, 3, 5, 64, 64)
    assert reference.std().item() > 0.05
    for fmt, out in outputs.items():
        assert (out - reference).abs().max().item() == 0.0, fmt
