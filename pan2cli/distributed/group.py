"""Several processes decoding together: the process group, agreement, failure handling, and the few collectives the row split needs.

Every torch.distributed call of pan2 lives here; the model only sees `pan2cli.vae.parallel.RowSplit`. Starting
the processes (`pan2 ... --gpus N`) and reading torchrun's environment: `pan2cli.launch`.

Failure protocol. Ranks meet at sync points (`raise_if_any_failed`, after the input checks and the
model load): one all-reduce of the exit codes. If every rank failed (the same bad input everywhere),
rank 0 prints its error and the others exit quietly with their code; otherwise each failing rank
prints its own error and the healthy ones exit quietly with the highest code. A failure inside the
decode (out of memory on one rank) is printed by that rank; torchrun then stops the others (SIGTERM,
which they turn into a quiet exit) or their next collective fails (a quiet exit too when pan2 itself
launched torchrun; its parent prints one line if no rank did). A rank stopped by a signal it cannot
see at once (its main thread waits inside NCCL) ends itself `launch.UNWIND_S` seconds later (`_ExitIfStuck`),
before torchrun's 30 s SIGKILL. What the parent does when pan2 launched torchrun: `pan2cli.launch`.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from pan2cli import launch
from pan2cli.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_TERMINATED, InputError, Pan2Error

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
                f"rank {launch.env_rank()} needs cuda:{local_rank}, but only {torch.cuda.device_count()} GPU(s) are visible"
            )
        backend, this_device = "nccl", torch.device("cuda", local_rank)
        torch.cuda.set_device(this_device)
    else:
        raise InputError(
            f"--device {device!r} cannot be used with several processes",
            hint="pass --device cuda (rank r uses cuda:LOCAL_RANK) or --device cpu",
        )
    timeout = launch._timeout()
    kwargs = {"device_id": this_device} if backend == "nccl" else {}
    watch = _ExitIfStuck()  # a rendezvous waits in C++ too
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


class _ExitIfStuck:
    """After Ctrl-C or SIGTERM, end this rank (or single process) `launch.UNWIND_S` seconds later unless it has left
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
        if self._left.wait(launch.UNWIND_S):
            return
        code, line = self._exit_for(signum)
        if line:
            launch._echo_err(line)
        launch.end_rank_now(code)

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
    """A single process's command: after Ctrl-C or SIGTERM it ends within `launch.UNWIND_S` seconds, its temporary
    outputs removed, even when its main thread is inside one long torch op (`_ExitIfStuck`)."""
    watch = _ExitIfStuck(_single_process_exit)
    try:
        yield
    finally:
        watch.close()


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


def _comm_device() -> torch.device:
    return _device if _device is not None else torch.device("cpu")


# -- agreement and failures -----------------------------------------------------------------------
def agree_all(flag: bool) -> bool:
    """True only if every rank passes True (all-reduce MIN); `flag` itself in a single process."""
    if world_size() == 1:
        return bool(flag)
    value = torch.tensor([int(bool(flag))], dtype=torch.int32, device=_comm_device())
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


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
    codes = torch.tensor([code, -code], dtype=torch.int32, device=_comm_device())
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


def interrupted_exit() -> tuple[int, str | None]:
    """`(exit code, line to print)` of a rank stopped by Ctrl-C or torchrun's SIGTERM."""
    # pan2's launcher prints "Interrupted." once; under a user's torchrun, rank 0 does.
    return (
        EXIT_INTERRUPTED,
        None if launch.has_parent_launcher() or launch.env_rank() != 0 else "Interrupted.",
    )


def _comm_error_exit(error: BaseException) -> tuple[int, str | None]:
    # Usually another rank failed and printed why; pan2's launcher says so if none did, or names a hung rank.
    if launch.has_parent_launcher():
        return (launch._EXIT_PEER_TIMED_OUT if _is_timeout(error) else launch._EXIT_PEER_LOST), None
    return (
        EXIT_FAILURE,
        f"Error: rank {launch.env_rank()} lost contact with the other ranks: {str(error).splitlines()[0]}",
    )


