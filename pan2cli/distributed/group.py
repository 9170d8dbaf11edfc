"""The process group of several ranks, and the failure protocol that keeps them together.

Every torch.distributed call of pan2 lives in this package (the collectives: `collectives`); the model only sees
`pan2cli.vae.parallel.RowSplit`. Starting the processes (`pan2 ... --gpus N`): `launcher`; torchrun's
environment: `protocol`; how a rank ends: `lifecycle`.

Failure protocol. Ranks meet at sync points (`raise_if_any_failed`, after the input checks and the
model load): one all-reduce of the exit codes. If every rank failed (the same bad input everywhere),
rank 0 prints its error and the others exit quietly with their code; otherwise each failing rank
prints its own error and the healthy ones exit quietly with the highest code. A failure inside the
decode (out of memory on one rank) is printed by that rank; torchrun then stops the others (SIGTERM,
which they turn into a quiet exit) or their next collective fails (a quiet exit too when pan2 itself
launched torchrun; its launcher prints one line if no rank did). A rank stopped by a signal it cannot
see at once (its main thread waits inside NCCL) ends itself `protocol.UNWIND_S` seconds later
(`lifecycle.ExitIfStuck`), before torchrun's 30 s SIGKILL.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from typing import Iterator

import torch
import torch.distributed as dist

from pan2cli.distributed.lifecycle import ExitIfStuck, interrupted_exit
from pan2cli.distributed.protocol import (
    EXIT_PEER_LOST,
    EXIT_PEER_TIMED_OUT,
    collective_timeout,
    env_rank,
    has_parent_launcher,
    under_torchrun,
)
from pan2cli.errors import EXIT_FAILURE, EXIT_INTERRUPTED, InputError, Pan2Error

_device: torch.device | None = None  # this rank's device once the process group is up
_joined = False  # the process group was joined (errors from then on are each rank's own)


class WorkerExit(Exception):
    """End this rank with `exit_code`, printing `line` (if any) instead of an error of its own."""

    def __init__(self, exit_code: int, line: str | None = None):
        super().__init__(line or f"exit code {exit_code}")
        self.exit_code = exit_code
        self.line = line


class PeerFailed(WorkerExit):
    """Another rank failed (and reports it); this rank exits quietly with the code."""


# -- ranks ----------------------------------------------------------------------------------------
def world_size() -> int:
    """Ranks in the process group; 1 when none is initialised."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def is_main() -> bool:
    """Rank 0, the one that writes files and prints results (True in a single process)."""
    return rank() == 0


# -- process group --------------------------------------------------------------------------------
@contextmanager
def process_group(device: str | None) -> Iterator[torch.device]:
    """Join torchrun's process group for the duration of a command.

    NCCL with device cuda:LOCAL_RANK on CUDA, gloo on CPU; collectives time out after
    `PAN2_DIST_TIMEOUT` seconds (default 300). Ctrl-C, or torchrun's SIGTERM (which the CLI turns
    into `Terminated`), ends the rank quietly with 130 once temporary outputs are removed.

    Args:
        device: the `--device` value (`cpu`, `cuda`, or None: cuda when available).

    Yields:
        This rank's device.

    Raises:
        InputError: `--device cuda:N` (each rank takes cuda:LOCAL_RANK), or CUDA requested but absent.
    """
    global _device, _joined
    local_rank = int(os.environ["LOCAL_RANK"])
    name = (device or ("cuda" if torch.cuda.is_available() else "cpu")).strip().lower()
    if name == "cpu":
        backend, this_device = "gloo", torch.device("cpu")
    elif name == "cuda":
        if not torch.cuda.is_available():
            raise InputError("--device cuda: CUDA is not available on this machine", hint="pass --device cpu")
        if local_rank >= torch.cuda.device_count():
            raise InputError(
                f"rank {env_rank()} needs cuda:{local_rank}, but only {torch.cuda.device_count()} GPU(s) are visible"
            )
        backend, this_device = "nccl", torch.device("cuda", local_rank)
        torch.cuda.set_device(this_device)
    else:
        raise InputError(
            f"--device {device!r} cannot be used with several processes",
            hint="pass --device cuda (rank r uses cuda:LOCAL_RANK) or --device cpu",
        )
    timeout = collective_timeout()
    kwargs = {"device_id": this_device} if backend == "nccl" else {}
    watch = ExitIfStuck()  # a rendezvous waits in C++ too
    try:
        dist.init_process_group(backend, timeout=timeout, **kwargs)
    except BaseException:
        watch.close()
        raise
    _device, _joined = this_device, True
    # After a failure a collective may still be in flight (a peer waits for our halo rows): NCCL's
    # teardown could then hang, so the group is left to the process's end. gloo's is safe and needed:
    # left alone, its threads abort the process at exit, which loses the exit code.
    destroy, succeeded = True, False
    try:
        yield this_device
        succeeded = True
    except KeyboardInterrupt as exc:  # Ctrl-C or torchrun's SIGTERM; outputs were aborted on the way
        destroy = False
        raise WorkerExit(*interrupted_exit()) from exc
    except Exception as exc:
        destroy = backend == "gloo" and not is_comm_error(exc)
        if is_comm_error(exc):
            raise WorkerExit(*_comm_error_exit(exc)) from exc
        raise
    finally:
        _device = None
        watch.close()
        if destroy and dist.is_initialized():
            # After a failure, leave at once: the peers' pending collectives then fail fast.
            _leave_together() if succeeded else dist.destroy_process_group()


