"""Self-launch under torchrun's agent (`pan2 ... --gpus N`), and what torchrun tells each rank through the environment.

The only reader of torchrun's environment (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE; LOCAL_RANK in
`pan2cli.distributed.process_group`) and of pan2's own (PAN2_DIST_*). When pan2 launched torchrun, the parent
runs torchrun's agent in-process, keeps its log lines off the terminal, and exits with the code of the
failing rank (torchrun alone would exit 1 and print a report); a rank that died without a word (killed by a
signal) is named by the parent — the first to die, from torchrun's per-rank failures — with exit 1, and a
rank still running `_HUNG_AFTER_S` after another ended with a code of its own is named as hung and ended
(torchrun would wait 30 s for it and then report it as killed). Each rank leaves its pid and the code it
chose (`record_exit`) and notes its temporary outputs (`partial_output`) in a folder of the parent's,
which also holds torchrun's own run folder; a rank whose launcher dies stops (`end_with_parent`). The
process group and the failure protocol: `pan2cli.distributed`.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from contextlib import contextmanager, suppress
from datetime import timedelta
from typing import Iterator, Sequence

import torch

from pan2cli.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    InputError,
    Pan2Error,
    Terminated,
)

# Seconds a collective may wait for the other ranks before it fails (a rank died or hangs).
ENV_TIMEOUT = "PAN2_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
# Set by pan2's own launcher for its workers: the launcher's pid (a parent will report the outcome), and
# the folder where each rank writes the exit code it chose (torchrun may kill it before it exits).
ENV_PARENT = "PAN2_DIST_PARENT"
ENV_EXIT_DIR = "PAN2_DIST_EXIT_DIR"
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# Exit codes of a worker whose collective failed without an error of its own: the peer is gone, or it
# did not answer within PAN2_DIST_TIMEOUT (pan2's launcher only; never user-visible: the parent maps
# them to 1 and prints one line).
_EXIT_PEER_LOST = 3
_EXIT_PEER_TIMED_OUT = 4
# Seconds a rank stopped by Ctrl-C or SIGTERM has to unwind before it leaves without its main thread,
# which may be stuck in a wait that signal handlers cannot interrupt (NCCL, for a peer that died).
UNWIND_S = 3.0
# A rank still running this long after another ended with a code of its own is hung: torchrun's SIGTERM
# reached it then, and a rank that can act on it is gone within UNWIND_S (`_ExitIfStuck` in
# pan2cli.distributed), plus a second to exit.
_HUNG_AFTER_S = UNWIND_S + 1.0
_POLL_S = 0.2  # how often the launcher looks at the ranks' folder, and a rank at its parent's pid
_PR_SET_PDEATHSIG = 1  # linux/prctl.h
# What a rank receives when its launcher dies (`end_with_parent`): no terminal sends it to a rank, which
# torchrun starts in a session of its own.
_PARENT_DIED = getattr(signal, "SIGHUP", signal.SIGTERM)

_partials: list[str] = []  # this rank's temporary outputs being written (`partial_output`)
_orphaned = threading.Event()  # this rank's launcher died (`end_with_parent`)


# -- environment ----------------------------------------------------------------------------------
def under_torchrun() -> bool:
    """Whether this process was started by torchrun (or `pan2 ... --gpus N`): RANK, WORLD_SIZE, LOCAL_RANK set."""
    return all(name in os.environ for name in _TORCHRUN_VARS)


def env_rank() -> int:
    """This process's rank from torchrun's environment (0 outside torchrun)."""
    return int(os.environ.get("RANK", "0")) if under_torchrun() else 0


def env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1")) if under_torchrun() else 1


def env_local_world_size(default: int) -> int:
    """Processes on this machine from torchrun's environment (LOCAL_WORLD_SIZE); `default` when it is not set."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", default))


def has_parent_launcher() -> bool:
    """Whether pan2's own launcher started this rank (and reports the outcome)."""
    return _launcher_pid() is not None


