"""Prompt files for batches: JSON (PAN 2's own format included), JSON Lines or plain text, one record per video.

The format: a `.jsonl` (or `.ndjson`) file is JSON Lines; a `.json` file, or one whose text starts with `[` or
`{`, is JSON, or JSON Lines when it holds several JSON values, one per line; anything else is plain text.
- JSON: a list of records, or `{"prompts": [...]}`.
- JSON Lines: one record per line; blank lines are skipped.
- A record is a string or an object with `prompt` and optional `negative_prompt` (text, or a structured
  object rendered to text), `duration` (seconds), `image` (a start image; relative paths are relative to the
  prompt file), `seed`, `name` and `continue`. Unknown fields are reported (warnings) and ignored.
- Plain text: one prompt per line; blank lines and lines starting with `#` are skipped.
- Rounds: a record with `"continue": true` (in plain text, a line starting with `+`, the prompt after it and one
  space) continues the record before it: it starts from the last frame that record's video ends on. Records that
  continue each other form a chain, made in order by one process (`chains`, `shard`); the first record of a file
  continues nothing (an error).
The text is UTF-8, or what a byte-order mark says (UTF-8, UTF-16, UTF-32: Windows tools write one), the mark dropped.
Records are numbered from 0 in file order, the number starting their output names (`003_a-cat.mp4`). A
record that cannot be used (not valid JSON on its line, another type, no prompt, a bad value) comes back with
its `problem`, so that the batch reports it with the file and record number and makes the others.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import math
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pan2cli.constants import valid_seed
from pan2cli.errors import InputError

RECORD_FIELDS = ("prompt", "negative_prompt", "duration", "image", "seed", "name")
CONTINUE_FIELD = "continue"  # not a setting: the record continues the one before it (a round of a chain)
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
    problem: InputError | None = (
        None  # what makes the record unusable (it names the file and record), or None
    )
    continues: bool = False  # a round that starts from the last frame of the record before it

    def settings(self) -> dict[str, Any]:
        """The settings this record gives, None where it gives none: the last layer of `settings_with`."""
        return {name: getattr(self, name) for name in RECORD_FIELDS if name != "name"}


def _slug(text: str) -> str:
    """Letters and digits of any script, lower-cased, everything between them one dash: `"A cat, jumping!"` →
    `"a-cat-jumping"`, `"日本語の猫"` → `"日本語の猫"`, `"!!!"` → `""`. NFKC first, so that one text gives one name
    whichever way its accents were typed (composed or not)."""
    text = unicodedata.normalize("NFKC", text).lower()
    kept = "".join(c if unicodedata.category(c)[0] in "LNM" else "-" for c in text)  # letters, numbers, marks
    return re.sub(r"-+", "-", kept).strip("-")


def slugify(text: str, limit: int = _SLUG_CHARS) -> str:
    """A file name for `text`, at most `limit` characters: its slug (`_slug`), kept as it is when it fits; a
    slug that is empty (`"!!!"`) or cut to fit ends in 8 hex digits of the text's SHA-256 (`"video-1f0c..."`),
    so that different texts get different default names."""
    slug = _slug(text)
    if slug and len(slug) <= limit:
        return slug
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]
    return f"{slug[: limit - len(digest) - 1].rstrip('-') or 'video'}-{digest}"


_JSON_KINDS = {bool: "a boolean", int: "an integer", float: "a number", list: "a list", type(None): "null"}


def _json_kind(value: Any) -> str:
    """What a JSON value is, in words: `an integer (5)`, `a list`, `null`."""
    kind = _JSON_KINDS.get(type(value), type(value).__name__)
    return f"{kind} ({value!r})" if isinstance(value, (bool, int, float)) else kind


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


def _record(raw: Any, where: str, source: Path, warnings: list[str]) -> dict[str, Any]:
    """A record's fields (`where` starts every message: `prompts.json: prompt 3`).

    Raises:
        InputError: another type, no prompt text, or a field of the wrong type or value.
    """
    if isinstance(raw, str):
        raw = {"prompt": raw}
    if not isinstance(raw, dict):
        raise InputError(f"{where} is {_json_kind(raw)}; expected a string or an object with 'prompt'")
    known = (*RECORD_FIELDS, CONTINUE_FIELD)
    unknown = sorted(set(raw) - set(known))
    if unknown:
        warnings.append(
            f"{where}: ignoring unknown field(s) {', '.join(unknown)} (known: {', '.join(known)})"
        )
    prompt = raw.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise InputError(f"{where} has no 'prompt' text")
    if not isinstance(raw.get(CONTINUE_FIELD, False), bool):
        raise InputError(f"{where}: 'continue' must be true or false, got {raw[CONTINUE_FIELD]!r}")
    if raw.get(CONTINUE_FIELD) and raw.get("image") is not None:
        raise InputError(
            f"{where} continues the record before it, so it starts from that video's last frame: it takes no 'image'",
            hint="drop its 'image', or its 'continue' to start a new chain from the image",
        )
    out: dict[str, Any] = {"prompt": prompt}  # as given: the text encoder sees its whitespace too
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
        if not isinstance(name, str) or not _slug(name):
            raise InputError(f"{where}: 'name' must be text with letters or digits, got {name!r}")
        out["name"] = name
    return out


def read_prompt_file(path: str | Path) -> tuple[list[PromptRecord], list[str]]:
    """Read a prompt file (the module docstring says how its format is chosen).

    Args:
        path: a JSON, JSON Lines or plain-text file.

    Returns:
        `(records, warnings)`: records in file order with their output stems (`000_a-cat-jumps`, or
        `000_<name>`), a record that cannot be used with its `problem` set; one line per ignored field.

    Raises:
        InputError: unreadable file, JSON that is none (or not a list of records), or no prompts.
    """
    path = Path(path)
    text = read_prompt_text(path)
    warnings: list[str] = []
    if _is_json_lines(path, text):
        items = _json_lines(path, text)
    elif path.suffix.lower() == ".json" or text.lstrip().startswith(("[", "{")):
        items = [(f"{path}: prompt {i}", item) for i, item in enumerate(_json_records(path, text))]
    else:
        items = _text_lines(path, text)
    if not items:
        raise InputError(f"--prompts {path} holds no prompts")
    width = max(3, len(str(len(items) - 1)))
    records = []
    for i, (where, item) in enumerate(items):
        raw = _checked_record(item, where, path, warnings)
        # Whether it continues the record before it is read even from a record that cannot run: its chain stops.
        continues = isinstance(item, dict) and item.get(CONTINUE_FIELD) is True
        if isinstance(raw, InputError):
            records.append(
                PromptRecord(index=i, prompt="", stem=f"{i:0{width}d}", problem=raw, continues=continues)
            )
        else:  # the number makes every stem distinct
            stem = f"{i:0{width}d}_{slugify(raw.get('name') or raw['prompt'])}"
            records.append(PromptRecord(index=i, stem=stem, continues=continues, **raw))
    if records[0].continues:
        raise InputError(
            f"--prompts {path}: prompt 0 continues the record before it, and there is none",
            hint="the first record starts a chain: drop its \"continue\" (or the '+' of its line); to continue "
            "a video made before, pass --continue-from VIDEO",
        )
    return records, warnings


def _text_lines(path: Path, text: str) -> list[tuple[str, Any]]:
    """(where, record) of each prompt line of a plain-text file: the line as written (without its line break), as
    the text encoder will see it; a line starting with `+` continues the prompt before it (the prompt after the
    `+` and one space)."""
    items = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        where = f"{path}: prompt {len(items)} (line {number})"
        after = line.lstrip()[1:]
        if line.lstrip().startswith("+"):
            items.append(
                (where, {"prompt": after[1:] if after.startswith(" ") else after, CONTINUE_FIELD: True})
            )
        else:
            items.append((where, {"prompt": line}))
    return items


# Byte-order marks that Windows tools write, longest first (UTF-32 LE's starts with UTF-16 LE's), and the codec
# that reads the text after them.
_BOMS = (
    (codecs.BOM_UTF32_LE, "utf-32-le"),
    (codecs.BOM_UTF32_BE, "utf-32-be"),
    (codecs.BOM_UTF8, "utf-8"),
    (codecs.BOM_UTF16_LE, "utf-16-le"),
    (codecs.BOM_UTF16_BE, "utf-16-be"),
)
_SAVE_AS_UTF8 = "save it as UTF-8 text (one prompt per line, JSON or JSON Lines)"


def read_prompt_text(path: Path) -> str:
    """A prompt file's text: UTF-8, or UTF-8, UTF-16 or UTF-32 after a byte-order mark (the mark itself dropped, so
    that it is neither a JSON error nor the first prompt's first character).

    Raises:
        InputError: the file cannot be read, holds a NUL byte without a UTF-16/32 mark (a binary file), or is not
            text in its encoding; the message names the byte offset and the hint says to save it as UTF-8.
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise InputError(f"--prompts {path} could not be read: {exc.strerror or exc}") from exc
    encoding, start = "utf-8", 0
    for bom, codec in _BOMS:
        if data.startswith(bom):
            encoding, start = codec, len(bom)
            break
    if encoding == "utf-8" and (nul := data.find(b"\0")) >= 0:
        raise InputError(
            f"--prompts {path} is not a text file: it holds a NUL byte at offset {nul}", hint=_SAVE_AS_UTF8
        )
    try:
        return data[start:].decode(encoding)
    except UnicodeDecodeError as exc:
        marked = " (as its byte-order mark says)" if start else ""
        raise InputError(
            f"--prompts {path} is not {encoding.upper()} text{marked}: byte 0x{data[start + exc.start]:02x} at "
            f"offset {start + exc.start} cannot be decoded",
            hint=_SAVE_AS_UTF8,
        ) from None


