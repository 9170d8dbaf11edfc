"""What pan2's launcher and its ranks agree on: the environment torchrun and the launcher set, the exit codes and
files a rank leaves for the launcher, and the timings both sides keep.

The only reader of torchrun's environment (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE; LOCAL_RANK in
`group.process_group`) and of pan2's own (PAN2_DIST_*). No torch: `pan2 --help` may read it.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

from pan2cli.errors import InputError

# Seconds a collective may wait for the other ranks before it fails (a rank died or hangs).
ENV_TIMEOUT = "PAN2_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 300.0
# Set by pan2's own launcher for its workers: the launcher's pid (a parent will report the outcome), and
# the folder where each rank writes the exit code it chose (torchrun may kill it before it exits).
ENV_PARENT = "PAN2_DIST_PARENT"
ENV_EXIT_DIR = "PAN2_DIST_EXIT_DIR"
_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")

# Files a rank leaves in the launcher's folder (`ENV_EXIT_DIR`): `rank<r>` the exit code it chose, `pid-<r>`
# its pid, `partial-<r>-<pid>` the path of a temporary output being written.
EXIT_CODE_FILE = "rank"
PID_FILE = "pid-"
PARTIAL_FILE = "partial-"
# Exit codes of a worker whose collective failed without an error of its own: the peer is gone, or it
# did not answer within PAN2_DIST_TIMEOUT (pan2's launcher only; never user-visible: the launcher maps
# them to 1 and prints one line).
EXIT_PEER_LOST = 3
EXIT_PEER_TIMED_OUT = 4

# Seconds a rank stopped by Ctrl-C or SIGTERM has to unwind before it leaves without its main thread,
# which may be stuck in a wait that signal handlers cannot interrupt (NCCL, for a peer that died).
UNWIND_S = 3.0
POLL_S = 0.2  # how often the launcher looks at the ranks' folder, and a rank at its launcher's pid


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


def launcher_pid() -> int | None:
    """The pid of pan2's launcher that started this rank, else None."""
    raw = os.environ.get(ENV_PARENT, "")
    return int(raw) if raw.isdigit() and int(raw) > 0 else None


def has_parent_launcher() -> bool:
    """Whether pan2's own launcher started this rank (and reports the outcome)."""
    return launcher_pid() is not None


def collective_timeout() -> timedelta:
    """How long a collective waits for the other ranks: `PAN2_DIST_TIMEOUT` seconds, default 300.

    Raises:
        InputError: the variable is not a positive number.
    """
    raw = os.environ.get(ENV_TIMEOUT)
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        raise InputError(f"{ENV_TIMEOUT}={raw!r} is not a number of seconds") from None
    if seconds <= 0:
        raise InputError(f"{ENV_TIMEOUT}={raw!r} must be positive")
    return timedelta(seconds=seconds)


def echo_err(line: str) -> None:
    """Print one line to stderr at once (a rank or the launcher may end right after it)."""
    print(line, file=sys.stderr, flush=True)