def _launcher_pid() -> int | None:
    raw = os.environ.get(ENV_PARENT, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def _timeout() -> timedelta:
    raw = os.environ.get(ENV_TIMEOUT)
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise InputError(f"{ENV_TIMEOUT}={raw!r} is not a number of seconds") from None
    if seconds <= 0:
        raise InputError(f"{ENV_TIMEOUT}={raw!r} must be positive")
    return timedelta(seconds=seconds)


# -- launch ---------------------------------------------------------------------------------------
def check_gpus(gpus: int, device: str | None) -> None:
    """Refuse a `--gpus` that cannot run, before anything starts.

    Args:
        gpus: processes to start (≥ 1).
        device: the `--device` value: `cpu` runs `gpus` CPU processes (gloo); otherwise each process
            takes one visible GPU.

    Raises:
        InputError: more GPUs than visible, no CUDA, or `--device cuda:N` (ranks use cuda:LOCAL_RANK).
    """
    if device is not None and device.strip().lower() == "cpu":
        return
    if device is not None and ":" in device:
        raise InputError(
            f"--device {device} names one GPU, but --gpus {gpus} runs one process per GPU",
            hint="pass --device cuda (rank r uses cuda:r); choose the GPUs with CUDA_VISIBLE_DEVICES",
        )
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus > visible:
        raise InputError(
            f"--gpus {gpus}: only {visible} GPU(s) visible",
            hint=f"pass --gpus {visible}"
            if visible > 1
            else "pass --device cpu to run the processes on the CPU",
        )


def strip_option(args: Sequence[str], name: str) -> list[str]:
    """`args` without `name VALUE` / `name=VALUE` (the re-launched command must not launch again)."""
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == name:
            skip = True
        elif not arg.startswith(f"{name}="):
            out.append(arg)
    return out


def _quiet_torchrun_logs() -> None:
    # torchrun's agent logs worker failures, SIGTERMs and its OMP_NUM_THREADS notice at WARNING and
    # above; the workers print the real errors, so its loggers are switched off in this process.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).disabled = True


def record_exit(code: int) -> int:
    """Leave this rank's chosen exit code for pan2's launcher (which may see a SIGTERM instead); returns `code`."""
    folder = os.environ.get(ENV_EXIT_DIR)
    if folder and under_torchrun():
        try:
            with open(os.path.join(folder, f"rank{env_rank()}"), "w") as f:
                f.write(str(code))
        except OSError:
            pass  # the parent falls back to torchrun's view of the exit codes
    return code


@contextmanager
def partial_output(path: str | os.PathLike | None) -> Iterator[None]:
    """Note a temporary output (for `_ExitIfStuck` and pan2's launcher) while it is being written.

    A rank stuck in a CUDA wait (a single process in one long torch op) cannot run its signal handlers,
    so its writer cannot remove the temporary file: its `_ExitIfStuck` thread removes what is noted here
    before it ends the process, and pan2's launcher does if a rank was killed outright.
    """
    if path is None:
        yield
        return
    path = os.path.abspath(path)
    _partials.append(path)  # a single process's `stop_promptly` removes it too
    folder = os.environ.get(ENV_EXIT_DIR) if under_torchrun() else None
    note = os.path.join(folder, f"partial-{env_rank()}-{os.getpid()}") if folder else None
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


def end_rank_now(code: int) -> None:
    """End this rank at once, from any thread: temporary outputs removed, `code` recorded, no unwinding."""
    for path in list(_partials):
        _remove_path(path)
    os._exit(record_exit(code))


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
    leaves this rank's pid for the launcher (`_HangWatch`). Call it from the main thread.
    """
    parent = _launcher_pid()
    if parent is None or not under_torchrun() or threading.current_thread() is not threading.main_thread():
        return
    folder = os.environ.get(ENV_EXIT_DIR)
    if folder:
        with suppress(OSError), open(os.path.join(folder, f"pid-{env_rank()}"), "w") as f:
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
        time.sleep(_POLL_S)
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


def _remove_path(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _names_in(folder: str) -> list[str]:
    """The files in `folder`; none when it is gone (a rank that took a stray `_PARENT_DIED` removed it)."""
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


def _remove_noted_partials(folder: str) -> None:
    for name in _names_in(folder):
        if name.startswith("partial-"):
            with open(os.path.join(folder, name)) as f:
                _remove_path(f.read())


def _recorded_codes(folder: str) -> dict[int, int]:
    """rank → the exit code it chose (`record_exit`)."""
    return _numbers_in(folder, "rank")


def _rank_pids(folder: str) -> dict[int, int]:
    """rank → its pid (`end_with_parent`)."""
    return _numbers_in(folder, "pid-")


def _numbers_in(folder: str, prefix: str) -> dict[int, int]:
    """rank → the number in each file `<prefix><rank>` of `folder`."""
    numbers = {}
    for name in _names_in(folder):
        if not name.startswith(prefix):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                numbers[int(name.removeprefix(prefix))] = int(f.read())
        except (OSError, ValueError):
            continue
    return numbers


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: not ours to judge, taken as alive
        pass
    return True


class _HangWatch:
    """In the launcher: end the ranks that still run `_HUNG_AFTER_S` after another ended with a code of its own.

    A rank that chose its exit code and ended (a collective that timed out, an error) makes torchrun's agent
    SIGTERM the others, which end within `UNWIND_S`; one that does not is hung (stopped, or stuck where not
    even `_ExitIfStuck` runs), and the agent would give it 30 s before its SIGKILL, then report it as
    killed. This thread sends that SIGKILL after `_HUNG_AFTER_S` and remembers the rank (`hung`) for
    `_exit_code_of`.
    """

    def __init__(self, folder: str):
        self.hung: set[int] = set()
        self._folder = folder
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pan2-hang-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        since = None
        while not self._done.wait(_POLL_S):
            pids, codes = _rank_pids(self._folder), _recorded_codes(self._folder)
            if since is None:
                if any(rank in pids and not _alive(pids[rank]) for rank in codes):
                    since = time.monotonic()
                continue
            if time.monotonic() - since < _HUNG_AFTER_S:
                continue
            for rank, pid in pids.items():
                if rank not in codes and _alive(pid):
                    self.hung.add(rank)
                    with suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            return

    def stop(self) -> set[int]:
        """Stop watching; returns the ranks found hung."""
        self._done.set()
        self._thread.join()
        return self.hung


def _exit_code_of(failures: dict, recorded: dict[int, int], hung: set[int] = frozenset()) -> int:
    """The code to exit with after a failed run, printing one `Error:` line where no rank said why.

    In order: a rank's own error (2, 1), lowest rank first, which that rank printed; then ranks that hung
    (`_HangWatch`), exit 1; then a rank that died without choosing a code (killed by a signal, say): the
    first to die is named, exit 1; then a collective that waited longer than PAN2_DIST_TIMEOUT, exit 1;
    then 130 (ranks stopped by Ctrl-C or SIGTERM); then ranks that lost contact with each other, exit 1.
    A rank that chose its code is never counted as killed, whatever the code.

    Args:
        failures: torchrun's per-rank failures: `.exitcode` (−N: killed by signal N; −15 for the
            ranks torchrun stopped itself) and `.timestamp` (when torchrun saw it, in whole seconds).
        recorded: the codes the ranks chose themselves (`record_exit`), which win.
        hung: the ranks `_HangWatch` ended.
    """
    codes = {rank_: failure.exitcode for rank_, failure in failures.items()}
    codes.update(recorded)
    reported = [codes[r] for r in sorted(codes) if codes[r] in (EXIT_BAD_INPUT, EXIT_FAILURE)]
    if reported:
        return reported[0]
    timed_out = sorted(r for r, code in codes.items() if code == _EXIT_PEER_TIMED_OUT)
    seconds = f"{ENV_TIMEOUT}={_timeout().total_seconds():g} s"
    hung = sorted(r for r in hung if r not in recorded)
    if hung:
        it = "it" if len(hung) == 1 else "them"
        waited = (
            f"{_ranks(timed_out)} waited {seconds} for {it}" if timed_out else f"{it} did not stop when asked"
        )
        _echo_err(f"Error: {_ranks(hung)} hung: {waited}, and pan2 ended {it}")
        if timed_out:
            _echo_err(
                f"Hint: if a step legitimately takes longer, raise {ENV_TIMEOUT} (seconds, default 300)"
            )
        return EXIT_FAILURE
    died = [r for r in failures if r not in recorded]
    if died:
        # Timestamps tie within a second: then a signal other than torchrun's own SIGTERM came first.
        first = min(died, key=lambda r: (failures[r].timestamp, failures[r].exitcode == -signal.SIGTERM, r))
        _echo_err(f"Error: rank {first} {_how_it_ended(failures[first].exitcode)}")
        return EXIT_FAILURE
    if timed_out:
        # the cause, before the 130s of the ranks torchrun then stopped
        _echo_err(f"Error: {_ranks(timed_out)} waited longer than {seconds} for the other ranks")
        return EXIT_FAILURE
    if EXIT_INTERRUPTED in codes.values():
        _echo_err("Interrupted.")
        return EXIT_INTERRUPTED
    if _EXIT_PEER_LOST in codes.values():
        _echo_err(
            f"Error: the ranks lost contact with each other (a rank died, or a collective waited longer than {seconds})"
        )
    else:
        _echo_err(f"Error: a rank stopped unexpectedly (exit codes {sorted(codes.items())})")
    return EXIT_FAILURE


def _ranks(ranks: Sequence[int]) -> str:
    """`rank 1` or `ranks 0, 2`."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _how_it_ended(exit_code: int) -> str:
    if exit_code >= 0:
        return f"exited with code {exit_code} without an error message"
    try:
        name = signal.Signals(-exit_code).name
    except ValueError:
        name = "unknown"
    return f"was killed by signal {-exit_code} ({name})"


