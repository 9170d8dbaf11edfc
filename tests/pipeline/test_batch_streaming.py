"""A `--prompts` batch that streams (`VideoGenerator.generate_batch`): each video decoded, written (MP4 and sidecar)
and printed as soon as its denoising ends; the decoder loaded once beside the transformer, which goes before the
last decode; the one-line fallback when the decoder does not fit; an interrupted batch that keeps what it finished
and resumes with `--skip-existing`; outputs that another batch writes meanwhile, skipped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

import pan2cli.cli.generate as generate_cli
import pan2cli.pipeline.memory as memory
from pan2cli.pipeline.generator import VideoGenerator
from pan2cli.video import VideoWriter
from tests.subprocess_env import hooked_env, wait_while_running

CLI_SMALL = ("--steps", 1, "--frames", 5, "--size", "64x64", "--device", "cpu")
NAMES = ["000_p-one", "001_p-two", "002_p-three"]


@pytest.fixture
def three(tmp_path):
    """A prompt file of three prompts and an empty output folder."""
    prompts = tmp_path / "three.txt"
    prompts.write_text("p one\np two\np three\n")
    out = tmp_path / "out"
    out.mkdir()
    return prompts, out


def _files(folder) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def _spy_samples(monkeypatch, on_sample):
    """Call `on_sample(generator, prompt)` before each video's denoising."""
    real = VideoGenerator.sample

    def sample(self, model, settings, *args, **kwargs):
        on_sample(self, settings.prompt)
        return real(self, model, settings, *args, **kwargs)

    monkeypatch.setattr(VideoGenerator, "sample", sample)


def _spy_resident_transformer(monkeypatch) -> list[bool]:
    """Whether the transformer is still alive (anywhere: the generator, its background load) at each decode."""
    import gc
    import weakref

    models = []
    real_prepare = VideoGenerator._prepare_dit

    def prepare(self, model):
        models.append(weakref.ref(model))
        return real_prepare(self, model)

    resident = []
    real_decode = VideoGenerator._decode_one

    def decode_one(self, decoder, result, writes):
        gc.collect()
        resident.append(models[-1]() is not None)
        return real_decode(self, decoder, result, writes)

    monkeypatch.setattr(VideoGenerator, "_prepare_dit", prepare)
    monkeypatch.setattr(VideoGenerator, "_decode_one", decode_one)
    return resident


