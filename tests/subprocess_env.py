"""The environment of every child process a test starts: the caller's own, with the project first on PYTHONPATH.

A caller whose packages come from PYTHONPATH (a cluster's module, a container, a folder of wheels on a
machine without network) must keep them in the child: the project root goes in front of the caller's
entries, never in their place (a fresh PYTHONPATH once lost `imageio_ffmpeg` and `hatchling` on an H200
host). Tests build a child's environment here only; `tests/test_subprocess_env.py` checks that. Beside it, the
two pieces of a test that stops a running command at a chosen moment: a hook every child Python runs at start
(`hooked_env`), and the wait for the moment (`wait_while_running`).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# torchrun's variables: a child is a command of its own, never a rank of a torchrun the tests run under.
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def caller_pythonpath(with_project: bool = True) -> list[str]:
    """This process's PYTHONPATH entries, absolute (a child may run in another folder), empty ones dropped.

    Args:
        with_project: False leaves out the entries that are the project root (a child that must import
            an installed pan2cli, not this checkout).
    """
    entries = [os.path.abspath(e) for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e]
    if not with_project:
        entries = [e for e in entries if Path(e).resolve() != REPO]
    return entries


def python_env(*first: str | os.PathLike, with_project: bool = True, **extra: str) -> dict[str, str]:
    """`os.environ` for a child Python: PYTHONPATH is `first`, the project root, then the caller's entries.

    Args:
        first: folders ahead of everything (a test's `sitecustomize.py` hook, an installed wheel).
        with_project: False: no project root, and none from the caller's entries either (an installed
            wheel's test); the caller's other entries stay, so that its packages are still found.
        extra: variables to set (or replace) in the child.

    Returns:
        A new dict; the caller's environment is not changed.
    """
    env = {k: v for k, v in os.environ.items() if k not in _TORCHRUN_VARS}
    project = [str(REPO)] if with_project else []
    path = [str(p) for p in first] + project + caller_pythonpath(with_project)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(path))  # in order, each once
    env.update(extra)
    return env


def hooked_env(tmp_path: os.PathLike, hook_code: str, **extra: str) -> dict[str, str]:
    """`python_env` with a `sitecustomize.py` holding `hook_code` first on PYTHONPATH: every child Python (each
    rank too) runs it at start. Its folder is `tmp_path / "hook"`, made here, where a hook may also leave files."""
    hook = Path(tmp_path) / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(hook_code)
    return python_env(hook, **extra)


def wait_while_running(proc: subprocess.Popen, ready: Callable[[], bool], deadline: float) -> None:
    """Poll `ready()` every 0.1 s until it holds; fail with the child's output if `proc` ends first or
    `time.monotonic()` passes `deadline` (a hang guard, not a timing)."""
    while not ready():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
