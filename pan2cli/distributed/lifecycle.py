"""How a rank (or a single process) ends: the exit code it leaves for pan2's launcher, its temporary outputs removed,
a prompt end after Ctrl-C or SIGTERM even inside one long torch op, and an end with its launcher.

A rank notes its temporary outputs (`partial_output`) and the code it chose (`record_exit`) in the launcher's
folder (`protocol`); a rank whose launcher dies stops (`end_with_parent`); a rank or single process whose main
thread cannot see a signal ends itself `protocol.UNWIND_S` seconds later (`ExitIfStuck`). No torch.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import sys
import threading
import time
from contextlib import contextmanager, suppress
from typing import Callable, Iterator

from pan2cli.distributed.protocol import (
    ENV_EXIT_DIR,
    EXIT_CODE_FILE,
    PARTIAL_FILE,
    PID_FILE,
    POLL_S,
    UNWIND_S,
    echo_err,
    env_rank,
    has_parent_launcher,
    launcher_pid,
    under_torchrun,
)
from pan2cli.errors import EXIT_INTERRUPTED, EXIT_TERMINATED, Terminated

_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# What a rank receives when its launcher dies (`end_with_parent`): no terminal sends it to a rank, which
# torchrun starts in a session of its own.
_PARENT_DIED = getattr(signal, "SIGHUP", signal.SIGTERM)

_partials: list[str] = []  # this rank's temporary outputs being written (`partial_output`)
_orphaned = threading.Event()  # this rank's launcher died (`end_with_parent`)


# -- what a rank leaves for the launcher -----------------------------------------------------------
def record_exit(code: int) -> int:
    """Leave this rank's chosen exit code for pan2's launcher (which may see a SIGTERM instead); returns `code`."""
    folder = os.environ.get(ENV_EXIT_DIR)
    if folder and under_torchrun():
        try:
            with open(os.path.join(folder, f"{EXIT_CODE_FILE}{env_rank()}"), "w") as f:
                f.write(str(code))
        except OSError:
            pass  # the parent falls back to torchrun's view of the exit codes
    return code


@contextmanager
def partial_output(path: str | os.PathLike | None) -> Iterator[None]:
    """Note a temporary output (for `ExitIfStuck` and pan2's launcher) while it is being written.

    A rank stuck in a CUDA wait (a single process in one long torch op) cannot run its signal handlers,
    so its writer cannot remove the temporary file: its `ExitIfStuck` thread removes what is noted here
    before it ends the process, and pan2's launcher does if a rank was killed outright.
    """
    if path is None:
        yield
        return
    path = os.path.abspath(path)
    _partials.append(path)  # a single process's `stop_promptly` removes it too
    folder = os.environ.get(ENV_EXIT_DIR) if under_torchrun() else None
    note = os.path.join(folder, f"{PARTIAL_FILE}{env_rank()}-{os.getpid()}") if folder else None
    if note:
        try:
            with open(note, "w") as f:
                f.write(path)
        except OSError:  # the folder went with a launcher that died: this rank is stopping
            note = None
    try:
        yield
    finally:
        _partials.remove(path)
        if note:
            with suppress(FileNotFoundError):
                os.remove(note)


def remove_path(path: str) -> None:
    """Remove a temporary output: a file, or a folder (PNG frames) with what it holds."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def end_rank_now(code: int) -> None:
    """End this rank at once, from any thread: temporary outputs removed, `code` recorded, no unwinding."""
    for path in list(_partials):
        remove_path(path)
    os._exit(record_exit(code))


# -- ending with the launcher ----------------------------------------------------------------------
def end_with_parent() -> None:
    """Stop this rank when pan2's launcher dies (`kill -9`, a scheduler's job kill); a no-op otherwise.

    torchrun's agent starts each rank in a session of its own, so the launcher's death reaches no rank by
    itself: the ranks would finish, write the output and leave the launcher's folder behind, with no one to
    report anything. On Linux the kernel sends this rank `_PARENT_DIED` (SIGHUP) when the launcher dies
    (prctl's PR_SET_PDEATHSIG); elsewhere, or if it died before that was set, a thread that polls the
    parent's pid sends it. Its handler removes the launcher's folder and unwinds the rank as torchrun's
    SIGTERM does (temporary outputs removed, a quiet exit); the thread ends a rank still there `UNWIND_S`
    later (`end_rank_now`). A signal of its own, not SIGTERM: the kernel may send it while the parent's
    pid still shows (its main thread dies first), and only this signal says the launcher is gone. Also
    leaves this rank's pid for the launcher (its hang watch). Call it from the main thread.
    """
    parent = launcher_pid()
    if parent is None or not under_torchrun() or threading.current_thread() is not threading.main_thread():
        return
    folder = os.environ.get(ENV_EXIT_DIR)
    if folder:
        with suppress(OSError), open(os.path.join(folder, f"{PID_FILE}{env_rank()}"), "w") as f:
            f.write(str(os.getpid()))
    signal.signal(_PARENT_DIED, _parent_died)
    signalled = _signal_when_parent_dies() and os.getppid() == parent  # else it died before prctl
    threading.Thread(
        target=_watch_parent, args=(parent, signalled), name="pan2-parent-watch", daemon=True
    ).start()


def _signal_when_parent_dies() -> bool:
    """Ask Linux to send this process `_PARENT_DIED` when its parent dies; False where that cannot be asked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        return ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, _PARENT_DIED, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parent_died(signum, frame) -> None:
    if _orphaned.is_set():  # once: a second signal must not cut the unwinding short
        return
    _orphaned.set()
    _remove_launcher_folder()
    raise Terminated()


def _watch_parent(parent: int, signalled: bool) -> None:
    while os.getppid() == parent:
        time.sleep(POLL_S)
    _remove_launcher_folder()  # also where the main thread waits beyond the reach of the handler
    if not signalled:
        os.kill(os.getpid(), _PARENT_DIED)
    time.sleep(UNWIND_S)  # the main thread's own way out, which removes the temporary outputs
    end_rank_now(EXIT_TERMINATED)


def _remove_launcher_folder() -> None:
    """The launcher's folder (`ENV_EXIT_DIR`), once the launcher is gone: it would have removed it."""
    folder = os.environ.get(ENV_EXIT_DIR)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)


