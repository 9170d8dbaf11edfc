"""Checkpoint loading: key mapping, strict key checks naming the keys, unreadable files, configs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from pan2cli.errors import CheckpointError, InputError
from pan2cli.vae.checkpoint import load_vae_decoder, original_to_diffusers_key, resolve_vae_checkpoint


@pytest.mark.parametrize(
    "original, diffusers_name",
    [
        ("conv2.weight", "post_quant_conv.weight"),
        ("conv1.bias", "quant_conv.bias"),
        ("decoder.conv1.weight", "decoder.conv_in.weight"),
        ("decoder.middle.0.residual.0.gamma", "decoder.mid_block.resnets.0.norm1.gamma"),
        ("decoder.middle.0.residual.6.bias", "decoder.mid_block.resnets.0.conv2.bias"),
        ("decoder.middle.1.to_qkv.weight", "decoder.mid_block.attentions.0.to_qkv.weight"),
        ("decoder.middle.2.residual.3.gamma", "decoder.mid_block.resnets.1.norm2.gamma"),
        ("decoder.upsamples.1.upsamples.2.residual.2.weight", "decoder.up_blocks.1.resnets.2.conv1.weight"),
        (
            "decoder.upsamples.2.upsamples.0.shortcut.weight",
            "decoder.up_blocks.2.resnets.0.conv_shortcut.weight",
        ),
        ("decoder.upsamples.0.upsamples.3.time_conv.bias", "decoder.up_blocks.0.upsampler.time_conv.bias"),
        (
            "decoder.upsamples.2.upsamples.3.resample.1.weight",
            "decoder.up_blocks.2.upsampler.resample.1.weight",
        ),
        ("decoder.head.0.gamma", "decoder.norm_out.gamma"),
        ("decoder.head.2.weight", "decoder.conv_out.weight"),
    ],
)
def test_original_key_table(original, diffusers_name):
    assert original_to_diffusers_key(original) == diffusers_name


def test_all_layouts_give_the_same_decoder(tiny_checkpoints):
    z = torch.randn(1, 48, 2, 2, 3, dtype=torch.float64)
    outputs = [load_vae_decoder(path, dtype=torch.float64).decode(z) for path in tiny_checkpoints.values()]
    for out in outputs[1:]:
        assert torch.equal(out, outputs[0])


def test_repo_root_with_vae_subfolder(tiny_checkpoints):
    root = tiny_checkpoints["diffusers"].parent
    assert (
        resolve_vae_checkpoint(root).weights
        == tiny_checkpoints["diffusers"] / "diffusion_pytorch_model.safetensors"
    )


def test_diffusers_config_widths_are_read(tiny_vae):
    assert resolve_vae_checkpoint(tiny_vae).config.decoder_dims == (64, 64, 64, 32, 16)


def _edited_copy(tmp_path, source_dir, edit):
    """A copy of the diffusers folder with its state dict passed through `edit`."""
    folder = tmp_path / "vae"
    shutil.copytree(source_dir, folder)
    weights = folder / "diffusion_pytorch_model.safetensors"
    state = edit(load_file(weights))
    save_file(state, weights)
    return folder


def test_missing_key_is_named(tmp_path, tiny_vae):
    folder = _edited_copy(
        tmp_path, tiny_vae, lambda s: {k: v for k, v in s.items() if k != "decoder.conv_out.bias"}
    )
    with pytest.raises(CheckpointError, match=r"missing keys: decoder\.conv_out\.bias"):
        load_vae_decoder(folder)


def test_unexpected_keys_are_named_but_encoder_keys_accepted(tmp_path, tiny_vae):
    def add(state):
        assert (
            any(k.startswith("encoder.") for k in state) and "quant_conv.weight" in state
        )  # real files hold them
        return {**state, "decoder.extra.weight": torch.zeros(1), "text_encoder.x": torch.zeros(1)}

    folder = _edited_copy(tmp_path, tiny_vae, add)
    with pytest.raises(CheckpointError, match=r"unexpected keys: decoder\.extra\.weight, text_encoder\.x"):
        load_vae_decoder(folder)


def test_misshaped_key_is_named_with_both_shapes(tmp_path, tiny_vae):
    folder = _edited_copy(
        tmp_path, tiny_vae, lambda s: {**s, "decoder.conv_out.weight": torch.zeros(12, 16, 3, 3, 1)}
    )
    with pytest.raises(
        CheckpointError,
        match=r"decoder\.conv_out\.weight \[12, 16, 3, 3, 1\] \(expected \[12, 16, 3, 3, 3\]\)",
    ):
        load_vae_decoder(folder)


def test_integer_tensor_is_refused(tmp_path, tiny_vae):
    folder = _edited_copy(
        tmp_path, tiny_vae, lambda s: {**s, "decoder.conv_out.bias": torch.zeros(12, dtype=torch.int32)}
    )
    with pytest.raises(CheckpointError, match="expected a float"):
        load_vae_decoder(folder)


def test_checkpoint_of_another_model(tmp_path):
    path = tmp_path / "unet.safetensors"
    save_file({"down.0.weight": torch.zeros(2, 2)}, path)
    with pytest.raises(CheckpointError, match="not a Wan VAE checkpoint"):
        load_vae_decoder(path)


def test_wan21_config_is_refused(tmp_path, tiny_vae):
    folder = tmp_path / "vae"
    shutil.copytree(tiny_vae, folder)
    config = json.loads((folder / "config.json").read_text())
    config["is_residual"] = False
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="Wan2.1"):
        load_vae_decoder(folder)


def test_other_model_class_in_config_is_refused(tmp_path, tiny_vae):
    folder = tmp_path / "vae"
    shutil.copytree(tiny_vae, folder)
    (folder / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    with pytest.raises(CheckpointError, match="AutoencoderKL, not a Wan VAE"):
        load_vae_decoder(folder)


@pytest.mark.parametrize("layout, message", [("safetensors", "truncated"), ("pth", "could not be read")])
def test_truncated_file(tmp_path, tiny_checkpoints, layout, message):
    path = tmp_path / f"cut.{layout}"
    data = tiny_checkpoints[layout].read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=message):
        load_vae_decoder(path)


def test_pickle_with_objects_is_refused(tmp_path):
    path = tmp_path / "evil.pth"
    torch.save({"conv2.weight": torch.zeros(1), "meta": torch.nn.Linear(1, 1)}, path)
    with pytest.raises(CheckpointError, match="plain tensors"):
        load_vae_decoder(path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.pth"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match="empty"):
        load_vae_decoder(path)


def test_folder_without_a_checkpoint(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        load_vae_decoder(tmp_path)


def test_path_that_does_not_exist(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        load_vae_decoder(tmp_path / "Wan2.2_VAE.pth")


def test_dtype_and_device(tiny_vae):
    decoder = load_vae_decoder(tiny_vae, dtype=torch.bfloat16)
    assert decoder.dtype == torch.bfloat16 and decoder.device.type == "cpu"
    assert not any(p.requires_grad for p in decoder.parameters())
