"""Self-launch under torchrun's agent (`pan2 ... --gpus N`), and what torchrun tells each rank through the environment.

The only reader of torchrun's environment (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE; LOCAL_RANK in
`pan2cli.distributed.process_group`) and of pan2's own (PAN2_DIST_*). When pan2 launched torchrun, the parent
runs torchrun's agent in-process, keeps its log lines off the terminal, and exits with the code of the
failing rank (torchrun alone would exit 1 and print a report); a rank that died without a word (killed by a
signal) is named by the parent — the first to die, from torchrun's per-rank failures — with exit 1. Each
rank leaves the code it chose (`record_exit`) and notes its temporary outputs (`partial_output`) in a
folder of the parent's. The process group and the failure protocol: `pan2cli.distributed`.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
from contextlib import contextmanager
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
# Set by pan2's own launcher for its workers: a parent will report the outcome, and each rank
# writes the exit code it chose into this folder (torchrun may kill it before it exits).
ENV_PARENT = "PAN2_DIST_PARENT"
ENV_EXIT_DIR = "PAN2_DIST_EXIT_DIR"
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
# Exit code of a worker whose collective failed without an error of its own (pan2's launcher only;
# never a user-visible code: the parent maps it to 1 and prints one line).
_EXIT_PEER_LOST = 3

_partials: list[str] = []  # this rank's temporary outputs being written (`partial_output`)


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
    return os.environ.get(ENV_PARENT) == "1"


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

    A rank stuck in a CUDA wait cannot run its signal handlers, so its writer cannot remove the
    temporary file: its `_ExitIfStuck` thread removes what is noted here before it ends
    the rank, and pan2's launcher does if the rank was killed outright.
    """
    if path is None or not under_torchrun():
        yield
        return
    path = os.path.abspath(path)
    _partials.append(path)
    folder = os.environ.get(ENV_EXIT_DIR)
    note = os.path.join(folder, f"partial-{env_rank()}-{os.getpid()}") if folder else None
    if note:
        with open(note, "w") as f:
            f.write(path)
    try:
        yield
    finally:
        _partials.remove(path)
        if note:
            os.remove(note)


def _remove_path(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.remove(path)


def _remove_noted_partials(folder: str) -> None:
    for name in os.listdir(folder):
        if name.startswith("partial-"):
            with open(os.path.join(folder, name)) as f:
                _remove_path(f.read())


def _recorded_codes(folder: str) -> dict[int, int]:
    codes = {}
    for name in os.listdir(folder):
        if not name.startswith("rank"):
            continue
        try:
            with open(os.path.join(folder, name)) as f:
                codes[int(name.removeprefix("rank"))] = int(f.read())
        except (OSError, ValueError):
            continue
    return codes


def _exit_code_of(failures: dict, recorded: dict[int, int]) -> int:
    """The code to exit with after a failed run, printing one `Error:` line where no rank said why.

    In order: a rank's own error (2, 1), lowest rank first, which that rank printed; then a rank that
    died without choosing a code (killed by a signal, say): the first to die is named, exit 1; then 130
    (ranks stopped by Ctrl-C); then ranks that lost contact with each other, exit 1.

    Args:
        failures: torchrun's per-rank failures: `.exitcode` (−N: killed by signal N; −15 for the
            ranks torchrun stopped itself) and `.timestamp` (when torchrun saw it, in whole seconds).
        recorded: the codes the ranks chose themselves (`record_exit`), which win.
    """
    codes = {rank_: failure.exitcode for rank_, failure in failures.items()}
    codes.update(recorded)
    reported = [codes[r] for r in sorted(codes) if codes[r] in (EXIT_BAD_INPUT, EXIT_FAILURE)]
    if reported:
        return reported[0]
    died = [r for r in failures if r not in recorded]
    if died:
        # Timestamps tie within a second: then a signal other than torchrun's own SIGTERM came first.
        first = min(died, key=lambda r: (failures[r].timestamp, failures[r].exitcode == -signal.SIGTERM, r))
        _echo_err(f"Error: rank {first} {_how_it_ended(failures[first].exitcode)}")
        return EXIT_FAILURE
    if EXIT_INTERRUPTED in codes.values():
        return EXIT_INTERRUPTED
    if _EXIT_PEER_LOST in codes.values():
        _echo_err(
            "Error: the ranks lost contact with each other (a rank died, or a collective waited longer "
            f"than {ENV_TIMEOUT}={_timeout().total_seconds():g} s)"
        )
    else:
        _echo_err(f"Error: a rank stopped unexpectedly (exit codes {sorted(codes.items())})")
    return EXIT_FAILURE


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
    except that torchrun's own failure report stays off the terminal and the exit code is the failing
    rank's (2 bad input, 1 otherwise, 130 interrupted, 143 terminated) instead of torchrun's 1 for any
    failure.

    Args:
        nproc: processes to start (≥ 2).
        args: the pan2 command line, without `--gpus`.

    Returns:
        The exit code for this process.
    """
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    os.environ[ENV_PARENT] = "1"  # the agent passes this process's environment to the workers
    # (NCCL_NVLS_ENABLE and any other NCCL setting travel the same way, untouched.)
    if "OMP_NUM_THREADS" not in os.environ:
        # torchrun would set 1 thread per worker; CPU ranks share the cores instead.
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    torchrun_args = ["--standalone", "--nproc-per-node", str(nproc), "-m", "pan2cli", *args]
    _quiet_torchrun_logs()
    with tempfile.TemporaryDirectory(prefix="pan2-ranks-") as folder:
        os.environ[ENV_EXIT_DIR] = folder
        try:
            config = parse_args(torchrun_args)
            _quiet_torchrun_logs()
            run(config)
        except ChildFailedError as exc:
            return _exit_code_of(exc.failures, _recorded_codes(folder))
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
            del os.environ[ENV_EXIT_DIR]
            _remove_noted_partials(folder)
    return 0
