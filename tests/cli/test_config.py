"""`pan2cli.config`: the one precedence of settings (preset < flags < prompt-file record), and the checks of
`GenerationSettings` and `RuntimeConfig`; `pan2 generate` and `VideoGenerator.generate` take that precedence."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from pan2cli.config import (
    DEFAULT_CHUNK_LATENT_FRAMES,
    RULES,
    SETTINGS_FIELDS,
    GenerationSettings,
    RuntimeConfig,
    runtime_with,
    settings_with,
)
from pan2cli.errors import InputError
from pan2cli.presets import load_preset

PRESET = load_preset("pan2-5s")

# Per settings field: a preset's value (another where the shipped preset has none), a flag's, a record's.
# A field added to GenerationSettings fails every test below (and test_every_field_has_samples_and_a_rule) until it has a line here.
SAMPLES: dict[str, tuple[Any, Any, Any]] = {
    "prompt": ("", "a cat", "a dog"),
    "frames": (121, 9, 17),
    "height": (704, 64, 96),
    "width": (1248, 96, 128),
    "fps": (24, 12.0, 30),
    "steps": (50, 2, 3),
    "guidance": (2.5, 1.0, 4.0),
    "flow_shift": (9.0, 3.0, 5.0),
    "seed": (123, 1, 2),
    "sampler": ("euler", "euler", "euler"),  # the only sampler
    "negative_prompt": ("", "blurry", "dark"),
    "image": (Path("preset.png"), Path("flag.png"), Path("record.png")),
}


def _base(field: str) -> GenerationSettings:
    """The shipped preset, with this field's preset sample where the preset has another value."""
    if getattr(PRESET, field) == SAMPLES[field][0]:
        return PRESET
    return settings_with(PRESET, {field: SAMPLES[field][0]})


def test_every_field_has_samples_and_a_rule():
    assert set(SAMPLES) == set(SETTINGS_FIELDS)
    runtime_fields = {field.name for field in dataclasses.fields(RuntimeConfig)}
    assert set(SETTINGS_FIELDS) | runtime_fields <= set(RULES)


@pytest.mark.parametrize("field", SETTINGS_FIELDS)
def test_preset_then_flags_then_record(field):
    base = _base(field)
    preset_value, flag_value, record_value = SAMPLES[field]

    def value(*layers):
        settings = settings_with(base, *layers)
        assert type(settings) is GenerationSettings  # a preset's name, description, ... stay behind
        for other in SETTINGS_FIELDS:  # nothing else moves
            if other != field:
                assert getattr(settings, other) == getattr(base, other), other
        return getattr(settings, field)

    assert value() == preset_value
    assert value({}, {}) == preset_value
    assert value({field: flag_value}) == flag_value
    assert value({field: flag_value}, {}) == flag_value
    assert value({}, {field: record_value}) == record_value
    assert value({field: flag_value}, {field: record_value}) == record_value


@pytest.mark.parametrize("field", SETTINGS_FIELDS)
def test_none_never_overrides(field):
    base = _base(field)
    preset_value, flag_value, _ = SAMPLES[field]
    assert getattr(settings_with(base, {field: None}), field) == preset_value
    assert getattr(settings_with(base, {field: None}, {field: None}), field) == preset_value
    assert getattr(settings_with(base, {field: flag_value}, {field: None}), field) == flag_value


def test_duration_sets_the_frames_at_the_resulting_fps():
    assert settings_with(PRESET, {"duration": 5}).frames == 121  # the preset's 24 fps
    assert settings_with(PRESET, {"fps": 12, "duration": 5}).frames == 61
    assert settings_with(PRESET, {"duration": 5}, {"fps": 12}).frames == 61  # the fps of the result
    assert settings_with(PRESET, {"frames": 9}, {"duration": 5}).frames == 121  # a record's length wins
    assert settings_with(PRESET, {"duration": 5}, {"frames": 9}).frames == 9
    assert settings_with(PRESET, {"duration": 5}, {"duration": None}).frames == 121


