"""Several processes working together: the launcher, each rank's life, the process group and the collectives.

`launcher` starts `pan2 ... --gpus N` under torchrun's agent and turns the ranks' ends into one exit code;
`protocol` is what the launcher and its ranks agree on (torchrun's environment, exit codes, files, timings);
`lifecycle` how a rank ends (its exit code, its temporary outputs, Ctrl-C inside a long op, a dead launcher);
`group` the process group and the failure protocol; `collectives` what the ranks exchange; `run` runs a
command's work on one process or on N ranks. Every torch.distributed call and every reader of torchrun's
environment is in this package.

`pan2cli.distributed.NAME` reaches the public names below from their modules, imported on first use: a module
of this package (`protocol`, `run`) imports no torch, and `pan2 --help` reads them.
"""

from __future__ import annotations

_GROUP = (
    "PeerFailed", "WorkerExit", "exit_code_of", "is_comm_error", "is_main", "process_group", "raise_if_any_failed",
    "rank", "reports_error", "world_size",
)  # fmt: skip
_COLLECTIVES = (
    "NeighbourSwap", "agree_all", "all_gather_uneven", "broadcast_from_main", "gather_equal", "sum_all",
    "wait_for_all",
)  # fmt: skip
_LIFECYCLE = ("end_with_parent", "interrupted_exit", "partial_output", "record_exit", "stop_promptly")
_PROTOCOL = ("env_local_world_size", "env_rank", "env_world_size", "under_torchrun")
_LAUNCHER = ("check_gpus", "launch", "strip_option")
__all__ = [*_GROUP, *_COLLECTIVES, *_LIFECYCLE, *_PROTOCOL, *_LAUNCHER, "run_on_ranks"]


def __getattr__(name: str):
    if name in _GROUP:
        from pan2cli.distributed import group as module
    elif name in _COLLECTIVES:
        from pan2cli.distributed import collectives as module
    elif name in _LIFECYCLE:
        from pan2cli.distributed import lifecycle as module
    elif name in _PROTOCOL:
        from pan2cli.distributed import protocol as module
    elif name in _LAUNCHER:
        from pan2cli.distributed import launcher as module
    elif name == "run_on_ranks":
        from pan2cli.distributed import run as module
    else:
        raise AttributeError(f"module 'pan2cli.distributed' has no attribute {name!r}")
    return getattr(module, name)
