"""Read a JSON object from a checkpoint folder, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path

from pan2cli.errors import CheckpointError


def read_json_object(path: Path) -> dict:
    """The JSON object in `path` (a `config.json`, an `.index.json`).

    Raises:
        CheckpointError: unreadable, not JSON, or not an object.
    """
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{path} is not readable JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return raw
