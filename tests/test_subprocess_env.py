"""Child processes of the tests keep the caller's PYTHONPATH (`tests/subprocess_env.py`), and no test builds its own."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.subprocess_env import REPO, python_env

# Where a child found the caller's package and pan2cli (None: not importable).
_PROBE = """
import importlib.util, json
found = {name: getattr(importlib.util.find_spec(name), "origin", None) for name in ("callers_package", "pan2cli")}
print(json.dumps(found))
"""


def _found_in_child(env: dict[str, str], cwd: Path) -> dict:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], env=env, cwd=cwd, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_child_keeps_the_callers_pythonpath_behind_the_project(tmp_path, monkeypatch):
    """With the caller's packages on PYTHONPATH (given relative to its working folder), a child
    started elsewhere still imports them, and pan2cli from the checkout; a hook folder goes first."""
    packages = tmp_path / "packages"
    packages.mkdir()
    (packages / "callers_package.py").write_text("")
    (packages / "pan2cli").mkdir()  # a stale copy on the caller's path: the project must come first
    (packages / "pan2cli" / "__init__.py").write_text("")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", "packages")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    hook = tmp_path / "hook"
    hook.mkdir()

    found = _found_in_child(python_env(hook), elsewhere)
    assert found == {
        "callers_package": str(packages / "callers_package.py"),
        "pan2cli": str(REPO / "pan2cli" / "__init__.py"),
    }
    assert python_env(hook)["PYTHONPATH"].split(os.pathsep)[:2] == [str(hook), str(REPO)]


def test_an_installed_wheels_child_keeps_the_callers_other_entries(tmp_path, monkeypatch):
    """`with_project=False` (tests/cli/test_packaging.py): the project root leaves PYTHONPATH even where the
    caller put it there, and the caller's other entries stay (hatchling etc. are found)."""
    packages = tmp_path / "packages"
    packages.mkdir()
    (packages / "callers_package.py").write_text("")
    monkeypatch.setenv("PYTHONPATH", f"{REPO}:{packages}")
    site = tmp_path / "site"
    (site / "pan2cli").mkdir(parents=True)
    (site / "pan2cli" / "__init__.py").write_text("")
    found = _found_in_child(python_env(site, with_project=False), tmp_path)
    assert found == {
        "callers_package": str(packages / "callers_package.py"),
        "pan2cli": str(site / "pan2cli" / "__init__.py"),
    }


# Code that builds a child's PYTHONPATH, or drops it with the other PYTHON* variables.
_SETS_PYTHONPATH = re.compile(r"""["']PYTHON(PATH)?["']|\bPYTHONPATH\s*=""")


def test_no_test_builds_a_childs_pythonpath_itself():
    """Every subprocess test takes its environment from `tests/subprocess_env.py` (seven files once
    each replaced the caller's PYTHONPATH with the project root)."""
    own = {Path(__file__).resolve(), REPO / "tests" / "subprocess_env.py"}
    offending = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path.resolve() in own:
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            code = line.split("#", 1)[0]
            if _SETS_PYTHONPATH.search(code):
                offending.append(f"{path.relative_to(REPO)}:{number}: {line.strip()}")
    assert offending == []
