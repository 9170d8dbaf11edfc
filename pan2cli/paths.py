"""Paths: where pan2 keeps its own files (`PAN2_CACHE_DIR` overrides), and whether a value names a path or a hub repo."""

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


def looks_like_path(spec: str, *, file_suffixes: tuple[str, ...] = (), repo_ids: bool = True) -> bool:
    """Whether a spec that names no existing file or folder is a (missing) path rather than a name.

    Args:
        spec: what the user passed (`--model`, `--vae`, `--preset`, ...).
        file_suffixes: endings that make a path whatever the rest (`.safetensors`, `.toml`, ...).
        repo_ids: the names are hub repo ids `owner/name`: anything else (a leading `/`, `.` or `~`,
            no slash or more than one) is a path. False: the names are plain words (preset names):
            any path separator, or an existing file of that name, makes a path.
    """
    if spec.endswith(file_suffixes):
        return True
    if repo_ids:
        return spec.startswith(("/", "./", "../", "~", ".")) or spec.count("/") != 1
    return "/" in spec or os.sep in spec or Path(spec).is_file()