def _leave_together() -> None:
    """Tear the group down on every rank before any rank exits.

    A rank that exits closes its sockets; a peer still inside gloo's teardown can then abort
    (SIGABRT, "terminate called without an active exception"), seen with two torchrun agents on one
    machine. So: all ranks arrive, all destroy the group, all confirm through the store, then exit.
    """
    store = dist.distributed_c10d._get_default_store()
    world = dist.get_world_size()
    try:
        store.add("pan2/teardown/arrived", 1)
        while store.add("pan2/teardown/arrived", 0) < world:
            time.sleep(0.05)
        dist.destroy_process_group()
        store.add("pan2/teardown/left", 1)
        while store.add("pan2/teardown/left", 0) < world:
            time.sleep(0.05)
    except Exception:  # a peer already gone: nothing left to coordinate with
        if dist.is_initialized():
            dist.destroy_process_group()


def comm_device() -> torch.device:
    """Where this rank's collectives run: its device in the process group (the CPU outside one)."""
    return _device if _device is not None else torch.device("cpu")


# -- failures ---------------------------------------------------------------------------------------
def exit_code_of(error: BaseException | None) -> int:
    """The exit code an error gives in a single process (0 for None)."""
    if error is None:
        return 0
    if isinstance(error, Pan2Error):
        return error.exit_code
    if isinstance(error, KeyboardInterrupt):
        return EXIT_INTERRUPTED
    return EXIT_FAILURE


def raise_if_any_failed(error: BaseException | None) -> None:
    """Sync point: if any rank failed, stop every rank before anyone enters the decode's collectives.

    Args:
        error: this rank's error since the last sync point, or None.

    Raises:
        the rank's own `error` when it should print it (it failed alone, or every rank failed and
        this is rank 0); `PeerFailed` (a quiet exit with the code) otherwise. Nothing in a single
        process without an error; `error` itself in a single process with one.
    """
    if world_size() == 1:
        if error is not None:
            raise error
        return
    code = exit_code_of(error)
    # One MAX all-reduce gives the highest code and (negated) the lowest: lowest > 0 means all failed.
    codes = torch.tensor([code, -code], dtype=torch.int32, device=comm_device())
    dist.all_reduce(codes, op=dist.ReduceOp.MAX)
    highest, lowest = int(codes[0]), -int(codes[1])
    if highest == 0:
        return
    if error is None:
        raise PeerFailed(highest)
    if lowest > 0 and rank() != 0:
        raise PeerFailed(code)  # the same failure everywhere: rank 0 reports it
    raise error


def is_comm_error(error: BaseException) -> bool:
    """A failed collective (a peer died, a timeout), as opposed to this rank's own failure."""
    if isinstance(error, getattr(dist, "DistError", ())):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(
        word in text for word in ("Gloo", "gloo", "NCCL", "Connection closed", "Timed out")
    )


def _comm_error_exit(error: BaseException) -> tuple[int, str | None]:
    # Usually another rank failed and printed why; pan2's launcher says so if none did, or names a hung rank.
    if has_parent_launcher():
        return (EXIT_PEER_TIMED_OUT if _is_timeout(error) else EXIT_PEER_LOST), None
    return (
        EXIT_FAILURE,
        f"Error: rank {env_rank()} lost contact with the other ranks: {str(error).splitlines()[0]}",
    )


def _is_timeout(error: BaseException) -> bool:
    """A collective that waited PAN2_DIST_TIMEOUT for a peer (gloo: "Timed out waiting 10000ms for recv ...")."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def reports_error(error: BaseException) -> bool:
    """Whether this rank prints its own `error`: always once the process group was joined; before, rank 0
    only (nothing rank-specific has happened yet, so every rank has the same error)."""
    return not under_torchrun() or env_rank() == 0 or _joined
