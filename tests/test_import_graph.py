"""The package's shape: no two modules of pan2cli import each other, directly or through others; every module
sits on a floor and imports only from its own floor or those below; no module is longer than a reader holds in
their head.

The import graph is read from the source with `ast` (nothing is imported) and counts every import: at
module level, inside functions and under `if TYPE_CHECKING:` (a lazy import is still an arrow a reader
follows). `from package import name` points at the submodule `package.name` when there is one, else at
`package`.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, Sequence

PACKAGE = Path(__file__).resolve().parents[1] / "pan2cli"
MAX_MODULE_LINES = 450
# A single-file model may run longer, as diffusers' single-file models do.
LONG_MODELS = {"pan2cli/dit/model.py"}

# The floors, lowest first: a module imports from its own floor and those below, never from above. A module
# is on the floor of the longest name in the table that it is or lies under (the root `pan2cli` only by name).
FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("basics", ("pan2cli.constants", "pan2cli.errors", "pan2cli.paths", "pan2cli.resources", "pan2cli.version",
                "pan2cli.atomic", "pan2cli.host_memory", "pan2cli.triton_support", "pan2cli.outputs",
                "pan2cli.frames", "pan2cli.kernel_build", "pan2cli.cuda_allocator")),
    ("configuration", ("pan2cli.devices", "pan2cli.config", "pan2cli.presets")),
    ("processes", ("pan2cli.distributed",)),
    ("files", ("pan2cli.checkpoints", "pan2cli.latents", "pan2cli.ffmpeg", "pan2cli.video")),
    ("models", ("pan2cli.vae", "pan2cli.dit", "pan2cli.text", "pan2cli.scheduler")),
    ("release", ("pan2cli.components",)),
    ("pipeline", ("pan2cli.pipeline", "pan2cli.decoding")),
    ("commands", ("pan2cli.cli", "pan2cli.__main__", "pan2cli")),
)  # fmt: skip
# Outside the floors: test support imports anything, and nothing of pan2 imports it.
OUTSIDE = "pan2cli.testing"


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


def floor_of(module: str, floors: Sequence[tuple[str, Sequence[str]]] = FLOORS) -> int | None:
    """The index of `module`'s floor (the longest name of the table it is or lies under), None if it has none."""
    best, index = "", None
    for i, (_, names) in enumerate(floors):
        for name in names:
            under = module == name or ("." in name and module.startswith(name + "."))
            if under and len(name) > len(best):
                best, index = name, i
    return index


def upward_imports(
    graph: dict[str, set[str]], floors: Sequence[tuple[str, Sequence[str]]] = FLOORS
) -> list[str]:
    """`module (floor) -> imported (higher floor)` for every arrow that runs up, sorted."""
    arrows = []
    for module, imported in graph.items():
        low = floor_of(module, floors)
        for name in imported:
            high = floor_of(name, floors)
            if low is not None and high is not None and high > low:
                arrows.append(f"{module} ({floors[low][0]}) -> {name} ({floors[high][0]})")
    return sorted(arrows)


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


def test_an_import_from_a_higher_floor_is_found():
    """The floor check sees an arrow up, from a package's module too, and lets arrows down and sideways pass."""
    floors = (("low", ("pkg.base",)), ("mid", ("pkg.models", "pkg.helpers")), ("top", ("pkg.cli", "pkg")))
    graph = {
        "pkg": {"pkg.cli"},
        "pkg.base": set(),
        "pkg.models.a": {"pkg.base", "pkg.helpers"},
        "pkg.models.b": {"pkg.cli"},
        "pkg.helpers": {"pkg.models.a"},
        "pkg.cli": {"pkg.models.b", "pkg.base"},
    }
    assert floor_of("pkg.models.a", floors) == 1 and floor_of("pkg.modelsx", floors) is None
    assert upward_imports(graph, floors) == ["pkg.models.b (mid) -> pkg.cli (top)"]


def test_every_module_has_a_floor():
    """A new module or package of pan2cli takes its place in `FLOORS` (or is test support, outside them)."""
    graph = import_graph(PACKAGE)
    homeless = sorted(m for m in graph if floor_of(m) is None and not m.startswith(OUTSIDE))
    assert not homeless, f"add these to a floor of FLOORS: {homeless}"


def test_no_module_imports_from_a_higher_floor():
    """Data flows one way: the commands call the pipeline, which runs the models, which read files with the
    configuration they are given; nothing runs back up (`pan2cli.config` reaches no model code)."""
    upward = upward_imports(import_graph(PACKAGE))
    assert not upward, "imports from a higher floor (move the shared code down):\n" + "\n".join(upward)


def test_nothing_of_pan2_imports_the_test_support():
    graph = import_graph(PACKAGE)
    users = sorted(m for m, imported in graph.items() if not m.startswith(OUTSIDE) and any(
        name == OUTSIDE or name.startswith(OUTSIDE + ".") for name in imported
    ))  # fmt: skip
    assert not users, f"{OUTSIDE} is imported by {users}"


def module_lengths() -> dict[str, int]:
    """`pan2cli/...py` → its number of lines, for every module of the package."""
    return {
        str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines())
        for path in sorted(PACKAGE.rglob("*.py"))
    }


# A command module holds its options and printing only (the work is the library's).
COMMAND_MODULE_LINES = {"pan2cli/cli/generate.py": 350, "pan2cli/cli/decode.py": 300}


def test_no_module_is_longer_than_a_reader_holds():
    """Every module of pan2cli is one job a reader holds in their head; the single-file model may run longer
    (as diffusers' do)."""
    lengths = module_lengths()
    assert len(lengths) > 100, f"the modules of {PACKAGE} were not read"
    too_long = {
        path: n
        for path, n in lengths.items()
        if path not in LONG_MODELS and n > COMMAND_MODULE_LINES.get(path, MAX_MODULE_LINES)
    }
    assert not too_long, f"over the limit (split by job): {too_long}"
