"""`pan2 generate` (and `pan2 decode`): the checks that need only the options and files, made before any model loads,
and the small things a user reads (help, summaries, hints, the sidecar's record of the options)."""

from __future__ import annotations

import json
import sys

import pytest

import pan2cli.pipeline.generator as generator_module
from pan2cli.config import settings_with
from pan2cli.constants import MAX_FRAMES
from pan2cli.errors import InputError
from pan2cli.pipeline.batch_plan import plan_jobs
from pan2cli.presets import load_preset

CLI_SMALL = ("--steps", 1, "--frames", 5, "--size", "64x64", "--device", "cpu")


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail the test if `pan2 generate` gets as far as locating the checkpoint, or `pan2 decode` as loading its VAE."""
    import pan2cli.vae.decoder as decoder_module

    def located(*args, **kwargs):
        pytest.fail("the checkpoint was located: a model was about to load")

    monkeypatch.setattr(generator_module, "resolve_components", located)
    monkeypatch.setattr(decoder_module, "load_vae_decoder", located)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


# -- before anything loads ------------------------------------------------------------------------------------------
def test_decode_kernel_require_on_the_cpu_is_refused_before_anything_loads(
    nothing_loads, run_cli, tmp_path, latents_file
):
    """`generate --decode-kernel require` failed after all the denoising; `decode` after loading its VAE. Both now
    refuse it from the options, with the same line."""
    out = tmp_path / "x.mp4"
    line = "Error: --decode-kernel require: the decode runs on cpu, the compiled kernel needs a CUDA GPU"
    res = run_cli("generate", "x", "--model", tmp_path, *CLI_SMALL, "--decode-kernel", "require", "-o", out)
    assert res.exit_code == 2 and _errors(res.stderr) == [line], res.stderr
    res = run_cli("decode", latents_file(), "--device", "cpu", "--decode-kernel", "require", "-o", out)
    assert res.exit_code == 2 and _errors(res.stderr) == [line], res.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (("--duration", "1e308"), "a duration of 1e+308 s at 24 fps is more frames than any number can hold"),
        (
            ("--frames", 400001),
            "a video of 400001 frames (1.667e+04 s at 24 fps) is longer than the limit of 961",
        ),
        (
            ("--duration", "1e6"),
            "a video of 24000001 frames (1e+06 s at 24 fps) is longer than the limit of 961",
        ),
    ],
)
def test_a_length_beyond_the_bound_is_refused_before_anything_loads(
    nothing_loads, run_cli, tmp_path, args, message
):
    """`--duration 1e308` was an OverflowError traceback; `--frames 400001` and `--duration 1e6` ran silently for
    minutes. Refused with exit 2, before any model loads."""
    res = run_cli("generate", "x", "--model", tmp_path, "--device", "cpu", *args, "-o", tmp_path / "x.mp4")
    assert res.exit_code == 2, res.stderr
    (error,) = _errors(res.stderr)
    assert error == f"Error: {message}" or error.startswith(f"Error: {message}"), res.stderr
    if "limit" in message:
        assert "--max-frames" in res.stderr


def test_max_frames_moves_the_bound():
    preset = load_preset("pan2-5s")
    assert MAX_FRAMES == 961
    (job,), *_ = plan_jobs("x", None, "x.mp4", preset, {"frames": 1921}, max_frames=2000)
    assert job.settings.frames == 1921
    with pytest.raises(InputError, match="longer than the limit of 481 frames"):
        plan_jobs("x", None, "x.mp4", preset, {"frames": 485}, max_frames=481)
    (job,), *_ = plan_jobs("x", None, "x.mp4", preset, {"frames": 481})  # the longest preset's length passes


def test_an_overflowing_duration_in_a_record_fails_that_record_only(tmp_path):
    prompts = tmp_path / "durhuge.json"
    prompts.write_text(
        '["ok", {"prompt": "huge", "duration": 1e308}, {"prompt": "long", "duration": 1e6}, "ok2"]'
    )
    jobs, failures, *_ = plan_jobs(None, prompts, str(tmp_path), load_preset("pan2-5s"), {})
    assert [job.settings.prompt for job in jobs] == ["ok", "ok2"]
    assert [str(f).split(": ", 2)[1:] for f in failures] == [
        ["prompt 1 (001_huge)", "a duration of 1e+308 s at 24 fps is more frames than any number can hold"],
        ["prompt 2 (002_long)", "a video of 24000001 frames (1e+06 s at 24 fps) is longer than the limit of 961 "
         "frames (40.04 s)"],
    ]  # fmt: skip


def test_an_overflowing_duration_is_bad_input_for_the_settings_too():
    with pytest.raises(InputError, match="1e\\+308 s"):
        settings_with(load_preset("pan2-5s"), {"duration": 1e308})


def test_skip_existing_and_overwrite_together_are_refused(nothing_loads, run_cli, tmp_path):
    """`--skip-existing` silently lost to `--overwrite`."""
    res = run_cli("generate", "x", "--model", tmp_path, *CLI_SMALL, "--skip-existing", "--overwrite")
    assert res.exit_code == 2
    assert _errors(res.stderr) == [
        "Error: --skip-existing keeps the videos that exist and --overwrite replaces them: pass one of them"
    ]


def test_a_missing_mp4_encoder_is_said_before_any_work(nothing_loads, run_cli, tmp_path, monkeypatch):
    """On a host where imageio_ffmpeg was not importable, a full-size generation ran 163 s and then died with a
    ModuleNotFoundError traceback in the writer. Now: exit 1 before anything loads, with the way to install it."""
    monkeypatch.setitem(sys.modules, "imageio_ffmpeg", None)  # `import imageio_ffmpeg` raises ImportError
    res = run_cli("generate", "x", "--model", tmp_path, *CLI_SMALL, "-o", tmp_path / "x.mp4")
    assert res.exit_code == 1, res.stderr
    (error,) = _errors(res.stderr)
    assert error.startswith("Error: writing MP4 needs imageio-ffmpeg, which cannot be imported")
    assert "Hint: pip install imageio-ffmpeg" in res.stderr and "Traceback" not in res.stderr


def test_an_ffmpeg_that_does_not_run_is_said_before_any_work(tmp_path, monkeypatch):
    import imageio_ffmpeg

    from pan2cli.errors import Pan2Error
    from pan2cli.ffmpeg import check_mp4_encoder

    broken = tmp_path / "ffmpeg"
    broken.write_text("#!/bin/sh\nexit 127\n")
    broken.chmod(0o755)
    monkeypatch.setattr(imageio_ffmpeg, "get_ffmpeg_exe", lambda: str(broken))
    with pytest.raises(Pan2Error, match=f"writing MP4 needs ffmpeg, and {broken} does not run") as caught:
        check_mp4_encoder()
    assert "pip install imageio-ffmpeg" in caught.value.hint


def test_a_prompt_file_with_o_naming_a_file_says_a_folder_is_needed(nothing_loads, run_cli, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    res = run_cli(
        "generate", "--prompts", prompts, "--model", tmp_path, "--device", "cpu", "-o", tmp_path / "v.mp4"
    )
    assert res.exit_code == 2
    assert res.stderr.splitlines() == [
        f"Error: -o {tmp_path / 'v.mp4'}: with --prompts, -o is the folder the videos go to (NNN_<name>.mp4 each), "
        "not a file",
        "Hint: pass an existing folder, e.g. -o videos/ after mkdir videos",
    ]


# -- what the user reads --------------------------------------------------------------------------------------------
def test_guidance_help_says_at_most_one_skips_the_negative_prompt(run_cli):
    res = run_cli("generate", "--help")
    assert "≤ 1 skips the negative prompt" in " ".join(res.stdout.split())
    assert "--max-frames" in res.stdout


def test_the_sidecar_records_crf_and_the_flags_over_the_presets_runtime_keys(tiny_pan2, run_cli, tmp_path):
    """`--crf` was not recorded; `--precision` and `--chunk-latent-frames`, which override a preset's keys, were
    missing from `overrides`, so preset + overrides rebuilt another run. The summary line says HxW, as `--size`."""
    out = tmp_path / "x.mp4"
    res = run_cli(
        "generate", "x", "--model", tiny_pan2, "--steps", 1, "--frames", 5, "--size", "32x64", "--device", "cpu",
        "--precision", "bf16", "--chunk-latent-frames", 2, "--crf", 20, "-o", out,
    )  # fmt: skip
    assert res.exit_code == 0, res.stderr
    side = json.loads(out.with_suffix(".json").read_text())
    assert side["crf"] == 20 and side["x264_preset"] == "faster"
    assert side["overrides"]["precision"] == {"value": "bf16", "from": "--precision"}
    assert side["overrides"]["chunk_latent_frames"] == {"value": 2, "from": "--chunk-latent-frames"}
    assert side["config"]["chunk_latent_frames"] == 2
    assert f"{out}: 5 frames, 32x64;" in res.stderr  # height x width, as --size 32x64 said


def test_a_long_negative_prompt_is_warned_about_as_the_negative_prompt(tiny_pan2, run_cli, tmp_path):
    negative = " ".join(["blurry dark shaky"] * 700)  # well over 1536 tokens
    res = run_cli(
        "generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "--negative-prompt", negative, "-q",
        "-o", tmp_path / "x.mp4",
    )  # fmt: skip
    assert res.exit_code == 0, res.stderr
    (warning,) = [line for line in res.stderr.splitlines() if line.startswith("Warning:")]
    assert (
        warning.startswith("Warning: the negative prompt 'blurry dark shaky") and "tokens were cut" in warning
    )