def _echo_err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def launch(nproc: int, args: Sequence[str]) -> int:
    """Run `python -m pan2cli ARGS` in `nproc` processes under torchrun's agent (in this process).

    The same as `python -m torch.distributed.run --standalone --nproc-per-node NPROC -m pan2cli ARGS`,
    except that torchrun's own failure report stays off the terminal, the exit code is the failing
    rank's (2 bad input, 1 otherwise, 130 interrupted, 143 terminated) instead of torchrun's 1 for any
    failure, a hung rank is named and ended after `_HUNG_AFTER_S` instead of 30 s, and torchrun's run
    folder (`--log-dir`, else `/tmp/torchelastic_*`) is made inside pan2's own temporary folder, which
    goes at the end.

    Args:
        nproc: processes to start (≥ 2).
        args: the pan2 command line, without `--gpus`.

    Returns:
        The exit code for this process.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # The agent passes this process's environment to the workers (NCCL_NVLS_ENABLE and any other NCCL
    # setting travel the same way, untouched).
    os.environ[ENV_PARENT] = str(os.getpid())
    if "OMP_NUM_THREADS" not in os.environ:
        # torchrun would set 1 thread per worker; CPU ranks share the cores instead.
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    _quiet_torchrun_logs()
    with tempfile.TemporaryDirectory(prefix="pan2-ranks-", ignore_cleanup_errors=True) as folder:
        os.environ[ENV_EXIT_DIR] = folder
        torchrun_args = [
            "--standalone",
            "--nproc-per-node",
            str(nproc),
            "--log-dir",
            os.path.join(folder, "torchelastic"),
        ]
        hang_watch = _HangWatch(folder)
        try:
            config = parse_args([*torchrun_args, "-m", "pan2cli", *args])
            _quiet_torchrun_logs()
            run(config)
        except ChildFailedError as exc:
            return _exit_code_of(exc.failures, _recorded_codes(folder), hang_watch.stop())
        except (SignalException, KeyboardInterrupt) as exc:
            # The agent has sent the signal on to the workers, which remove their temporary files.
            if isinstance(exc, Terminated) or getattr(exc, "sigval", None) == signal.SIGTERM:
                _echo_err("Terminated.")
                return EXIT_TERMINATED
            _echo_err("Interrupted.")
            return EXIT_INTERRUPTED
        except Exception as exc:  # the agent itself failed (rendezvous, a port in use, ...)
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise Pan2Error(f"torchrun's agent could not run the {nproc} processes: {reason}") from exc
        finally:
            hang_watch.stop()
            del os.environ[ENV_EXIT_DIR]
            _remove_noted_partials(folder)
    return 0