def test_frames_and_duration_in_one_layer_is_an_error():
    with pytest.raises(InputError, match="--frames and --duration both set the length"):
        settings_with(PRESET, {"frames": 9, "duration": 5})


@pytest.mark.parametrize("duration", [0, -1.0, float("nan"), float("inf"), True, "5"])
def test_a_duration_must_be_a_positive_number(duration):
    with pytest.raises(InputError, match="must be a positive number of seconds"):
        settings_with(PRESET, {"duration": duration})


@pytest.mark.parametrize("fps", [float("nan"), float("inf"), 0.0, 1e-9, 0.0099, 1000.5, 1e9])
def test_a_frame_rate_an_mp4_cannot_carry_is_refused_with_the_settings(fps, tmp_path):
    """The frame rate is checked with the other settings, from flags and preset files alike, before
    anything loads: 0.01 to 1000 fps (1e-9 ran the whole generation before ffmpeg failed; 1e9 wrote a file
    stating "1001k fps")."""
    from pan2cli.presets import preset_to_toml

    with pytest.raises(InputError, match=r"invalid 'fps' = .*: must be a number from 0.01 to 1000"):
        settings_with(PRESET, {"fps": fps})
    preset = tmp_path / "fast.toml"
    preset.write_text(
        preset_to_toml(PRESET).replace("\nfps = 24\n", f"\nfps = {fps!r}\n")
    )  # nan, inf: TOML floats)
    with pytest.raises(InputError, match=rf"{preset}: invalid 'fps'"):
        load_preset(preset)
    assert (
        settings_with(PRESET, {"fps": 0.01}).fps == 0.01 and settings_with(PRESET, {"fps": 1000}).fps == 1000
    )


def test_given_settings_are_what_settings_with_applies():
    """The sidecar's overrides (`given_settings`): each value with the layer it came from, None giving nothing, a
    later layer's length (frames or duration) replacing an earlier one's."""
    from pan2cli.config import given_settings

    flags = {"frames": 9, "seed": 1, "steps": None}
    record = {"duration": 1.0, "seed": 2}
    assert given_settings(flags, record) == {"seed": (1, 2), "duration": (1, 1.0)}
    assert given_settings(flags, {"seed": None}) == {"frames": (0, 9), "seed": (0, 1)}
    settings = settings_with(PRESET, {**flags, "fps": 12.0}, record)
    assert settings.seed == 2 and settings.frames == 13  # the record's 1 s at 12 fps, not --frames 9


def test_an_unknown_setting_is_a_type_error():
    with pytest.raises(TypeError, match="shift"):
        settings_with(PRESET, {"shift": 3.0})


def test_settings_are_checked_once_on_construction_naming_every_problem():
    with pytest.raises(InputError) as info:
        settings_with(PRESET, {"frames": 6, "height": 60, "steps": True})
    message = str(info.value)
    for problem in (
        "invalid 'frames' = 6: must be 1 + 4*k",
        "invalid 'height' = 60",
        "'steps' must be an integer",
    ):
        assert problem in message
    with pytest.raises(InputError, match="'image' must be a path"):
        settings_with(PRESET, {"image": 3})
    # what to pass instead, once per rule: frames name the durations, the two sizes one size hint
    assert "--duration" in info.value.hint and info.value.hint.count("704x1248") == 1


def test_a_size_error_hints_once_for_both_sides():
    with pytest.raises(InputError) as info:
        settings_with(PRESET, {"height": 700, "width": 1240})
    assert "'height' = 700" in str(info.value) and "'width' = 1240" in str(info.value)
    assert info.value.hint.count("704x1248") == 1 and "--duration" not in info.value.hint


