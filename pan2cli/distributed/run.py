"""Run a command's work in this process, or in N processes under torchrun (`--gpus N`), the same way for every command.

No torch at import: the commands import this module, and `pan2 --help` must not load torch."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Callable, TypeVar

from pan2cli.distributed.protocol import env_world_size, under_torchrun
from pan2cli.errors import InputError

if TYPE_CHECKING:
    import click

T = TypeVar("T")


def run_on_ranks(
    ctx: click.Context,
    gpus: int | None,
    device: str | None,
    work: Callable[[object], T],
    check_split: Callable[[int], None] | None = None,
) -> T:
    """`work(device)` here; under torchrun `work(rank_device)` inside the process group.

    With `--gpus N` (N ≥ 2) outside torchrun, the same command is re-launched in N processes and this
    process exits with their outcome (`ctx.exit`).

    Args:
        check_split: `check_split(N)` raises `InputError` when the inputs cannot be shared by N processes
            (a row split needs a latent row per process); run here before any process starts. `work`
            runs the same check on each rank, for a torchrun the user started.

    Raises:
        InputError: more GPUs than visible, inputs that N processes cannot share, or `--gpus` different
            from torchrun's world size.
    """
    # here, not at the top: they import torch, which `pan2 --help` does not need
    from pan2cli.distributed.group import process_group
    from pan2cli.distributed.launcher import check_gpus, launch, strip_option
    from pan2cli.distributed.lifecycle import end_with_parent, stop_promptly

    if gpus is not None and gpus > 1 and not under_torchrun():
        check_gpus(gpus, device)
        if check_split is not None:
            check_split(gpus)
        root = ctx.find_root()
        argv = root.obj["argv"] if isinstance(root.obj, dict) and "argv" in root.obj else sys.argv[1:]
        ctx.exit(launch(gpus, strip_option(argv, "--gpus")))
    if not under_torchrun():
        with stop_promptly():  # Ctrl-C and SIGTERM act within seconds, even inside a long torch op
            return work(device)
    end_with_parent()
    if gpus is not None and gpus != env_world_size():
        raise InputError(
            f"--gpus {gpus} differs from torchrun's {env_world_size()} processes",
            hint="leave --gpus out under torchrun",
        )
    with process_group(device) as rank_device:
        return work(rank_device)
