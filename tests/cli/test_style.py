"""The code is formatted by ruff and passes its lint set ([tool.ruff] in pyproject.toml)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# The project's Python, named: a checkout without .git (a copied tree) has no .gitignore for ruff to honour,
# and folders beside the code there (installed packages, scratch scripts) are not the project's to format.
SOURCES = ("pan2cli", "tests", "scripts")
RUFF = shutil.which("ruff")

pytestmark = pytest.mark.skipif(
    RUFF is None, reason="ruff is not installed (pip install -e '.[test]' brings it)"
)


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]], ids=["format", "lint"])
def test_ruff(command):
    proc = subprocess.run([RUFF, *command, *SOURCES], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