def test_settings_normalise_prompt_numbers_and_image():
    settings = settings_with(
        PRESET, {"prompt": "  a cat \n", "guidance": 3, "flow_shift": 5, "image": "a.png"}
    )
    assert settings.prompt == "  a cat \n"  # as given: the release encodes the prompt's whitespace too
    assert settings.guidance == 3.0 and isinstance(settings.guidance, float)
    assert settings.flow_shift == 5.0 and isinstance(settings.flow_shift, float)
    assert settings.image == Path("a.png")
    assert settings.latent_shape == (1, 48, 31, 44, 78) and settings.latent_frames == 31


def test_runtime_config_defaults_and_checks():
    config = RuntimeConfig()
    assert config.chunk_latent_frames is None and config.precision is None  # the preset's, else the defaults
    assert runtime_with(None, config).chunk_latent_frames == DEFAULT_CHUNK_LATENT_FRAMES == 4
    assert (
        config.decode_kernel,
        config.decode_kernel_parallel,
        config.dit_fused_kernels,
        config.offload,
        config.max_gpu_memory_gib,
    ) == (
        "auto",
        True,
        True,
        False,
        None,
    )
    for changes, problem in [
        ({"dtype": "fp16"}, "invalid 'dtype' = 'fp16': must be one of: bf16, fp32"),
        ({"vae_dtype": "fp16"}, "invalid 'vae_dtype'"),
        ({"decode_kernel": "on"}, "invalid 'decode_kernel' = 'on': must be one of: auto, off, require"),
        ({"chunk_latent_frames": 0}, "invalid 'chunk_latent_frames' = 0: must be >= 1"),
        ({"chunk_latent_frames": "4"}, "'chunk_latent_frames' must be an integer"),
        ({"offload": 1}, "'offload' must be True or False"),
        ({"max_gpu_memory_gib": 0}, "invalid 'max_gpu_memory_gib' = 0: must be a finite number > 0"),
        ({"max_gpu_memory_gib": "24"}, "'max_gpu_memory_gib' must be a number of GiB"),
        ({"device": 0}, "'device' must be a device name"),
    ]:
        with pytest.raises(InputError) as info:
            RuntimeConfig(**changes)
        assert problem in str(info.value), changes


def test_runtime_config_dtypes():
    import torch

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert RuntimeConfig().torch_dtype(cpu) == torch.float32
    assert RuntimeConfig().torch_dtype(cuda) == torch.bfloat16
    assert RuntimeConfig(dtype="fp32").torch_vae_dtype(cuda) == torch.float32  # the VAE follows dtype
    assert RuntimeConfig(dtype="fp32", vae_dtype="bf16").torch_vae_dtype(cpu) == torch.bfloat16


def test_a_job_needs_a_prompt():
    from pan2cli.pipeline.jobs import GenerationJob

    with pytest.raises(InputError, match="the prompt is empty"):
        GenerationJob(settings_with(PRESET, {"prompt": "  "}))


# ---- the two users of the precedence -----------------------------------------------------------


