"""Map known failures to one `Error: ...` line (plus `Hint: ...`) and an exit code; keep tracebacks for the unexpected.

torch and pan2cli.distributed are looked up in `sys.modules`, never imported here: `pan2 --help` must not
load torch, and an exception of theirs can only come from a command that imported them.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import traceback
from contextlib import contextmanager
from typing import Iterator

import click

from pan2cli.errors import (
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    OutOfMemoryError,
    Pan2Error,
    Terminated,
    out_of_memory,
)


def debug_enabled() -> bool:
    """Tracebacks for known errors too: `--debug` or `PAN2_DEBUG=1`."""
    return os.environ.get("PAN2_DEBUG", "") not in ("", "0")


def _report(error: Pan2Error) -> int:
    if debug_enabled():
        traceback.print_exc(file=sys.stderr)
    click.echo(f"Error: {error}", err=True)
    if error.hint:
        click.echo(f"Hint: {error.hint}", err=True)
    return error.exit_code


def _is_out_of_memory(error: BaseException) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(error, torch.OutOfMemoryError)


def _out_of_memory(error: BaseException) -> OutOfMemoryError:
    return out_of_memory(error, hint="pass a smaller --chunk-latent-frames, or free the GPU")


def _rank_failure(error: Exception):
    """pan2cli.distributed when `error` is a known failure of a rank under torchrun, else None."""
    if "pan2cli.distributed.group" not in sys.modules:  # every command that runs on ranks imported it
        return None
    distributed = sys.modules["pan2cli.distributed"]
    if not distributed.under_torchrun():
        return None
    known = isinstance(
        error, (distributed.WorkerExit, Pan2Error, _TerminatedCommand, click.exceptions.Abort)
    ) or _is_out_of_memory(error)
    return distributed if known else None


def _worker_exit(error: BaseException, distributed) -> int:
    """A rank under torchrun: print only what the failure protocol of pan2cli.distributed says to print."""
    if isinstance(error, (KeyboardInterrupt, click.exceptions.Abort, _TerminatedCommand)):
        # Ctrl-C, or torchrun stopping the ranks before they joined the process group
        error = distributed.WorkerExit(*distributed.interrupted_exit())
    if isinstance(error, distributed.WorkerExit):
        if error.line:
            click.echo(error.line, err=True)
        return error.exit_code
    if _is_out_of_memory(error):
        error = _out_of_memory(error)
    return _report(error) if distributed.reports_error(error) else error.exit_code


def _raise_terminated(signum, frame) -> None:
    raise Terminated()


@contextmanager
def _sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises `Terminated` while a command runs, so that it cleans up as on Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():  # signal handlers belong to the main thread
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _TerminatedCommand(Exception):
    """A command stopped by SIGTERM, past click (which would print a blank line for a KeyboardInterrupt)."""


class Pan2Group(click.Group):
    """A click group whose `main` turns our typed errors into exit codes (CliRunner sees the same)."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except Terminated as exc:
            raise _TerminatedCommand() from exc

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        # The raw arguments, for commands that re-launch themselves (`--gpus N`).
        extra.setdefault("obj", {"argv": list(args) if args is not None else sys.argv[1:]})
        try:
            try:
                with _sigterm_unwinds():
                    result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            except Exception as exc:
                distributed = _rank_failure(exc)
                if distributed is None:
                    raise
                sys.exit(distributed.record_exit(_worker_exit(exc, distributed)))
        except _TerminatedCommand:
            click.echo("Terminated.", err=True)
            sys.exit(EXIT_TERMINATED)
        except click.exceptions.Exit as exc:
            sys.exit(exc.exit_code)
        except click.ClickException as exc:  # usage errors: exit 2, with click's usage line
            exc.show()
            sys.exit(exc.exit_code)
        except (KeyboardInterrupt, click.exceptions.Abort):
            click.echo("Interrupted.", err=True)
            sys.exit(EXIT_INTERRUPTED)
        except Pan2Error as exc:
            sys.exit(_report(exc))
        except Exception as exc:
            if not _is_out_of_memory(exc):
                raise
            sys.exit(_report(_out_of_memory(exc)))
        sys.exit(result if isinstance(result, int) else 0)
