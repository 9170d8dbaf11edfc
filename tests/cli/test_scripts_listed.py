"""scripts/ is a toolbox a reader can walk: every script has its line in scripts/README.md, and the kernel
micro-benchmarks answer under one entry point (scripts/bench_kernels.py), each subcommand's `--help` intact."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from scripts import bench_kernels

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts"
SUFFIXES = (".py", ".sh", ".cu")
# `--help` imports each benchmark module, and with it pan2cli's Triton kernel modules: they must be defined in
# the mode the kernel tests use (Triton's interpreter without CUDA), or a later test calls them compiled.
pytestmark = pytest.mark.usefixtures("triton_interpreter_without_cuda")


def _scripts() -> list[str]:
    """Every script under scripts/, as its path relative to scripts/ (`kernels/conv.py`)."""
    return sorted(
        path.relative_to(SCRIPTS).as_posix()
        for path in SCRIPTS.rglob("*")
        if path.suffix in SUFFIXES and "__pycache__" not in path.parts
    )


def _readme_entries() -> set[str]:
    """The script names in the first cell of scripts/README.md's table rows."""
    entries = set()
    for line in (SCRIPTS / "README.md").read_text().splitlines():
        cells = line.split("|")
        if line.startswith("|") and len(cells) > 2:
            entries.update(name for name in re.findall(r"`([^`]+)`", cells[1]) if name.endswith(SUFFIXES))
    return entries


def test_every_script_has_its_line_in_the_readme():
    missing = [name for name in _scripts() if name not in _readme_entries()]
    assert not missing, f"scripts/README.md has no line for {missing}"


def test_every_script_the_readme_lists_exists():
    stale = sorted(_readme_entries() - set(_scripts()))
    assert not stale, f"scripts/README.md lists scripts that are gone: {stale}"


def test_every_kernel_benchmark_module_is_a_listed_subcommand():
    modules = {path.stem for path in (SCRIPTS / "kernels").glob("*.py") if path.stem != "__init__"}
    assert set(bench_kernels.SUBCOMMANDS.values()) == modules
    readme = (SCRIPTS / "README.md").read_text()
    for subcommand in bench_kernels.SUBCOMMANDS:
        assert f"scripts/bench_kernels.py {subcommand}" in readme, subcommand


def test_the_entry_point_lists_every_subcommand_with_its_summary(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["bench_kernels.py", "--help"])
    with pytest.raises(SystemExit) as exit_info:
        bench_kernels.main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for subcommand in bench_kernels.SUBCOMMANDS:
        summary = bench_kernels.summary(subcommand)
        assert summary and f"{subcommand} " in out and summary in out, subcommand


@pytest.mark.parametrize("argv", [[], ["gemm"]], ids=["none", "unknown"])
def test_a_missing_or_unknown_subcommand_is_a_usage_error(monkeypatch, capsys, argv):
    monkeypatch.setattr(sys, "argv", ["bench_kernels.py", *argv])
    with pytest.raises(SystemExit) as exit_info:
        bench_kernels.main(argv)
    assert exit_info.value.code == 2
    assert "usage: bench_kernels.py SUBCOMMAND" in capsys.readouterr().err


@pytest.mark.parametrize("subcommand", list(bench_kernels.SUBCOMMANDS))
def test_each_subcommand_parses_its_help(monkeypatch, capsys, subcommand):
    """Importing the module and parsing `--help` needs no GPU; the benchmark itself never starts."""
    monkeypatch.setattr(sys, "argv", ["bench_kernels.py", subcommand, "--help"])
    with pytest.raises(SystemExit) as exit_info:
        bench_kernels.main([subcommand, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: bench_kernels.py {subcommand} ")
