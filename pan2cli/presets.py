"""Generation presets: load, validate and list the `.toml` run settings (frames, size, steps, ...)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11; pyproject.toml depends on tomli there
    import tomli as tomllib  # type: ignore[no-redef]

from pan2cli.constants import SIZE_MULTIPLE, latent_frames, latent_shape, valid_frames, valid_seed, valid_size
from pan2cli.errors import InputError
from pan2cli.paths import looks_like_path
from pan2cli.resources import presets_dir

DEFAULT_PRESET = "pan2-10s"

SAMPLERS = ("euler",)

_LIST_HINT = "pass a preset name from `pan2 presets list` or a path to a .toml file"


@dataclass(frozen=True, kw_only=True)
class Preset:
    """One validated set of generation settings.

    Attributes:
        name: Preset name: the file name without `.toml`.
        description: One line for `pan2 presets list`.
        frames: Video frames; 1 + 4 * (latent frames - 1), as the Wan2.2 VAE requires.
        height: Video height in pixels, a multiple of 32.
        width: Video width in pixels, a multiple of 32.
        fps: Frames per second of the written video.
        steps: Denoising steps.
        guidance: Classifier-free guidance scale.
        flow_shift: Timestep shift of the flow-matching schedule.
        seed: Random seed, 0 <= seed < 2**64.
        sampler: Sampler name, one of `SAMPLERS`.
        negative_prompt: Negative prompt for classifier-free guidance ("" for none).
        chunk_latent_frames: Latent frames the VAE decoder takes per chunk.
        source: The `.toml` file the preset was read from.

    Raises:
        InputError: On construction, when a field has the wrong type or an invalid value; the
            message names the source file, the field and the value.
    """

    name: str
    description: str
    frames: int
    height: int
    width: int
    fps: int
    steps: int
    guidance: float
    flow_shift: float
    seed: int
    sampler: str
    negative_prompt: str
    chunk_latent_frames: int
    source: Path

    def __post_init__(self) -> None:
        # `source` first: every other message names it. Accept a str so that
        # `Preset(**preset_to_dict(p))` round-trips.
        if isinstance(self.source, (str, os.PathLike)):
            object.__setattr__(self, "source", Path(self.source))
        else:
            raise InputError(
                f"preset source must be a path, got {type(self.source).__name__} {self.source!r}"
            )
        problems = [
            problem for name in _RULES if (problem := _value_problem(name, getattr(self, name))) is not None
        ]
        if problems:
            raise InputError(f"{self.source}: {'; '.join(problems)}", hint=_fix_hint(self.source))
        for name in ("guidance", "flow_shift"):
            # Store floats even when the file says `guidance = 3`, so dumps are consistent.
            object.__setattr__(self, name, float(getattr(self, name)))

    @property
    def latent_frames(self) -> int:
        """Latent frames the VAE decodes into `frames` video frames."""
        return latent_frames(self.frames)

    @property
    def duration_s(self) -> float:
        """Video length in seconds (`frames / fps`; 121 frames at 24 fps is 5.04 s)."""
        return self.frames / self.fps

    @property
    def latent_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of the Wan2.2 VAE latent (batch, channels, frames, height, width)."""
        return latent_shape(self.frames, self.height, self.width)


# Each field: its type(s), what that is called, and the requirement on its value (None: any value).
# bool is a subclass of int, but `frames = true` is a mistake, not 1: bools never pass.
_RULES: dict[str, tuple[type | tuple[type, ...], str, Any, str]] = {
    "name": (str, "a string", lambda v: bool(v.strip()), "must not be empty"),
    "description": (str, "a string", None, ""),
    "frames": (
        int,
        "an integer",
        valid_frames,
        "must be 1 + 4*k (e.g. 121, 241, 481): the Wan2.2 VAE decodes 1 + 4*(latent frames - 1) frames",
    ),
    "height": (int, "an integer", valid_size, f"must be a positive multiple of {SIZE_MULTIPLE}"),
    "width": (int, "an integer", valid_size, f"must be a positive multiple of {SIZE_MULTIPLE}"),
    "fps": (int, "an integer", lambda v: v > 0, "must be > 0"),
    "steps": (int, "an integer", lambda v: v >= 1, "must be >= 1"),
    "guidance": (
        (int, float),
        "a number",
        lambda v: math.isfinite(v) and v > 0,
        "must be a finite number > 0",
    ),
    "flow_shift": (
        (int, float),
        "a number",
        lambda v: math.isfinite(v) and v > 0,
        "must be a finite number > 0",
    ),
    "seed": (int, "an integer", valid_seed, "must be between 0 and 2**64 - 1"),
    "sampler": (str, "a string", lambda v: v in SAMPLERS, f"must be one of: {', '.join(SAMPLERS)}"),
    "negative_prompt": (str, "a string", None, ""),
    "chunk_latent_frames": (int, "an integer", lambda v: v >= 1, "must be >= 1"),
}


def _value_problem(name: str, value: Any) -> str | None:
    """What is wrong with `value` for field `name` (its type first, then its value), or None."""
    types, what, ok, requirement = _RULES[name]
    if isinstance(value, bool) or not isinstance(value, types):
        return f"'{name}' must be {what}, got {type(value).__name__} {value!r}"
    if ok is not None and not ok(value):
        return f"invalid '{name}' = {value!r}: {requirement}"
    return None


# Keys a preset file must contain: every field except those that come from the file itself.
_FILE_KEYS = tuple(f.name for f in dataclasses.fields(Preset) if f.name not in ("name", "source"))


