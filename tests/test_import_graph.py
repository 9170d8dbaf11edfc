"""The package's shape (issue 30): no two modules of pan2cli import each other, directly or through others,
and no module of the decode kernel is longer than a reader holds in their head.

The import graph is read from the source with `ast` (nothing is imported) and counts every import: at
module level, inside functions and under `if TYPE_CHECKING:` (a lazy import is still an arrow a reader
follows). `from package import name` points at the submodule `package.name` when there is one, else at
`package`.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

PACKAGE = Path(__file__).resolve().parents[1] / "pan2cli"
KERNEL_PACKAGE = PACKAGE / "vae" / "kernel"
MAX_KERNEL_MODULE_LINES = 450


def module_files(package: Path) -> dict[str, Path]:
    """Dotted module name → file, for every module under `package` (`__init__.py` named as its package)."""
    modules = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_modules(module: str, path: Path, modules: dict[str, Path]) -> Iterator[str]:
    """The absolute names of what `module` (at `path`) imports, each resolved to a submodule where one exists."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # `from . import x`, `from ..y import x`
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                yield submodule if submodule in modules else base


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module → the modules of the same package it imports (itself left out)."""
    modules = module_files(package)
    return {
        module: {name for name in imported_modules(module, path, modules) if name in modules} - {module}
        for module, path in modules.items()
    }


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, directly or through others."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        for name in graph[todo.pop()] - seen:
            seen.add(name)
            todo.append(name)
    return seen


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other (each sorted), sorted."""
    reach = {module: reachable(graph, module) for module in graph}
    groups = {frozenset(n for n in reach[m] if m in reach[n]) for m in graph if m in reach[m]}
    return sorted(sorted(group) for group in groups)


def describe(graph: dict[str, set[str]], cycle: list[str]) -> str:
    arrows = (f"  {module} -> {', '.join(sorted(graph[module] & set(cycle)))}" for module in cycle)
    return "\n".join([", ".join(cycle) + ":", *arrows])


def test_the_graph_counts_every_import(tmp_path):
    """The reader finds the arrows a cycle can hide behind: lazy, TYPE_CHECKING, relative, `from pkg import mod`."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    sources = {
        "__init__.py": "def __getattr__(name):\n    from pkg.sub import deep\n    return deep\n",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import b\n",
        "b.py": "def f():\n    from .sub.deep import g\n    return g\n",
        "sub/__init__.py": "",
        "sub/deep.py": "import os\nimport pkg.a\n",
        "leaf.py": "from pkg import a\n",
    }
    for name, text in sources.items():
        (package / name).write_text(text)
    graph = import_graph(package)
    assert graph == {
        "pkg": {"pkg.sub.deep"},
        "pkg.a": {"pkg.b"},
        "pkg.b": {"pkg.sub.deep"},
        "pkg.sub": set(),
        "pkg.sub.deep": {"pkg.a"},
        "pkg.leaf": {"pkg.a"},
    }
    assert import_cycles(graph) == [["pkg.a", "pkg.b", "pkg.sub.deep"]]


def test_no_module_of_pan2cli_imports_itself_through_others():
    graph = import_graph(PACKAGE)
    assert len(graph) > 50 and graph["pan2cli.cli"], "the package was not read"
    cycles = import_cycles(graph)
    assert not cycles, "import cycles (give the shared code one home):\n" + "\n".join(
        describe(graph, cycle) for cycle in cycles
    )


def test_decode_kernel_modules_stay_readable():
    lengths = {
        str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines())
        for path in sorted(KERNEL_PACKAGE.rglob("*.py"))
    }
    assert lengths, f"no module under {KERNEL_PACKAGE}"
    too_long = {path: n for path, n in lengths.items() if n > MAX_KERNEL_MODULE_LINES}
    assert not too_long, f"over {MAX_KERNEL_MODULE_LINES} lines (split by job): {too_long}"


def test_the_configuration_imports_no_model_code():
    """`pan2cli.config` (what every command builds before anything loads) sits below the models: the device
    checks it makes are `pan2cli.devices`', so no arrow runs from it up to the DiT, the VAE or the pipeline."""
    graph = import_graph(PACKAGE)
    upward = {
        m
        for m in reachable(graph, "pan2cli.config")
        if m.startswith(("pan2cli.dit", "pan2cli.vae", "pan2cli.pipeline"))
    }
    assert not upward, f"pan2cli.config reaches {sorted(upward)}"


# Every module of pan2cli is one job a reader holds in their head; a single-file model may run longer (as diffusers'
# do), and a command module holds its options and printing only (the work is the library's).
MAX_MODULE_LINES = 450
LONGER_MODULES = {"pan2cli/dit/model.py"}
COMMAND_MODULE_LINES = {"pan2cli/cli/generate.py": 350, "pan2cli/cli/decode.py": 300}
# Over the limit until they are split by job; the test says when one no longer is, so that it leaves this set.
NOT_YET_SPLIT = {"pan2cli/launch.py", "pan2cli/video.py"}


def test_modules_stay_readable():
    lengths = {
        path.relative_to(PACKAGE.parent).as_posix(): len(path.read_text().splitlines())
        for path in sorted(PACKAGE.rglob("*.py"))
    }
    assert "pan2cli/cli/generate.py" in lengths, "the package was not read"
    too_long = {
        path: n
        for path, n in lengths.items()
        if path not in LONGER_MODULES and n > COMMAND_MODULE_LINES.get(path, MAX_MODULE_LINES)
    }
    assert set(too_long) <= NOT_YET_SPLIT, f"too long (split by job): {too_long}"
    assert set(too_long) == NOT_YET_SPLIT, (
        f"now short enough, take them out of NOT_YET_SPLIT: {NOT_YET_SPLIT - set(too_long)}"
    )
