"""Where output goes: results (paths) on stdout; progress, summaries, warnings and errors on stderr."""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Iterator

import click
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    ProgressColumn,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Column
from rich.text import Text

# Rich writes to stderr only; stdout stays clean for paths and --json.
stderr = Console(stderr=True, highlight=False)


def result(line: str) -> None:
    """One result line on stdout (a path written, a JSON document)."""
    click.echo(line)


def info(line: str, quiet: bool = False) -> None:
    """One human line on stderr, silenced by --quiet."""
    if not quiet:
        stderr.print(line, markup=False, soft_wrap=True)


def warn(line: str) -> None:
    click.echo(f"Warning: {line}", err=True)


def failure(error: BaseException, label: str | None = None) -> None:
    """A failure the command goes on after (a prompt of a batch): `Error: [<label> failed: ]...` and its hint."""
    click.echo(f"Error: {label} failed: {error}" if label else f"Error: {error}", err=True)
    hint = getattr(error, "hint", None)
    if hint:
        click.echo(f"Hint: {hint}", err=True)


# Below this terminal width the bar leaves out when the first item came (the decode's summary line says it).
_WIDE_ENOUGH_FOR_FIRST = 100


class _Description(ProgressColumn):
    """The bar's description, the column that gives way on a narrow terminal (cut with an ellipsis)."""

    def __init__(self) -> None:
        super().__init__(
            table_column=Column(no_wrap=False)
        )  # rich narrows only such columns before the others

    def render(self, task: Task) -> Text:
        return Text(task.description, no_wrap=True, overflow="ellipsis")


def _columns(unit: str, first: bool, width: int) -> list[ProgressColumn]:
    """Description, bar, `done/total unit`, rate, [first item], elapsed, remaining. The numbers keep their width
    (an 80-column terminal shows them whole); the description and then the bar give way."""

    def whole() -> Column:
        return Column(no_wrap=True)

    columns = [
        _Description(),
        BarColumn(table_column=Column(no_wrap=False)),
        MofNCompleteColumn(table_column=whole()),
        TextColumn(unit, table_column=whole()),
        TextColumn("{task.fields[rate]}", table_column=whole()),
    ]
    if first and width >= _WIDE_ENOUGH_FOR_FIRST:
        columns.append(TextColumn("{task.fields[first]}", table_column=whole()))
    return [*columns, TimeElapsedColumn(table_column=whole()), TimeRemainingColumn(table_column=whole())]


@contextmanager
def progress_bar(
    description: str, total: int, unit: str, quiet: bool = False, first: str | None = None
) -> Iterator:
    """A rich progress bar on stderr with the rate in `unit`/s; off under --quiet. When stderr is not a terminal (a
    log file, a pipe, a job scheduler's output) one line says the work started instead: a long step is not silence.

    Yields a callable `advance(n)`. With `first` (say "first frame"), the bar also shows how long the
    first item took to arrive ("first frame after 0.31 s") on a terminal of 100 columns or more.
    """
    if quiet or not sys.stderr.isatty():
        if not quiet:
            amount = f"{total} {unit}"
            info(f"{description}…" if amount in description else f"{description}: {amount}…")
        yield lambda n=1: None
        return
    columns = _columns(unit, first is not None, stderr.width)
    start = time.perf_counter()
    done = 0
    with Progress(*columns, console=stderr, transient=True) as bar:
        task = bar.add_task(description, total=total, rate="", first="")

        def advance(n: int = 1) -> None:
            nonlocal done
            elapsed = time.perf_counter() - start
            fields = {"rate": f"{(done + n) / elapsed:.1f} {unit}/s"} if elapsed > 0 else {}
            if first and done == 0:
                fields["first"] = f"{first} after {elapsed:.2f} s"
            done += n
            bar.update(task, advance=n, **fields)

        yield advance


@contextmanager
def status(message: str, quiet: bool = False) -> Iterator[None]:
    """A spinner on stderr while something without a known length runs (loading a model)."""
    if quiet or not sys.stderr.isatty():
        yield
        return
    with stderr.status(message):
        yield


def gib(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.2f} GiB"