def _fix_hint(source: Path) -> str:
    return f"fix the value in {source}, or {_LIST_HINT}"


def _natural_key(name: str) -> list[Any]:
    """Sort key that puts `pan2-5s` before `pan2-10s`."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def _shipped_files() -> dict[str, Path]:
    """Map each shipped preset name to its file, in name order."""
    files = {path.stem: path for path in presets_dir().glob("*.toml") if path.is_file()}
    return {name: files[name] for name in sorted(files, key=_natural_key)}


def _load_file(path: Path, name: str) -> Preset:
    """Read and validate one preset file.

    Args:
        path: The `.toml` file.
        name: The preset's name.

    Returns:
        The validated preset.

    Raises:
        InputError: The file is missing, unreadable, not TOML, has unknown or missing keys, or
            an invalid value; the message names the file.
    """
    if not path.exists():
        raise InputError(f"preset file {path} not found", hint=_LIST_HINT)
    if not path.is_file():
        raise InputError(f"preset file {path} is not a file", hint=_LIST_HINT)
    try:
        with path.open("rb") as f:
            data = tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise InputError(f"{path}: invalid TOML: {e}") from e
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not a UTF-8 text file: {e}") from e
    except OSError as e:
        raise InputError(f"cannot read preset file {path}: {e.strerror or e}") from e

    # Every problem of the file in one error: unknown keys, missing keys, then bad values.
    problems, hint = [], None
    unknown = sorted(set(data) - set(_FILE_KEYS))
    if unknown:
        keys = ", ".join(repr(k) for k in unknown)
        problems.append(
            f"unknown key{'s' if len(unknown) > 1 else ''} {keys} (valid keys: {', '.join(_FILE_KEYS)})"
        )
        hint = "the preset name is the file name" if "name" in unknown else None
    missing = [k for k in _FILE_KEYS if k not in data]
    if missing:
        keys = ", ".join(repr(k) for k in missing)
        problems.append(f"missing key{'s' if len(missing) > 1 else ''} {keys}")
    bad_values = [p for k in _FILE_KEYS if k in data and (p := _value_problem(k, data[k])) is not None]
    if bad_values:
        problems += bad_values
        hint = hint or _fix_hint(path)
    if problems:
        raise InputError(f"{path}: {'; '.join(problems)}", hint=hint)
    return Preset(name=name, source=path, **data)


def list_presets() -> list[Preset]:
    """Load every preset shipped with pan2cli.

    Returns:
        The shipped presets, sorted by name with numbers in numeric order (pan2-5s, pan2-10s, ...).

    Raises:
        InputError: A shipped preset file is invalid (a packaging bug).
        RuntimeError: The presets directory is missing (a broken install).
    """
    return [_load_file(path, name) for name, path in _shipped_files().items()]


def load_preset(name_or_path: str | os.PathLike[str]) -> Preset:
    """Load a shipped preset by name, or a user's preset file by path.

    A shipped name wins over a file of the same name in the working directory; anything ending
    in `.toml`, containing a path separator, or naming an existing file is read as a path.

    Args:
        name_or_path: A shipped preset name such as `pan2-10s`, or a path to a `.toml` file
            (its name becomes the preset's name).

    Returns:
        The validated preset.

    Raises:
        InputError: Unknown name, missing or unreadable file, invalid TOML, unknown or missing
            key, or an invalid value.
        RuntimeError: The presets directory is missing (a broken install).
    """
    text = os.fspath(name_or_path)
    shipped = _shipped_files()
    if isinstance(name_or_path, str) and text in shipped:
        return _load_file(shipped[text], text)
    if not isinstance(name_or_path, str) or looks_like_path(text, file_suffixes=(".toml",), repo_ids=False):
        path = Path(text).expanduser().resolve()
        return _load_file(path, path.stem)
    raise InputError(
        f"unknown preset {text!r}: not a preset in {presets_dir()} nor a .toml file; "
        f"available presets: {', '.join(shipped) or '(none)'}",
        hint=_LIST_HINT,
    )


def preset_to_dict(preset: Preset) -> dict[str, Any]:
    """Turn a preset into plain JSON-ready values, for `pan2 presets show` and JSON sidecars.

    Args:
        preset: The preset.

    Returns:
        Every field in declaration order, `source` as a string; `Preset(**result)` rebuilds it.
    """
    result = {f.name: getattr(preset, f.name) for f in dataclasses.fields(preset)}
    result["source"] = str(preset.source)
    return result


def preset_to_toml(preset: Preset) -> str:
    """The preset as a TOML file that `load_preset` reads back (`pan2 presets show NAME > my.toml`).

    Args:
        preset: The preset.

    Returns:
        Its file keys in declaration order; the name, source and derived values (latent frames and
        shape, duration) as comments, since a preset file may not set them.
    """
    lines = [
        f"# preset {preset.name} ({preset.source})",
        f"# {preset.frames} frames = {preset.latent_frames} latent frames, {preset.duration_s:.2f} s; "
        f"latent shape {list(preset.latent_shape)}",
    ]
    lines += [f"{key} = {_toml_value(getattr(preset, key))}" for key in _FILE_KEYS]
    return "\n".join(lines) + "\n"


def _toml_value(value: str | int | float) -> str:
    if isinstance(value, str):
        # A JSON string is a TOML basic string, except that TOML wants DEL escaped too.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    return repr(value)  # ints, and finite floats (validated), are TOML as Python prints them
