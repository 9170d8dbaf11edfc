"""Self-launch under torchrun's agent (`pan2 ... --gpus N`): the launcher's side of the rank protocol.

When pan2 launched torchrun, the launcher runs torchrun's agent in-process, keeps its log lines off the
terminal, and exits with the code of the failing rank (torchrun alone would exit 1 and print a report); a
rank that died without a word (killed by a signal) is named by the launcher — the first to die, from
torchrun's per-rank failures — with exit 1, and a rank still running `_HUNG_AFTER_S` after another ended with
a code of its own is named as hung and ended (torchrun would wait 30 s for it and then report it as killed).
Each rank leaves its pid and the code it chose and notes its temporary outputs in a folder of the launcher's
(`protocol`, `lifecycle`), which also holds torchrun's own run folder.
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
import threading
import time
from contextlib import suppress
from typing import Sequence

import torch

from pan2cli.distributed.lifecycle import remove_path
from pan2cli.distributed.protocol import (
    ENV_EXIT_DIR,
    ENV_PARENT,
    ENV_TIMEOUT,
    EXIT_CODE_FILE,
    EXIT_PEER_LOST,
    EXIT_PEER_TIMED_OUT,
    PARTIAL_FILE,
    PID_FILE,
    POLL_S,
    UNWIND_S,
    collective_timeout,
    echo_err,
)
from pan2cli.errors import (
    EXIT_BAD_INPUT,
    EXIT_FAILURE,
    EXIT_INTERRUPTED,
    EXIT_TERMINATED,
    InputError,
    Pan2Error,
    Terminated,
)

# A rank still running this long after another ended with a code of its own is hung: torchrun's SIGTERM
# reached it then, and a rank that can act on it is gone within UNWIND_S (`lifecycle.ExitIfStuck`), plus a
# second to exit.
_HUNG_AFTER_S = UNWIND_S + 1.0


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


def _names_in(folder: str) -> list[str]:
    """The files in `folder`; none when it is gone (a rank whose launcher seemed gone removed it)."""
    try:
        return os.listdir(folder)
    except FileNotFoundError:
        return []


def _remove_noted_partials(folder: str) -> None:
    for name in _names_in(folder):
        if name.startswith(PARTIAL_FILE):
            with open(os.path.join(folder, name)) as f:
                remove_path(f.read())


def _recorded_codes(folder: str) -> dict[int, int]:
    """rank → the exit code it chose (`record_exit`)."""
    return _numbers_in(folder, EXIT_CODE_FILE)


def _rank_pids(folder: str) -> dict[int, int]:
    """rank → its pid (`end_with_parent`)."""
    return _numbers_in(folder, PID_FILE)


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
    even `lifecycle.ExitIfStuck` runs), and the agent would give it 30 s before its SIGKILL, then report it as
    killed. This thread sends that SIGKILL after `_HUNG_AFTER_S` and remembers the rank (`hung`) for
    `exit_code_after_failure`.
    """

    def __init__(self, folder: str):
        self.hung: set[int] = set()
        self._folder = folder
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="pan2-hang-watch", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        since = None
        while not self._done.wait(POLL_S):
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


def exit_code_after_failure(failures: dict, recorded: dict[int, int], hung: set[int] = frozenset()) -> int:
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
    timed_out = sorted(r for r, code in codes.items() if code == EXIT_PEER_TIMED_OUT)
    seconds = f"{ENV_TIMEOUT}={collective_timeout().total_seconds():g} s"
    hung = sorted(r for r in hung if r not in recorded)
    if hung:
        it = "it" if len(hung) == 1 else "them"
        waited = (
            f"{_ranks(timed_out)} waited {seconds} for {it}" if timed_out else f"{it} did not stop when asked"
        )
        echo_err(f"Error: {_ranks(hung)} hung: {waited}, and pan2 ended {it}")
        if timed_out:
            echo_err(f"Hint: if a step legitimately takes longer, raise {ENV_TIMEOUT} (seconds, default 300)")
        return EXIT_FAILURE
    died = [r for r in failures if r not in recorded]
    if died:
        # Timestamps tie within a second: then a signal other than torchrun's own SIGTERM came first.
        first = min(died, key=lambda r: (failures[r].timestamp, failures[r].exitcode == -signal.SIGTERM, r))
        echo_err(f"Error: rank {first} {_how_it_ended(failures[first].exitcode)}")
        return EXIT_FAILURE
    if timed_out:
        # the cause, before the 130s of the ranks torchrun then stopped
        echo_err(f"Error: {_ranks(timed_out)} waited longer than {seconds} for the other ranks")
        return EXIT_FAILURE
    if EXIT_INTERRUPTED in codes.values():
        echo_err("Interrupted.")
        return EXIT_INTERRUPTED
    if EXIT_PEER_LOST in codes.values():
        echo_err(
            f"Error: the ranks lost contact with each other (a rank died, or a collective waited longer than {seconds})"
        )
    else:
        echo_err(f"Error: a rank stopped unexpectedly (exit codes {sorted(codes.items())})")
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
            return exit_code_after_failure(exc.failures, _recorded_codes(folder), hang_watch.stop())
        except (SignalException, KeyboardInterrupt) as exc:
            # The agent has sent the signal on to the workers, which remove their temporary files.
            if isinstance(exc, Terminated) or getattr(exc, "sigval", None) == signal.SIGTERM:
                echo_err("Terminated.")
                return EXIT_TERMINATED
            echo_err("Interrupted.")
            return EXIT_INTERRUPTED
        except Exception as exc:  # the agent itself failed (rendezvous, a port in use, ...)
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise Pan2Error(f"torchrun's agent could not run the {nproc} processes: {reason}") from exc
        finally:
            hang_watch.stop()
            del os.environ[ENV_EXIT_DIR]
            _remove_noted_partials(folder)
    return 0