def _is_timeout(error: BaseException) -> bool:
    """A collective that waited PAN2_DIST_TIMEOUT for a peer (gloo: "Timed out waiting 10000ms for recv ...")."""
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def reports_error(error: BaseException) -> bool:
    """Whether this rank prints its own `error`: always once the process group was joined; before, rank 0
    only (nothing rank-specific has happened yet, so every rank has the same error)."""
    return not launch.under_torchrun() or launch.env_rank() == 0 or _joined


# -- collectives for the row split ----------------------------------------------------------------
class NeighbourSwap:
    """Rows in flight to/from the ranks above (rank − 1) and below (rank + 1); `wait()` returns what came."""

    def __init__(self, to_above: torch.Tensor | None, to_below: torch.Tensor | None):
        r = rank()
        ops = []
        self.from_above = self.from_below = None
        if to_above is not None:
            to_above = to_above.contiguous()
            self.from_above = torch.empty_like(to_above)
            ops += [dist.P2POp(dist.isend, to_above, r - 1), dist.P2POp(dist.irecv, self.from_above, r - 1)]
        if to_below is not None:
            to_below = to_below.contiguous()
            self.from_below = torch.empty_like(to_below)
            ops += [dist.P2POp(dist.isend, to_below, r + 1), dist.P2POp(dist.irecv, self.from_below, r + 1)]
        self._sent = (to_above, to_below)  # alive until the sends complete
        self._requests = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        for request in self._requests:
            request.wait()
        return self.from_above, self.from_below


def all_gather_uneven(x: torch.Tensor, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order, where rank r's `x.shape[dim]` is `sizes[r]`.

    Collectives want equal shapes: each rank pads to `max(sizes)`, the padding is dropped after.

    Args:
        x: this rank's part, `x.shape[dim] == sizes[rank]`; the other dims equal on every rank.
        dim: the dimension to concatenate along.
        sizes: every rank's size along `dim`.

    Returns:
        The whole tensor, `sum(sizes)` along `dim`, on `x`'s device.
    """
    if len(sizes) == 1:
        return x
    dim = dim % x.dim()
    most = max(sizes)
    if x.shape[dim] == most:
        padded = x.contiguous()
    else:
        shape = list(x.shape)
        shape[dim] = most
        padded = x.new_zeros(shape)
        padded.narrow(dim, 0, x.shape[dim]).copy_(x)
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([part.narrow(dim, 0, size) for part, size in zip(parts, sizes)], dim=dim)


# -- helpers for `pan2 generate` ------------------------------------------------------------------
def broadcast_from_main(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every rank (same shape and dtype everywhere), on `x`'s device; `x` itself in one process."""
    if world_size() == 1:
        return x
    y = x.to(_comm_device()).contiguous()
    dist.broadcast(y, 0)
    return y.to(x.device)


def gather_equal(x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `x` (same shape and dtype everywhere), in rank order, on `x`'s device; `[x]` in one process."""
    if world_size() == 1:
        return [x]
    y = x.to(_comm_device()).contiguous()
    pieces = [torch.empty_like(y) for _ in range(world_size())]
    dist.all_gather(pieces, y)
    return [piece.to(x.device) for piece in pieces]


def sum_all(value: int) -> int:
    """The sum of `value` over the ranks (all-reduce SUM); `value` itself in a single process."""
    if world_size() == 1:
        return value
    total = torch.tensor([value], dtype=torch.int64, device=_comm_device())
    dist.all_reduce(total)
    return int(total.item())


def wait_for_all(tag: str, poll_s: float = 1.0) -> None:
    """Wait, without a collective's timeout, until every rank reached this point (ranks of a sharded batch
    finish minutes apart, longer than PAN2_DIST_TIMEOUT). A counter in torchrun's store; no-op in one process."""
    if world_size() == 1:
        return
    import time

    store = dist.distributed_c10d._get_default_store()  # the rendezvous store every rank already shares
    key = f"pan2/{tag}"
    store.add(key, 1)
    while store.add(key, 0) < world_size():
        time.sleep(poll_s)
