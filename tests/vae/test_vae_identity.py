"""A latents file says which VAE it belongs to (`pan2cli.vae.identity`): `pan2 generate --save-latents` records it,
`pan2 decode` refuses another VAE (exit 2, both named, the `--vae` that fits in the hint) and takes the same VAE in
any layout or dtype, and files without the record (older files, other tools) with any VAE."""

from __future__ import annotations

import pytest
import torch

from pan2cli.testing.random_weights import write_test_checkpoints
from pan2cli.vae.config import WanVAEConfig
from pan2cli.vae.identity import identity_mismatch, vae_identity

CLI_SMALL = ("--steps", 1, "--frames", 5, "--size", "64x64", "--device", "cpu")


@pytest.fixture(scope="module")
def made(tiny_pan2, tmp_path_factory):
    """Latents of the tiny repository's VAE (`generate --save-latents`), and VAEs to decode them with."""
    from click.testing import CliRunner

    from pan2cli.cli import cli

    folder = tmp_path_factory.mktemp("made")
    res = CliRunner().invoke(
        cli,
        [
            "generate",
            "x",
            "--model",
            str(tiny_pan2),
            *map(str, CLI_SMALL),
            "--save-latents",
            "-o",
            str(folder / "x.mp4"),
        ],
    )
    assert res.exit_code == 0, res.stderr
    small = WanVAEConfig(base_dim=16, decoder_base_dim=16)  # the tiny repository's architecture
    vaes = {
        "same, original layout in bf16": write_test_checkpoints(
            folder / "same", small, seed=0, formats=("pth",), dtype=torch.bfloat16
        )["pth"],
        "other weights": write_test_checkpoints(folder / "seed1", small, seed=1, formats=("diffusers",))[
            "diffusers"
        ],
        "other architecture": write_test_checkpoints(
            folder / "wide", small.replace(decoder_base_dim=32), seed=0, formats=("diffusers",)
        )["diffusers"],
    }
    return folder / "x.latents.pt", vaes


def test_save_latents_records_the_vae(made, tiny_pan2):
    latents, _ = made
    record = torch.load(latents, weights_only=True)["vae"]
    assert record["vae"] == str(tiny_pan2 / "vae") and record["model"] == str(tiny_pan2.resolve())
    assert record["architecture"]["decoder_base_dim"] == 16 and record["architecture"]["z_dim"] == 48
    assert len(record["signature"]) == 48 + 12  # post_quant_conv's and conv_out's biases
    assert identity_mismatch(record, vae_identity(tiny_pan2 / "vae")) is None


@pytest.mark.parametrize(
    "which, problem",
    [
        ("other weights", "its weights are others (the biases of post_quant_conv and conv_out differ)"),
        ("other architecture", "its decoder_base_dim is 32, not 16"),
    ],
)
def test_decode_refuses_latents_made_for_another_vae(made, tiny_pan2, run_cli, tmp_path, which, problem):
    """`generate --save-latents` then `pan2 decode` with another VAE gave exit 0 and a wrong video."""
    latents, vaes = made
    out = tmp_path / "d.mp4"
    res = run_cli("decode", latents, "--vae", vaes[which], "--device", "cpu", "-o", out)
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [
        f"Error: latents file {latents} was made for the VAE {tiny_pan2 / 'vae'}, and --vae {vaes[which]} is "
        f"another: {problem}",
        f"Hint: decode it with --vae {tiny_pan2 / 'vae'}",
    ]
    assert not out.exists()


def test_decode_takes_the_same_vae_in_any_layout_and_files_without_a_record(
    made, tiny_pan2, run_cli, tmp_path
):
    latents, vaes = made
    for vae in (tiny_pan2 / "vae", vaes["same, original layout in bf16"]):
        res = run_cli(
            "decode", latents, "--vae", vae, "--device", "cpu", "-o", tmp_path / "d.mp4", "--overwrite"
        )
        assert res.exit_code == 0, res.stderr
    plain = tmp_path / "plain.pt"
    torch.save({"latents": torch.load(latents, weights_only=True)["latents"], "fps": 24.0}, plain)
    res = run_cli(
        "decode", plain, "--vae", vaes["other weights"], "--device", "cpu", "-o", tmp_path / "p.mp4"
    )
    assert res.exit_code == 0, res.stderr


def test_a_record_of_another_shape_is_no_record(tiny_pan2):
    """A `vae` entry another tool wrote, or a damaged one, is not compared (the file decodes as one without it)."""
    ours = vae_identity(tiny_pan2 / "vae")
    damaged = {**ours, "architecture": {"z_dim": 16}}
    for theirs in ({"vae": "some/repo"}, {"architecture": "wide"}, {**ours, "signature": "?"}, damaged):
        assert identity_mismatch(theirs, ours) is None
    assert identity_mismatch({**ours, "latent_statistics": "0" * 16}, ours).startswith(
        "its latent statistics"
    )
