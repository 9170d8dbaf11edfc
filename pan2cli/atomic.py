"""Write a file under a temporary name in its folder, then rename it: no half-written file is ever left."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


def replace_into(path: Path, write: Callable[[Path], object]) -> None:
    """Call `write(tmp)` for a temporary path beside `path`, then `os.replace` it into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