def test_pan2_generate_takes_preset_then_flags_then_record(tmp_path):
    """`plan_jobs`: a record's negative prompt, seed, image and duration beat the flags, which beat the preset."""
    from pan2cli.pipeline.batch_plan import plan_jobs

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([
        {"prompt": "a cat", "negative_prompt": "dark", "seed": 2, "image": "start.png", "duration": 1},
        {"prompt": "a dog"},
    ]))  # fmt: skip
    flags = {"negative_prompt": "blurry", "seed": 1, "frames": 9, "fps": 12.0, "steps": 2, "flow_shift": 3.0}
    jobs, failures, skipped, warnings, batch, _ = plan_jobs(None, prompts, str(tmp_path), PRESET, flags)
    assert batch and not failures and not skipped and not warnings
    record, plain = (job.settings for job in jobs)
    assert plain == settings_with(PRESET, {**flags, "prompt": "a dog"})
    assert (plain.negative_prompt, plain.seed, plain.frames, plain.image) == ("blurry", 1, 9, None)
    assert (record.negative_prompt, record.seed, record.image) == ("dark", 2, tmp_path / "start.png")
    assert record.frames == 13  # the record's 1 s at the flags' 12 fps, not --frames 9
    assert (record.steps, record.flow_shift, record.height) == (2, 3.0, PRESET.height)
    # The sidecar's overrides: what each video's settings took over the preset, and from where (the record's
    # too, which were once missing); the record's duration replaced --frames, which is not there.
    flag = {name: {"value": flags[name], "from": f"--{name.replace('_', '-')}"} for name in flags}
    from_record = {
        "seed": 2,
        "negative_prompt": "dark",
        "image": str(tmp_path / "start.png"),
        "duration": 1.0,
    }
    assert jobs[0].metadata["overrides"] == {
        **{name: value for name, value in flag.items() if name != "frames"},
        **{name: {"value": value, "from": "record"} for name, value in from_record.items()},
    }
    assert jobs[1].metadata["overrides"] == flag
    assert jobs[0].metadata["prompts_file"] == str(prompts) and jobs[0].metadata["index"] == 0

    (single,), *_ = plan_jobs("a fox", None, str(tmp_path / "fox.mp4"), PRESET, flags)
    assert single.settings == settings_with(PRESET, {**flags, "prompt": "a fox"})


def test_a_bad_record_is_its_own_failure_a_bad_flag_the_commands(tmp_path):
    """A record that cannot run is a failure of its own, naming the file and the record, and the other
    records are still jobs; a bad flag is every record's problem: the command's error, naming the flag's value."""
    from pan2cli.pipeline.batch_plan import plan_jobs

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps([{"prompt": "a cat", "seed": -1}, {"prompt": "a dog", "duration": 1}]))
    jobs, failures, *_ = plan_jobs(None, prompts, str(tmp_path), PRESET, {})
    assert [job.settings.prompt for job in jobs] == ["a dog"]
    assert jobs[0].origin == f"{prompts}: prompt 1 (001_a-dog)"
    (failure,) = failures
    assert str(failure).startswith(f"{prompts}: prompt 0: 'seed' must be a whole number")
    with pytest.raises(InputError, match=r"^invalid 'height' = 60"):
        plan_jobs(None, prompts, str(tmp_path), PRESET, {"height": 60})


def test_video_generator_takes_preset_then_arguments(monkeypatch):
    from pan2cli.pipeline.generator import VideoGenerator
    from pan2cli.scheduler import SchedulerConfig

    components = SimpleNamespace(transformer_arguments={}, scheduler=SchedulerConfig())
    generator = VideoGenerator(components, RuntimeConfig(device="cpu"))
    seen, presets = [], []

    def generate_batch(jobs, preset=None):
        seen.extend(jobs)
        presets.append(preset)  # its run-time keys run where the config leaves them (`runtime_with`)
        return [SimpleNamespace(error=None, job=job) for job in jobs]

    monkeypatch.setattr(generator, "generate_batch", generate_batch)
    generator.generate("a cat", preset="pan2-5s", steps=2, seed=None, duration=1, fps=12.0)
    (job,) = seen
    assert presets == [PRESET]
    assert job.settings == settings_with(PRESET, {"prompt": "a cat", "steps": 2, "duration": 1, "fps": 12.0})
    assert job.settings.seed == PRESET.seed and job.metadata == {"preset": "pan2-5s"}
    # A user's preset file is recorded by its absolute path (its stem is no preset `--preset` knows)
    generator.generate("a cat", preset=dataclasses.replace(PRESET, source=Path("my.toml")))
    assert seen[-1].metadata == {"preset": str(Path("my.toml").resolve())}
    generator.generate("a cat", preset=PRESET.source)  # the shipped file, by its path: the shipped preset
    assert seen[-1].metadata == {"preset": "pan2-5s"}
    with pytest.raises(InputError, match="the prompt is empty"):
        generator.generate(" ", preset=PRESET)
