"""`pan2 --help/--version`, `pan2 presets`, `pan2 doctor`."""

from __future__ import annotations

import json
import re

import pan2cli
from pan2cli.cli import cli


def test_version(run_cli):
    result = run_cli("--version")
    assert result.exit_code == 0
    assert result.stdout.strip() == f"pan2 {pan2cli.__version__}"


def test_help_lists_commands_and_exit_codes(run_cli):
    result = run_cli("--help")
    assert result.exit_code == 0
    for command in ("decode", "presets", "doctor"):
        assert command in result.stdout
    assert "Exit codes" in result.stdout and "130" in result.stdout


def test_every_decode_option_is_documented_with_examples(run_cli):
    text = run_cli("decode", "--help").stdout
    options = [opt for param in cli.commands["decode"].params for opt in getattr(param, "opts", []) if opt.startswith("--")]
    assert len(options) >= 12
    for option in options:
        assert re.search(rf"{option}\b", text), option
    assert "Examples:" in text and "pan2 decode latents.pt -o video.mp4" in text


def test_unknown_option_is_a_usage_error(run_cli):
    result = run_cli("decode", "x.pt", "--no-such-flag")
    assert result.exit_code == 2


def test_presets_list_and_show(run_cli):
    listing = run_cli("presets", "list")
    assert listing.exit_code == 0
    names = [line.split()[0] for line in listing.stdout.splitlines()]
    assert names == ["pan2-5s", "pan2-10s", "pan2-20s"]
    shown = run_cli("presets", "show", "pan2-5s", "--json")
    assert shown.exit_code == 0
    values = json.loads(shown.stdout)
    assert values["frames"] == 121 and values["latent_shape"] == [1, 48, 31, 44, 78]
    assert 'frames = 241' in run_cli("presets", "show", "pan2-10s").stdout


def test_unknown_preset_exits_2(run_cli):
    result = run_cli("presets", "show", "pan2-99s")
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: ")
    assert "pan2-10s" in result.stderr  # lists what exists


def test_doctor_reports_the_machine(run_cli):
    result = run_cli("doctor", "--json")
    assert result.exit_code == 0
    report = json.loads(result.stdout)
    assert report["pan2cli"] == pan2cli.__version__
    assert "reference" in report["decode_path"]
    assert report["ffmpeg"] and "not found" not in report["ffmpeg"]


def test_decode_kernel_require_without_a_gpu_is_refused(run_cli, tiny_vae, latents_file, tmp_path):
    result = run_cli("decode", latents_file((48, 1, 2, 2)), "--vae", tiny_vae, "--device", "cpu", "--decode-kernel", "require")
    assert result.exit_code == 2
    assert "Error: --decode-kernel require: the decode runs on cpu" in result.stderr
    assert not (tmp_path / "latents.mp4").exists()


def test_decode_kernel_auto_on_cpu_says_nothing_about_the_kernel(run_cli, tiny_vae, latents_file):
    result = run_cli("decode", latents_file((48, 1, 2, 2)), "--vae", tiny_vae, "--device", "cpu")
    assert result.exit_code == 0, result.stderr
    assert "Using the reference decoder" not in result.stderr  # on the CPU it is the only path
    assert "(reference decoder)" in result.stderr


def test_kernels_status_and_clean(run_cli, tmp_path, monkeypatch):
    monkeypatch.setenv("PAN2_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "cache" / "kernels" / "0.0" / "x").mkdir(parents=True)
    status = json.loads(run_cli("kernels", "status", "--json").stdout)
    assert status["built"] is False and "reference" in status["decode_path"]
    cleaned = run_cli("kernels", "clean")
    assert cleaned.exit_code == 0 and cleaned.stdout.strip() == str(tmp_path / "cache" / "kernels")
    assert not (tmp_path / "cache" / "kernels").exists()


def test_kernels_build_without_a_gpu_exits_1(run_cli):
    result = run_cli("kernels", "build")
    assert result.exit_code == 1
    assert result.stderr.startswith("Error: ")
