"""Tests of the shipped presets and of preset loading and validation errors."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest

from pan2cli.errors import InputError
from pan2cli.presets import (
    DEFAULT_PRESET,
    FILE_KEYS,
    OPTIONAL_KEYS,
    Preset,
    list_presets,
    load_preset,
    preset_to_dict,
    preset_to_toml,
)
from pan2cli.resources import presets_dir

# A valid preset file's contents; tests change one key at a time.
VALID: dict[str, Any] = {
    "description": "a test preset",
    "frames": 9,
    "height": 64,
    "width": 96,
    "fps": 24,
    "steps": 4,
    "guidance": 2.5,
    "flow_shift": 9.0,
    "seed": 7,
    "sampler": "euler",
    "negative_prompt": "",
    "chunk_latent_frames": 2,
}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return repr(value)


def write_preset(directory: Path, stem: str = "mine", drop: tuple[str, ...] = (), **changes: Any) -> Path:
    """Write a preset file from VALID with `changes` applied and the keys in `drop` left out."""
    data = {**VALID, **changes}
    lines = [f"{key} = {_toml_value(value)}" for key, value in data.items() if key not in drop]
    path = directory / f"{stem}.toml"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# ---- shipped presets ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "frames", "latent_frames", "duration_s"),
    [("pan2-5s", 121, 31, 5.0), ("pan2-10s", 241, 61, 10.0), ("pan2-20s", 481, 121, 20.0)],
)
def test_shipped_preset_values(name: str, frames: int, latent_frames: int, duration_s: float) -> None:
    preset = load_preset(name)
    assert preset.name == name
    assert preset.source == presets_dir() / f"{name}.toml"
    assert preset.frames == frames
    assert preset.latent_frames == latent_frames
    assert preset.latent_shape == (1, 48, latent_frames, 44, 78)
    assert preset.duration_s == pytest.approx(duration_s, abs=0.05)
    assert (preset.height, preset.width, preset.fps) == (704, 1248, 24)
    assert (preset.steps, preset.guidance, preset.flow_shift, preset.seed) == (50, 2.5, 9.0, 123)
    assert preset.sampler == "euler"
    assert preset.negative_prompt == ""
    assert preset.chunk_latent_frames == 4
    assert preset.description


def test_pan2_5s_latent_shape() -> None:
    preset = load_preset("pan2-5s")
    assert (preset.frames, preset.latent_frames) == (121, 31)
    assert preset.latent_shape == (1, 48, 31, 44, 78)


def test_default_preset_is_the_official_length() -> None:
    assert DEFAULT_PRESET == "pan2-10s"
    assert load_preset(DEFAULT_PRESET).frames == 241


def test_list_presets_sorted_with_numbers_in_order() -> None:
    presets = list_presets()
    assert [p.name for p in presets] == ["pan2-5s", "pan2-10s", "pan2-20s"]
    assert all(isinstance(p, Preset) for p in presets)


@pytest.mark.parametrize("name", ["pan2-5s", "pan2-10s", "pan2-20s"])
def test_preset_to_dict_round_trips(name: str) -> None:
    preset = load_preset(name)
    data = preset_to_dict(preset)
    assert list(data) == ["name", *FILE_KEYS, "source"]
    # every field of a preset but the prompt and the start image, which a preset does not give
    assert set(data) == {f.name for f in dataclasses.fields(Preset)} - {"prompt", "image"}
    assert data["source"] == str(preset.source)
    assert Preset(**data) == preset
    assert Preset(**json.loads(json.dumps(data))) == preset  # JSON sidecars hold plain values


def test_preset_is_frozen() -> None:
    preset = load_preset("pan2-5s")
    with pytest.raises(dataclasses.FrozenInstanceError):
        preset.frames = 1  # type: ignore[misc]


# ---- user files --------------------------------------------------------------------------------


def test_user_file_by_path(tmp_path: Path) -> None:
    path = write_preset(tmp_path, "my-run")
    for arg in (str(path), path):
        preset = load_preset(arg)
        assert preset.name == "my-run"
        assert preset.source == path.resolve()
        assert (preset.frames, preset.latent_frames, preset.latent_shape) == (9, 3, (1, 48, 3, 4, 6))


def test_user_file_relative_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    write_preset(tmp_path, "rel")
    monkeypatch.chdir(tmp_path)
    assert load_preset("rel.toml").source == (tmp_path / "rel.toml").resolve()


def test_integer_guidance_is_stored_as_float(tmp_path: Path) -> None:
    preset = load_preset(write_preset(tmp_path, guidance=3, flow_shift=5))
    assert preset.guidance == 3.0 and isinstance(preset.guidance, float)
    assert preset.flow_shift == 5.0 and isinstance(preset.flow_shift, float)


# ---- errors ------------------------------------------------------------------------------------


def test_unknown_name_lists_available() -> None:
    with pytest.raises(InputError, match="unknown preset 'pan2-7s'") as info:
        load_preset("pan2-7s")
    assert "pan2-5s, pan2-10s, pan2-20s" in str(info.value)
    assert info.value.hint == "pass a preset name from `pan2 presets list` or a path to a .toml file"


def test_missing_file_names_it(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(InputError, match="not found") as info:
        load_preset(str(path))
    assert str(path) in str(info.value)


def test_directory_is_not_a_preset(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="not a file") as info:
        load_preset(tmp_path)
    assert str(tmp_path) in str(info.value)


def test_invalid_toml_gives_parser_message(tmp_path: Path) -> None:
    path = tmp_path / "broken.toml"
    path.write_text("frames = = 3\n", encoding="utf-8")
    with pytest.raises(InputError, match="invalid TOML") as info:
        load_preset(path)
    assert str(path) in str(info.value)
    assert "line 1" in str(info.value)  # the parser's own message says where


def test_non_utf8_file(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes('description = "caf\xe9"\n'.encode("latin-1"))
    with pytest.raises(InputError) as info:
        load_preset(path)
    assert str(path) in str(info.value)


def test_unknown_key_names_it_and_lists_valid(tmp_path: Path) -> None:
    path = write_preset(tmp_path, guidance_scale=3.0)
    with pytest.raises(InputError, match="unknown key 'guidance_scale'") as info:
        load_preset(path)
    message = str(info.value)
    assert str(path) in message
    assert "valid keys: description, frames, height, width, fps, steps, guidance" in message


def test_name_key_is_unknown(tmp_path: Path) -> None:
    path = write_preset(tmp_path, name="x")
    with pytest.raises(InputError, match="unknown key 'name'") as info:
        load_preset(path)
    assert info.value.hint == "the preset name is the file name"


@pytest.mark.parametrize("key", [key for key in VALID if key not in OPTIONAL_KEYS])
def test_missing_key_names_it(tmp_path: Path, key: str) -> None:
    path = write_preset(tmp_path, drop=(key,))
    with pytest.raises(InputError, match=f"missing key '{key}'") as info:
        load_preset(path)
    assert str(path) in str(info.value)


def test_a_preset_without_flow_shift_leaves_it_to_the_checkpoint(tmp_path: Path) -> None:
    """A preset sets the shift only where it says so; `show` writes the key as a comment, and the
    file it prints loads back the same."""
    preset = load_preset(write_preset(tmp_path, drop=("flow_shift",)))
    assert preset.flow_shift is None and OPTIONAL_KEYS == ("flow_shift", "precision")
    text = preset_to_toml(preset)
    assert "# flow_shift: not set (the checkpoint's scheduler config decides)" in text
    (tmp_path / "again.toml").write_text(text)
    assert (
        dataclasses.replace(load_preset(tmp_path / "again.toml"), name="mine", source=preset.source) == preset
    )


@pytest.mark.parametrize(
    ("key", "value", "match"),
    [
        ("frames", 120, "must be 1 \\+ 4\\*k"),
        ("frames", 0, "must be 1 \\+ 4\\*k"),
        ("frames", -3, "must be 1 \\+ 4\\*k"),
        ("frames", 121.0, "must be an integer"),
        ("frames", "121", "must be an integer"),
        ("frames", True, "must be an integer"),
        ("height", 700, "positive multiple of 32"),
        ("height", 0, "positive multiple of 32"),
        ("width", -32, "positive multiple of 32"),
        ("width", 1248.0, "must be an integer"),
        ("fps", 0, "must be a number from 0.01 to 1000"),
        ("fps", "24", "must be a number"),
        ("steps", 0, "must be >= 1"),
        ("guidance", 0.0, "finite number > 0"),
        ("guidance", -1.0, "finite number > 0"),
        ("guidance", math.nan, "finite number > 0"),
        ("guidance", math.inf, "finite number > 0"),
        ("guidance", "2.5", "must be a number"),
        ("guidance", True, "must be a number"),
        ("flow_shift", 0.0, "finite number > 0"),
        ("seed", -1, "between 0 and 2\\*\\*64 - 1"),
        ("seed", 1.5, "must be an integer"),
        ("sampler", "ddim", "must be one of: euler"),
        ("sampler", 1, "must be a string"),
        ("description", 5, "must be a string"),
        ("negative_prompt", False, "must be a string"),
        ("chunk_latent_frames", 0, "must be >= 1"),
    ],
)
def test_invalid_value_names_field_value_and_file(tmp_path: Path, key: str, value: Any, match: str) -> None:
    path = write_preset(tmp_path, **{key: value})
    with pytest.raises(InputError, match=match) as info:
        load_preset(path)
    message = str(info.value)
    assert f"'{key}'" in message
    assert repr(value) in message
    assert str(path.resolve()) in message


def test_every_problem_of_a_file_is_reported_at_once(tmp_path: Path) -> None:
    path = write_preset(
        tmp_path, drop=("description", "seed"), latent_frames=31, frames=120, fps="24", sampler="ddim"
    )
    with pytest.raises(InputError) as info:
        load_preset(path)
    message = str(info.value)
    assert "\n" not in message
    for problem in (
        "unknown key 'latent_frames'",
        "missing keys 'description', 'seed'",
        "invalid 'frames' = 120",
        "'fps' must be a number, got str '24'",
        "invalid 'sampler' = 'ddim'",
    ):
        assert problem in message


def test_every_invalid_value_is_reported_at_once() -> None:
    data = preset_to_dict(load_preset("pan2-5s"))
    with pytest.raises(InputError) as info:
        Preset(**{**data, "height": 700, "steps": 0, "description": 5})
    message = str(info.value)
    assert (
        "'height' = 700" in message
        and "'steps' = 0" in message
        and "'description' must be a string" in message
    )


def test_seed_upper_bound() -> None:
    data = {**preset_to_dict(load_preset("pan2-5s"))}
    assert Preset(**{**data, "seed": 2**64 - 1}).seed == 2**64 - 1
    with pytest.raises(InputError, match="'seed'"):
        Preset(**{**data, "seed": 2**64})


def test_source_must_be_a_path() -> None:
    data = preset_to_dict(load_preset("pan2-5s"))
    assert Preset(**data).source == Path(data["source"])
    with pytest.raises(InputError, match="source must be a path"):
        Preset(**{**data, "source": 3})


def test_empty_name_rejected() -> None:
    data = preset_to_dict(load_preset("pan2-5s"))
    with pytest.raises(InputError, match="'name'"):
        Preset(**{**data, "name": " "})