# -- a prompt end after Ctrl-C or SIGTERM ----------------------------------------------------------
def interrupted_exit() -> tuple[int, str | None]:
    """`(exit code, line to print)` of a rank stopped by Ctrl-C or torchrun's SIGTERM."""
    # pan2's launcher prints "Interrupted." once; under a user's torchrun, rank 0 does.
    return EXIT_INTERRUPTED, None if has_parent_launcher() or env_rank() != 0 else "Interrupted."


class ExitIfStuck:
    """After Ctrl-C or SIGTERM, end this rank (or single process) `UNWIND_S` seconds later unless it has left
    the group (the command) by then.

    Python runs signal handlers in the main thread between bytecodes, so a rank waiting inside NCCL
    for a peer that died never sees torchrun's SIGTERM, and torchrun waits 30 s before its SIGKILL; a
    single process inside one long torch op on the CPU (minutes of attention over a long video) does not
    see Ctrl-C until the op ends. This thread learns of the signal through the wakeup fd at once, removes
    the temporary outputs (`partial_output`), records the exit (`exit_for(signal)`: code, line) and ends
    the process.
    """

    def __init__(self, exit_for: Callable[[int], tuple[int, str | None]] | None = None):
        self._exit_for = exit_for or (lambda signum: interrupted_exit())
        self._left = threading.Event()
        self._previous = None
        if threading.current_thread() is not threading.main_thread():
            return
        read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._previous = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        threading.Thread(target=self._watch, args=(read_fd,), name="pan2-exit-if-stuck", daemon=True).start()

    def _watch(self, read_fd: int) -> None:
        with os.fdopen(read_fd, "rb", buffering=0) as signals:
            while not self._left.is_set():
                received = signals.read(64)
                if not received:  # closed: the rank left the group
                    return
                if signal.SIGINT in received or signal.SIGTERM in received:
                    signum = signal.SIGINT if signal.SIGINT in received else signal.SIGTERM
                    break
        if self._left.wait(UNWIND_S):
            return
        code, line = self._exit_for(signum)
        if line:
            echo_err(line)
        end_rank_now(code)

    def close(self) -> None:
        self._left.set()
        if self._previous is not None:
            signal.set_wakeup_fd(self._previous)
            os.close(self._write_fd)
            self._previous = None


def _single_process_exit(signum: int) -> tuple[int, str | None]:
    """`(exit code, line)` of a command stopped by Ctrl-C (130) or SIGTERM (143), as its main thread would say it."""
    return (
        (EXIT_TERMINATED, "Terminated.") if signum == signal.SIGTERM else (EXIT_INTERRUPTED, "Interrupted.")
    )


@contextmanager
def stop_promptly() -> Iterator[None]:
    """A single process's command: after Ctrl-C or SIGTERM it ends within `UNWIND_S` seconds, its temporary
    outputs removed, even when its main thread is inside one long torch op (`ExitIfStuck`)."""
    watch = ExitIfStuck(_single_process_exit)
    try:
        yield
    finally:
        watch.close()
