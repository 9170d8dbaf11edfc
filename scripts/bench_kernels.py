"""The kernel micro-benchmarks, one entry point: each subcommand is a module of scripts/kernels/ with its own options.

Usage: python3 scripts/bench_kernels.py SUBCOMMAND [options]      (SUBCOMMAND --help lists its options)

Each needs one CUDA GPU (`dit-fusions` has a CPU dry run); docs/BENCHMARKS.md and docs/KERNEL_NOTES.md give
their last figures with the command that made them.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# subcommand -> module of scripts/kernels/
SUBCOMMANDS = {
    "conv": "conv",
    "conv-out": "conv_out",
    "dit-fusions": "dit_fusions",
    "fused-norm": "fused_norm",
    "fp8-attention": "fp8_attention",
    "fp8-gemm": "fp8_gemm",
}


def summary(subcommand: str) -> str:
    """The first line of the subcommand module's docstring, read without importing it (no torch for --help)."""
    source = (ROOT / "scripts" / "kernels" / f"{SUBCOMMANDS[subcommand]}.py").read_text()
    return (ast.get_docstring(ast.parse(source)) or "").splitlines()[0]


def _parser() -> argparse.ArgumentParser:
    listing = "\n".join(f"  {name:<14} {summary(name)}" for name in SUBCOMMANDS)
    return argparse.ArgumentParser(
        prog="bench_kernels.py",
        usage="%(prog)s SUBCOMMAND [options]",
        description=__doc__.splitlines()[0],
        epilog=f"subcommands:\n{listing}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )


def main(argv: list[str] | None = None) -> int | None:
    """Run SUBCOMMAND's module with the options that follow it (its `--help` names it `bench_kernels.py SUBCOMMAND`)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = _parser()
    if not argv or argv[0].startswith("-"):
        parser.parse_args(argv)  # prints the help for -h/--help, refuses any other option
        parser.error("a subcommand is required")
    subcommand, options = argv[0], argv[1:]
    if subcommand not in SUBCOMMANDS:
        parser.error(f"unknown subcommand {subcommand!r} (choose from {', '.join(SUBCOMMANDS)})")
    if str(ROOT) not in sys.path:  # scripts.kernels.* and their shared helpers import as a package
        sys.path.insert(0, str(ROOT))
    module = importlib.import_module(f"scripts.kernels.{SUBCOMMANDS[subcommand]}")
    sys.argv = [f"bench_kernels.py {subcommand}", *options]  # each module's argparse reads sys.argv
    return module.main()


if __name__ == "__main__":
    sys.exit(main())
