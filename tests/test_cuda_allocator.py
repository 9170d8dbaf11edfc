"""The CUDA allocator's setting: large cached blocks kept whole, a user's own settings left alone, set before torch
loads when `pan2 generate` starts."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pan2cli.cuda_allocator import SETTINGS, configure_cuda_allocator
from tests.subprocess_env import python_env


def test_unset_environment_gets_the_setting():
    environ: dict[str, str] = {}
    assert configure_cuda_allocator(environ) == SETTINGS
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:1024"}


@pytest.mark.parametrize("name", ["PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"])
def test_a_users_own_settings_are_kept(name):
    environ = {name: "expandable_segments:True"}
    assert configure_cuda_allocator(environ) is None
    assert environ == {name: "expandable_segments:True"}


def test_an_empty_variable_counts_as_unset():
    environ = {"PYTORCH_CUDA_ALLOC_CONF": ""}
    assert configure_cuda_allocator(environ) == SETTINGS
    assert environ["PYTORCH_CUDA_ALLOC_CONF"] == SETTINGS


def test_generate_sets_it_before_torch_loads():
    """`pan2 generate` sets the variable while torch is not yet imported (the allocator reads it when torch loads)."""
    probe = (
        "import os, sys\n"
        "import pan2cli.cli.generate as generate\n"
        "from pan2cli.cli import main\n"
        "seen = {}\n"
        "configure = generate.configure_cuda_allocator\n"
        "def recording():\n"
        "    seen['torch_loaded'] = 'torch' in sys.modules\n"
        "    return configure()\n"
        "def ranks(*args, **kwargs):\n"
        "    seen['conf'] = os.environ.get('PYTORCH_CUDA_ALLOC_CONF')\n"
        "    return 0\n"
        "generate.configure_cuda_allocator = recording\n"
        "generate.run_on_ranks = ranks\n"
        "try:\n"
        "    main(['generate', 'a cat'])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(seen['torch_loaded'], seen['conf'])\n"
    )
    env = python_env()  # the caller's PYTHONPATH behind the project, as every test's child
    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        env.pop(name, None)
    result = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True
    )
    assert result.stdout.split() == ["False", SETTINGS]


def test_after_torch_loads_the_runtime_route_runs_on_any_build(monkeypatch):
    """The Python API's route (torch already imported): on a CPU-only torch it sets the variable and nothing fails."""
    import torch  # noqa: F401 (the route under test is the one taken once torch is loaded)

    for name in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    assert configure_cuda_allocator() == SETTINGS
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == SETTINGS
