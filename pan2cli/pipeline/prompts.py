"""Prompt files for batches: JSON records (PAN 2's own format included) or plain text, one prompt per line.

JSON: a list of records, or `{"prompts": [...]}`; a record is a string or an object with `prompt` and
optional `negative_prompt` (text, or a structured object rendered to text), `duration` (seconds),
`image` (a start image; relative paths are relative to the prompt file), `seed` and `name`. Unknown
fields are reported (warnings) and ignored. Plain text: one prompt per line; blank lines and lines
starting with `#` are skipped.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pan2cli.constants import valid_seed
from pan2cli.errors import InputError

RECORD_FIELDS = ("prompt", "negative_prompt", "duration", "image", "seed", "name")
_SLUG_CHARS = 48


@dataclass(frozen=True)
class PromptRecord:
    """One video to generate from a prompt file; None fields take the command line's (or the preset's) value."""

    index: int
    prompt: str
    stem: str  # the output file name without suffix: index and slug (or name)
    negative_prompt: str | None = None
    duration: float | None = None
    image: Path | None = None
    seed: int | None = None
    name: str | None = None

    def settings(self) -> dict[str, Any]:
        """The settings this record gives, None where it gives none: the last layer of `settings_with`."""
        return {name: getattr(self, name) for name in RECORD_FIELDS if name != "name"}


def slugify(text: str, limit: int = _SLUG_CHARS) -> str:
    """Lower-case letters, digits and single dashes: `"A cat, jumping!"` → `"a-cat-jumping"` (at most `limit` characters)."""
    slug = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    return slug[:limit].rstrip("-") or "video"


def render_negative(value: Any) -> str:
    """A negative prompt as text: strings as they are, lists joined by ", ", objects as `key: value; ...`."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return "; ".join(
            f"{key}: {render_negative(item)}" for key, item in value.items() if render_negative(item)
        )
    if isinstance(value, (list, tuple)):
        return ", ".join(text for text in (render_negative(item) for item in value) if text)
    if value is None:
        return ""
    return str(value)


def _record(raw: Any, index: int, source: Path, warnings: list[str]) -> dict[str, Any]:
    where = f"{source}: prompt {index}"
    if isinstance(raw, str):
        raw = {"prompt": raw}
    if not isinstance(raw, dict):
        raise InputError(f"{where} is a {type(raw).__name__}; expected a string or an object with 'prompt'")
    unknown = sorted(set(raw) - set(RECORD_FIELDS))
    if unknown:
        warnings.append(
            f"{where}: ignoring unknown field(s) {', '.join(unknown)} (known: {', '.join(RECORD_FIELDS)})"
        )
    prompt = raw.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError(f"{where} has no 'prompt' text")
    out: dict[str, Any] = {"prompt": prompt.strip()}
    if raw.get("negative_prompt") is not None:
        out["negative_prompt"] = render_negative(raw["negative_prompt"])
    duration = raw.get("duration")
    if duration is not None:
        if (
            isinstance(duration, bool)
            or not isinstance(duration, (int, float))
            or not math.isfinite(duration)
            or duration <= 0
        ):
            raise InputError(f"{where}: 'duration' must be a positive number of seconds, got {duration!r}")
        out["duration"] = float(duration)
    seed = raw.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or not valid_seed(seed):
            raise InputError(f"{where}: 'seed' must be a whole number from 0 to 2**64 - 1, got {seed!r}")
        out["seed"] = seed
    image = raw.get("image")
    if image is not None:
        if not isinstance(image, str) or not image:
            raise InputError(f"{where}: 'image' must be a path, got {image!r}")
        path = Path(image).expanduser()
        out["image"] = path if path.is_absolute() else source.parent / path
    name = raw.get("name")
    if name is not None:
        if not isinstance(name, str) or not slugify(name, 10**6).strip():
            raise InputError(f"{where}: 'name' must be text with letters or digits, got {name!r}")
        out["name"] = name
    return out


def read_prompt_file(path: str | Path) -> tuple[list[PromptRecord], list[str]]:
    """Read a prompt file.

    Args:
        path: `.json` (or any file starting with `[` / `{`) or plain text.

    Returns:
        `(records, warnings)`: records in file order with their output stems
        (`000_a-cat-jumps`, or `000_<name>`), and one line per ignored field.

    Raises:
        InputError: unreadable file, bad JSON, a record without prompt, a bad field value, no prompts,
            or two records with the same output name.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"--prompts {path} could not be read: {exc}") from exc
    warnings: list[str] = []
    if path.suffix.lower() == ".json" or text.lstrip().startswith(("[", "{")):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise InputError(f"--prompts {path} is not valid JSON: {exc}") from exc
        if isinstance(data, dict):
            if "prompts" not in data:
                raise InputError(
                    f"--prompts {path} is a JSON object without 'prompts'",
                    hint='use a list of records, or {"prompts": [...]}',
                )
            data = data["prompts"]
        if not isinstance(data, list):
            raise InputError(f"--prompts {path}: expected a list of prompt records")
        raws = [_record(item, i, path, warnings) for i, item in enumerate(data)]
    else:
        lines = [line.strip() for line in text.splitlines()]
        raws = [{"prompt": line} for line in lines if line and not line.startswith("#")]
    if not raws:
        raise InputError(f"--prompts {path} holds no prompts")
    width = max(3, len(str(len(raws) - 1)))
    records = []
    seen: dict[str, int] = {}
    for i, raw in enumerate(raws):
        stem = f"{i:0{width}d}_{slugify(raw.get('name') or raw['prompt'])}"
        if stem in seen:
            raise InputError(
                f"--prompts {path}: prompts {seen[stem]} and {i} would both be written as {stem}"
            )
        seen[stem] = i
        records.append(PromptRecord(index=i, stem=stem, **raw))
    return records, warnings


def shard(records: list[PromptRecord], rank: int, world: int) -> list[PromptRecord]:
    """The records of one rank when `world` ranks share a batch: every `world`-th, starting at `rank`."""
    return records[rank::world]