def test_each_video_is_written_and_printed_as_soon_as_it_is_denoised(tiny_pan2, run_cli, three, monkeypatch):
    """The batch ran stage by stage: nothing was written (or printed) until every prompt had been denoised."""
    prompts, out = three
    events = []
    _spy_samples(monkeypatch, lambda gen, prompt: events.append((f"denoise {prompt}", _files(out))))
    real_result = generate_cli.result
    monkeypatch.setattr(
        generate_cli, "result", lambda line: (events.append(f"printed {line}"), real_result(line))
    )
    res = run_cli("generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, "-o", out)
    assert res.exit_code == 0, res.stderr
    assert events == [
        ("denoise p one", []),
        f"printed {out / '000_p-one.mp4'}",
        ("denoise p two", ["000_p-one.json", "000_p-one.mp4"]),
        f"printed {out / '001_p-two.mp4'}",
        ("denoise p three", ["000_p-one.json", "000_p-one.mp4", "001_p-two.json", "001_p-two.mp4"]),
        f"printed {out / '002_p-three.mp4'}",
    ]
    side = json.loads((out / "001_p-two.json").read_text())
    assert {name: load["videos"] for name, load in side["shared_loads"].items()} == {
        "load_text_encoder": 3, "load_transformer": 3, "load_vae_decoder": 3,
    }  # fmt: skip
    assert set(side["seconds"]) == {"text_encoding", "denoising", "decode", "write"}
    assert side["time_to_first_step_from"] == "command start" and side["time_to_first_step"] > 0


def test_the_decoder_loads_once_beside_the_transformer_which_goes_before_the_last_decode(
    tiny_pan2, run_cli, three, monkeypatch
):
    prompts, out = three
    import pan2cli.pipeline.streaming as streaming

    opened = []
    real_open = streaming.open_decoder
    monkeypatch.setattr(streaming, "open_decoder", lambda *a, **k: opened.append(1) or real_open(*a, **k))
    resident = _spy_resident_transformer(monkeypatch)
    res = run_cli("generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, "-o", out)
    assert res.exit_code == 0, res.stderr
    assert len(opened) == 1 and resident == [True, True, False]
    assert "Decoding after the last video is denoised" not in res.stderr


def test_one_prompt_releases_the_transformer_before_its_decode(tiny_pan2, run_cli, tmp_path, monkeypatch):
    resident = _spy_resident_transformer(monkeypatch)
    res = run_cli("generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "-o", tmp_path / "cat.mp4")
    assert res.exit_code == 0, res.stderr
    assert resident == [False]  # one video's peak memory: the decode never shares the device with the DiT


@pytest.mark.parametrize("save_latents", [False, True])
def test_without_room_for_the_decoder_the_latents_are_kept_until_the_transformer_is_gone(
    tiny_pan2, run_cli, three, monkeypatch, save_latents
):
    """The fallback: one line, every video denoised first with its latents written at once (nothing lost if the
    batch stops), then decoded; the latents files go once their videos are written (they stay with
    `--save-latents`: they are its files)."""
    prompts, out = three
    monkeypatch.setattr(memory, "free_memory", lambda device, cap_gib=None: (2**20, "the GPU"))
    at_first_decode = []
    real_decode = VideoGenerator._decode_one

    def decode_one(self, decoder, result, writes):
        if not at_first_decode:
            at_first_decode.extend(_files(out))
            assert self._dit is None
        return real_decode(self, decoder, result, writes)

    monkeypatch.setattr(VideoGenerator, "_decode_one", decode_one)
    extra = ["--save-latents"] if save_latents else []
    res = run_cli("generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, *extra, "-o", out)
    assert res.exit_code == 0, res.stderr
    lines = [line for line in res.stderr.splitlines() if "Decoding after the last video is denoised" in line]
    assert len(lines) == 1 and "the GPU has 0.0 GiB free" in lines[0] and "<name>.latents.pt" in lines[0]
    assert at_first_decode == ["000_p-one.latents.pt", "001_p-two.latents.pt"]  # the last is decoded at once
    kept = ("json", "mp4", "latents.pt") if save_latents else ("json", "mp4")
    assert _files(out) == sorted(f"{name}.{ext}" for name in NAMES for ext in kept)
    side = json.loads((out / "000_p-one.json").read_text())
    assert side["shared_loads"]["load_vae_decoder"]["videos"] == 3
    assert set(side["seconds"]) == {"text_encoding", "denoising", "decode", "write"}


def test_an_interrupted_fallback_batch_keeps_the_latents_and_says_how_to_finish(
    tiny_pan2, run_cli, three, monkeypatch
):
    prompts, out = three
    monkeypatch.setattr(memory, "free_memory", lambda device, cap_gib=None: (2**20, "the GPU"))

    def interrupt(self, *args):
        raise KeyboardInterrupt

    monkeypatch.setattr(VideoGenerator, "_decode_one", interrupt)
    res = run_cli("generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, "-o", out)
    assert res.exit_code == 130 and "Interrupted." in res.stderr
    assert _files(out) == ["000_p-one.latents.pt", "001_p-two.latents.pt"]
    warnings = [line for line in res.stderr.splitlines() if line.startswith("Warning:")]
    assert len(warnings) == 2, res.stderr
    latents, video = out / "001_p-two.latents.pt", out / "001_p-two.mp4"
    assert warnings[1] == (
        f"Warning: {video} was not written; its latents are in {latents}; to make the video: "
        f"pan2 decode {latents} -o {video} --vae {tiny_pan2 / 'vae'}"
    )


def test_an_interrupted_batch_keeps_what_it_finished_and_skip_existing_resumes_it(
    tiny_pan2, run_cli, three, monkeypatch
):
    """SIGTERM 45 s into a 3-prompt batch left an empty folder: the finished videos were lost."""
    prompts, out = three

    def stop_at_the_third(generator, prompt):
        if prompt == "p three":
            raise KeyboardInterrupt

    with monkeypatch.context() as patch:
        _spy_samples(patch, stop_at_the_third)
        res = run_cli("generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, "-o", out)
    assert res.exit_code == 130 and "Interrupted." in res.stderr
    assert res.stdout.split() == [str(out / "000_p-one.mp4"), str(out / "001_p-two.mp4")]
    assert _files(out) == ["000_p-one.json", "000_p-one.mp4", "001_p-two.json", "001_p-two.mp4"]
    denoised = []
    _spy_samples(monkeypatch, lambda gen, prompt: denoised.append(prompt))
    res = run_cli(
        "generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, "-o", out, "--skip-existing"
    )
    assert res.exit_code == 0, res.stderr
    assert denoised == ["p three"] and res.stdout.split() == [str(out / "002_p-three.mp4")]
    assert "1 video(s) written, 2 skipped, 0 failed." in res.stderr


def test_outputs_another_batch_writes_meanwhile_are_skipped_not_failed(
    tiny_pan2, run_cli, three, monkeypatch
):
    """Two batches on one folder with --skip-existing: the second failed every record with "already exists" at
    write time. An output that appears before its video's denoising is not made; one that appears while its video
    is denoised, or while it is written, is not replaced (nor its sidecar); each is counted as skipped."""
    prompts, out = three
    denoised = []

    def other_batch_writes(generator, prompt):
        denoised.append(prompt)
        if prompt == "p one":
            (out / "000_p-one.mp4").write_bytes(b"theirs, while ours is denoised")
            (out / "001_p-two.mp4").write_bytes(b"theirs, before ours is denoised")

    _spy_samples(monkeypatch, other_batch_writes)
    real_finish = VideoWriter.finish

    def finish(self):
        real_finish(self)
        if self.path.name == "002_p-three.mp4":  # while p three is written
            self.path.write_bytes(b"theirs, while ours is written")
            (out / "002_p-three.json").write_text("{}")

    monkeypatch.setattr(VideoWriter, "finish", finish)
    res = run_cli(
        "generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, "-o", out, "--skip-existing"
    )
    assert res.exit_code == 0, res.stderr
    assert "Error" not in res.stderr and res.stdout == ""
    assert denoised == ["p one", "p three"]
    for name in NAMES:
        line = f"Skipping {out / name}.mp4: it appeared while this batch ran (--skip-existing)."
        assert line in res.stderr
    assert "0 video(s) written, 3 skipped, 0 failed." in res.stderr
    assert (out / "000_p-one.mp4").read_bytes() == b"theirs, while ours is denoised"
    assert (out / "001_p-two.mp4").read_bytes() == b"theirs, before ours is denoised"
    assert (out / "002_p-three.mp4").read_bytes() == b"theirs, while ours is written"
    assert (out / "002_p-three.json").read_text() == "{}"
    assert _files(out) == ["000_p-one.mp4", "001_p-two.mp4", "002_p-three.json", "002_p-three.mp4"]


def test_an_output_that_appears_before_the_jobs_are_checked_is_skipped(
    tiny_pan2, run_cli, three, monkeypatch
):
    """Between planning the jobs and checking them against the checkpoint (the model is located meanwhile), another
    batch writes an output and its sidecar: skipped, not "already exists"."""
    prompts, out = three
    real = VideoGenerator.from_pretrained.__func__

    def from_pretrained(cls, *args, **kwargs):
        generator = real(cls, *args, **kwargs)
        (out / "001_p-two.mp4").write_bytes(b"theirs")
        (out / "001_p-two.json").write_text("{}")
        return generator

    monkeypatch.setattr(VideoGenerator, "from_pretrained", classmethod(from_pretrained))
    res = run_cli(
        "generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, "-o", out, "--skip-existing"
    )
    assert res.exit_code == 0, res.stderr
    assert "2 video(s) written, 1 skipped, 0 failed." in res.stderr
    assert (out / "001_p-two.json").read_text() == "{}"


# Loaded by the `pan2 generate` process through PYTHONPATH: the third prompt's denoising says so in a file and waits
# to be stopped.
_WAIT_AT_THE_THIRD = """
import os, time
if os.environ.get("PAN2_TEST_MARK"):
    import pan2cli.pipeline.generator as generator
    real = generator.VideoGenerator.sample

    def sample(self, model, settings, *args, **kwargs):
        if settings.prompt == "p three":
            open(os.environ["PAN2_TEST_MARK"], "w").close()
            time.sleep(120)
        return real(self, model, settings, *args, **kwargs)

    generator.VideoGenerator.sample = sample
"""


@pytest.mark.skipif(os.name == "nt", reason="POSIX signals")
def test_sigterm_keeps_every_finished_video_with_its_sidecar(tiny_pan2, three, tmp_path):
    prompts, out = three
    mark = tmp_path / "third"
    command = [
        sys.executable,
        "-m",
        "pan2cli",
        "generate",
        "--prompts",
        str(prompts),
        "--model",
        str(tiny_pan2),
    ]
    command += [*map(str, CLI_SMALL), "-o", str(out)]
    env = hooked_env(tmp_path, _WAIT_AT_THE_THIRD, PAN2_TEST_MARK=str(mark))
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_while_running(proc, mark.exists, time.monotonic() + 120)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 143 and "Terminated." in stderr, stderr
    assert stdout.split() == [str(out / "000_p-one.mp4"), str(out / "001_p-two.mp4")]
    assert _files(out) == ["000_p-one.json", "000_p-one.mp4", "001_p-two.json", "001_p-two.mp4"]
