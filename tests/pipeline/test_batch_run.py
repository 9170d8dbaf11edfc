"""The run layer through the Python API (`pan2cli.pipeline.batch_run`, `VideoGenerator.generate_file`): the preset's
run-time keys honoured as `pan2 generate` honours them, prompt files with the command's rules, and which failures
are a prompt's own (the batch goes on) and which stop the batch (a bug)."""

from __future__ import annotations

import json

import pytest
import torch

from pan2cli.config import RuntimeConfig
from pan2cli.errors import InputError
from pan2cli.pipeline import VideoGenerator
from pan2cli.presets import load_preset, preset_to_toml

SMALL = dict(steps=1, frames=9, height=64, width=64)
CLI_SMALL = ("--steps", 1, "--frames", 9, "--size", "64x64", "--device", "cpu")


def _preset(tmp_path, name: str, **keys) -> object:
    """The shipped pan2-5s with `keys` set (`precision`, `chunk_latent_frames`), as a user's preset file."""
    text = preset_to_toml(load_preset("pan2-5s"))
    if "precision" in keys:
        text = text.replace("# precision: not set", f'precision = "{keys["precision"]}"\n#')
    if "chunk_latent_frames" in keys:
        text = text.replace(
            "\nchunk_latent_frames = 4\n", f"\nchunk_latent_frames = {keys['chunk_latent_frames']}\n"
        )
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


def test_the_presets_precision_is_honoured_through_the_api_with_the_clis_error(
    tiny_pan2, run_cli, tmp_path, monkeypatch
):
    """A preset that sets fp8, on a machine without a GPU: `VideoGenerator.generate` refuses it before anything loads,
    with the line `pan2 generate --preset` gives; a precision given in the config wins over the preset's."""
    preset = _preset(tmp_path, "fp8", precision="fp8")
    res = run_cli(
        "generate", "a cat", "--model", tiny_pan2, *CLI_SMALL, "--preset", preset, "-o", tmp_path / "a.mp4"
    )
    assert res.exit_code == 2
    cli_error = res.stderr.splitlines()[0]
    assert cli_error.startswith(f'Error: preset {preset} sets precision = "fp8": fp8 needs a CUDA GPU')

    import pan2cli.pipeline.loading as loading

    monkeypatch.setattr(loading.ModelStages, "_read_dit", lambda *a, **k: pytest.fail("the DiT loaded"))
    generator = VideoGenerator.from_pretrained(tiny_pan2, config=RuntimeConfig(device="cpu"))
    with pytest.raises(InputError) as error:
        generator.generate("a cat", preset=preset, output=tmp_path / "b.mp4", **SMALL)
    assert f"Error: {error.value}" == cli_error and "--precision bf16" in error.value.hint
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\n")
    with pytest.raises(InputError, match="fp8 needs a CUDA GPU"):
        generator.generate_file(prompts, output=tmp_path, preset=preset, **SMALL)
    assert list(tmp_path.glob("*.mp4")) == []

    monkeypatch.undo()
    bf16 = VideoGenerator.from_pretrained(tiny_pan2, config=RuntimeConfig(device="cpu", precision="bf16"))
    bf16.generate("a cat", preset=preset, output=tmp_path / "c.mp4", **SMALL)
    side = json.loads((tmp_path / "c.json").read_text())
    assert side["config"]["precision"] == "bf16" and side["ran"]["precision"] == "float32"


def test_the_presets_decoder_chunk_runs_unless_the_config_sets_one(tiny_pan2, tmp_path, writer_chunks):
    """A preset's `chunk_latent_frames` (1) is the decoder's chunk through the API; the config's (2) wins over it.
    9 frames are 3 latent frames: the first pass is 1 frame, then 4 video frames per latent frame of a chunk."""
    preset = _preset(tmp_path, "one", chunk_latent_frames=1)
    cases = (
        (RuntimeConfig(device="cpu"), 1, [1, 4, 4]),
        (RuntimeConfig(device="cpu", chunk_latent_frames=2), 2, [1, 8]),
    )
    for config, chunk, chunks in cases:
        writer_chunks.clear()
        out = tmp_path / f"chunk-{chunk}.mp4"
        VideoGenerator.from_pretrained(tiny_pan2, config=config).generate(
            "a cat", preset=preset, output=out, **SMALL
        )
        assert writer_chunks == chunks
        assert json.loads(out.with_suffix(".json").read_text())["config"]["chunk_latent_frames"] == chunk


@pytest.fixture(scope="module")
def generator(tiny_pan2):
    return VideoGenerator.from_pretrained(tiny_pan2, config=RuntimeConfig(device="cpu"))


