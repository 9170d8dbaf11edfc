"""Where pan2 keeps its own files: the user cache directory (`PAN2_CACHE_DIR` overrides)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """`$PAN2_CACHE_DIR`, else `$XDG_CACHE_HOME/pan2`, else `~/.cache/pan2` (not created here)."""
    override = os.environ.get("PAN2_CACHE_DIR")
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "pan2"