def _is_json_lines(path: Path, text: str) -> bool:
    """JSON Lines: by its suffix, or JSON text that holds several values (json's "Extra data" after the first)."""
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        return True
    if path.suffix.lower() != ".json" and not text.lstrip().startswith(("[", "{")):
        return False
    try:
        json.loads(text)
    except json.JSONDecodeError as exc:
        return exc.msg == "Extra data" and "\n" in text[: exc.pos]
    return False


def _json_lines(path: Path, text: str) -> list[tuple[str, Any]]:
    """(where, value) of each non-blank line (`prompts.jsonl: prompt 2 (line 4)`), the value an InputError for a
    line that is not one JSON value."""
    items = []
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            where = f"{path}: prompt {len(items)} (line {number})"
            try:
                items.append((where, json.loads(line)))
            except json.JSONDecodeError as exc:
                items.append((where, InputError(f"{where} is not valid JSON: {exc}")))
    return items


def _json_records(path: Path, text: str) -> list[Any]:
    """The records of a JSON file: its list, or the `prompts` list of its object."""
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InputError(
            f"--prompts {path} is not valid JSON: {exc}",
            hint='a list of records, {"prompts": [...]}, or one record per line in a .jsonl file',
        ) from exc
    if isinstance(data, dict):
        if "prompts" not in data:
            raise InputError(
                f"--prompts {path} is a JSON object without 'prompts'",
                hint='use a list of records, {"prompts": [...]}, or one record per line in a .jsonl file',
            )
        data = data["prompts"]
    if not isinstance(data, list):
        raise InputError(f"--prompts {path}: expected a list of prompt records, got {_json_kind(data)}")
    return data


def _checked_record(raw: Any, where: str, source: Path, warnings: list[str]) -> dict[str, Any] | InputError:
    """`_record`'s fields, or its InputError (a line that is no JSON comes as one): one bad record does not stop
    the others."""
    if isinstance(raw, InputError):
        return raw
    try:
        return _record(raw, where, source, warnings)
    except InputError as exc:
        return exc


def chains(records: list[PromptRecord]) -> list[list[PromptRecord]]:
    """The records grouped in chains, in file order: each record that continues the one before it joins its chain
    (a record that continues nothing is a chain of one)."""
    groups: list[list[PromptRecord]] = []
    for record in records:
        if record.continues and groups:
            groups[-1].append(record)
        else:
            groups.append([record])
    return groups


def shard(records: list[PromptRecord], rank: int, world: int) -> list[PromptRecord]:
    """The records of one rank when `world` ranks share a batch: every `world`-th chain, starting at `rank`. A chain's
    rounds wait for each other, so they stay together, on one rank, in order (a file without chains: every
    `world`-th record)."""
    return [record for chain in chains(records)[rank::world] for record in chain]