def test_a_prompt_file_runs_through_the_api_with_the_commands_rules(generator, tmp_path):
    """`generate_file`: `NNN_<name>.mp4` and sidecars in the folder, a bad record reported (through `warn`) with its
    file and number while the others are made, `on_result` with each video as it is written; `skip_existing`
    resumes the batch; a missing output folder is the call's error."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(
        json.dumps(["a cat", {"prompt": "a dog", "seed": -1}, {"prompt": "a fox", "name": "Fox"}])
    )
    out = tmp_path / "out"
    out.mkdir()
    written, warned = [], []
    generator.warn = warned.append
    try:
        outcome = generator.generate_file(
            prompts, output=out, preset="pan2-5s", on_result=written.append, **SMALL
        )
    finally:
        generator.warn = lambda line: None
    assert sorted(p.name for p in out.iterdir()) == [
        "000_a-cat.json",
        "000_a-cat.mp4",
        "002_fox.json",
        "002_fox.mp4",
    ]
    assert [r.output for r in written] == [out / "000_a-cat.mp4", out / "002_fox.mp4"]
    assert outcome.batch and outcome.written == 2 and outcome.failed_total == 1 and outcome.skipped_total == 0
    (failure,) = outcome.failures
    assert str(failure).startswith(f"{prompts}: prompt 1") and warned == [str(failure)]
    side = json.loads((out / "002_fox.json").read_text())
    assert (side["prompts_file"], side["index"], side["name"], side["steps"]) == (str(prompts), 2, "Fox", 1)

    (out / "002_fox.mp4").unlink()
    again = generator.generate_file(prompts, output=out, preset="pan2-5s", skip_existing=True, **SMALL)
    assert again.skipped == [out / "000_a-cat.mp4"] and [r.output for r in again.results] == [
        out / "002_fox.mp4"
    ]
    with pytest.raises(InputError, match="with --prompts, -o is an existing folder"):
        generator.generate_file(prompts, output=tmp_path / "missing", **SMALL)


@pytest.mark.parametrize(
    "error, own",
    [
        (InputError("the start image went missing"), True),  # pan2's known failures: the prompt's
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (TypeError("sample() got an unexpected keyword argument"), False),  # a bug: the batch stops
        (RuntimeError("an unexpected failure"), False),
        (AssertionError("a broken invariant"), False),
    ],
    ids=["input", "out-of-memory", "type-error", "runtime-error", "assertion"],
)
def test_only_known_failures_are_a_prompts_own_a_bug_stops_the_batch(
    generator, tmp_path, monkeypatch, error, own
):
    """The first of two prompts fails while it is denoised. pan2's known failures (and torch's out of memory, said
    as pan2 says it) are that prompt's: reported, the second prompt made. Anything else is raised as it is: the
    second prompt is never denoised and nothing is written."""
    prompts = tmp_path / "two.txt"
    prompts.write_text("p one\np two\n")
    real, denoised = VideoGenerator.sample, []

    def sample(self, model, settings, *args, **kwargs):
        denoised.append(settings.prompt)
        if settings.prompt == "p one":
            raise error
        return real(self, model, settings, *args, **kwargs)

    monkeypatch.setattr(VideoGenerator, "sample", sample)
    if not own:
        with pytest.raises(type(error)) as raised:
            generator.generate_file(prompts, output=tmp_path, preset="pan2-5s", **SMALL)
        assert raised.value is error and denoised == ["p one"] and list(tmp_path.glob("*.mp4")) == []
        return
    outcome = generator.generate_file(prompts, output=tmp_path, preset="pan2-5s", **SMALL)
    assert denoised == ["p one", "p two"] and [p.name for p in tmp_path.glob("*.mp4")] == ["001_p-two.mp4"]
    (failure,) = outcome.failures
    assert outcome.failed_total == 1 and outcome.written == 1
    if isinstance(error, torch.OutOfMemoryError):
        assert str(failure).startswith("the GPU ran out of memory during denoising: CUDA out of memory")
    else:
        assert failure is error


def test_a_bug_in_a_prompts_run_stops_pan2_generate(tiny_pan2, run_cli, tmp_path, monkeypatch):
    """The command does the same: a bug is not counted as a failed prompt (no summary, no exit 1), it stops the batch
    with its traceback."""
    prompts = tmp_path / "two.txt"
    prompts.write_text("p one\np two\n")
    monkeypatch.setattr(VideoGenerator, "sample", lambda *a, **k: (_ for _ in ()).throw(TypeError("a bug")))
    with pytest.raises(TypeError, match="a bug"):
        run_cli("generate", "--prompts", prompts, "--model", tiny_pan2, *CLI_SMALL, "-o", tmp_path)
    assert list(tmp_path.glob("*.mp4")) == []
