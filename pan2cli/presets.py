"""Presets: find the shipped ones and users' `.toml` files, read them into `Preset`s (checked `GenerationSettings`), list and print them."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python < 3.11; pyproject.toml depends on tomli there
    import tomli as tomllib  # type: ignore[no-redef]

from pan2cli.config import SETTINGS_FIELDS, GenerationSettings, value_problem
from pan2cli.errors import InputError
from pan2cli.paths import looks_like_path
from pan2cli.resources import presets_dir

DEFAULT_PRESET = "pan2-10s"

_LIST_HINT = "pass a preset name from `pan2 presets list` or a path to a .toml file"


@dataclass(frozen=True, kw_only=True)
class Preset(GenerationSettings):
    """A preset file read: its `GenerationSettings` (no prompt, no image), named, with the decoder's chunk.

    Attributes:
        name: The file name without `.toml`.
        description: One line for `pan2 presets list`.
        chunk_latent_frames: Latent frames the VAE decoder takes per chunk: `pan2 generate`'s
            `RuntimeConfig.chunk_latent_frames` unless `--chunk-latent-frames` is given.
        precision: The DiT's precision, "bf16" or "fp8" (`RuntimeConfig.precision`) unless `--precision` is
            given; None (not in the file): bf16.
        source: The `.toml` file the preset was read from.

    Raises:
        InputError: On construction, when a field has the wrong type or an invalid value; the message
            names the source file, every such field and its value.
    """

    name: str
    description: str
    chunk_latent_frames: int
    source: Path
    precision: str | None = None

    def __post_init__(self) -> None:
        # `source` first: every other message names it. Accept a str so that
        # `Preset(**preset_to_dict(p))` round-trips.
        if not isinstance(self.source, (str, os.PathLike)):
            raise InputError(
                f"preset source must be a path, got {type(self.source).__name__} {self.source!r}"
            )
        object.__setattr__(self, "source", Path(self.source))
        try:
            super().__post_init__()
        except InputError as exc:
            raise InputError(f"{self.source}: {exc}", hint=_fix_hint(self.source)) from None


# A preset file's keys, in its order: the settings (but the prompt and start image) between the
# description and the decoder's chunk. The name and source come from the file itself.
FILE_KEYS = (
    "description",
    *(name for name in SETTINGS_FIELDS if name not in ("prompt", "image")),
    "chunk_latent_frames",
    "precision",
)
# Keys a preset file may leave out, and what decides when it does.
NOT_SET = {
    "flow_shift": "the checkpoint's scheduler config decides",
    "precision": "bf16 unless --precision is given",
}
OPTIONAL_KEYS = tuple(NOT_SET)


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
    unknown = sorted(set(data) - set(FILE_KEYS))
    if unknown:
        keys = ", ".join(repr(k) for k in unknown)
        problems.append(
            f"unknown key{'s' if len(unknown) > 1 else ''} {keys} (valid keys: {', '.join(FILE_KEYS)})"
        )
        hint = "the preset name is the file name" if "name" in unknown else None
    missing = [k for k in FILE_KEYS if k not in data and k not in OPTIONAL_KEYS]
    if missing:
        keys = ", ".join(repr(k) for k in missing)
        problems.append(f"missing key{'s' if len(missing) > 1 else ''} {keys}")
    bad_values = [p for k in FILE_KEYS if k in data and (p := value_problem(k, data[k])) is not None]
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


def preset_label(preset: Preset) -> str:
    """How a run records its preset (the JSON sidecar): a shipped preset by its name, a user's file by its
    absolute path; `load_preset` takes either back."""
    shipped = _shipped_files().get(preset.name)
    if shipped is not None and shipped.resolve() == preset.source.resolve():
        return preset.name
    return str(preset.source.resolve())


def preset_to_dict(preset: Preset) -> dict[str, Any]:
    """Turn a preset into plain JSON-ready values, for `pan2 presets show` and JSON sidecars.

    Args:
        preset: The preset.

    Returns:
        The name, the file keys in file order and `source` (a string); `Preset(**result)` rebuilds it.
    """
    return {
        "name": preset.name,
        **{key: getattr(preset, key) for key in FILE_KEYS},
        "source": str(preset.source),
    }


def preset_to_toml(preset: Preset) -> str:
    """The preset as a TOML file that `load_preset` reads back (`pan2 presets show NAME > my.toml`).

    Args:
        preset: The preset.

    Returns:
        Its file keys in file order; the name, source and derived values (latent frames and
        shape, duration) as comments, since a preset file may not set them.
    """
    lines = [
        f"# preset {preset.name} ({preset.source})",
        f"# {preset.frames} frames = {preset.latent_frames} latent frames, {preset.duration_s:.2f} s; "
        f"latent shape {list(preset.latent_shape)}",
    ]
    lines += [
        f"{key} = {_toml_value(getattr(preset, key))}"
        if getattr(preset, key) is not None
        else f"# {key}: not set ({NOT_SET[key]})"
        for key in FILE_KEYS
    ]
    return "\n".join(lines) + "\n"


def _toml_value(value: str | int | float) -> str:
    if isinstance(value, str):
        # A JSON string is a TOML basic string, except that TOML wants DEL escaped too.
        return json.dumps(value, ensure_ascii=False).replace("\x7f", "\\u007f")
    return repr(value)  # ints, and finite floats (validated), are TOML as Python prints them
