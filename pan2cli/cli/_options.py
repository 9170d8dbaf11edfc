"""Options shared by several commands (device, dtype, quiet, gpus); their values resolve in pan2cli.devices."""

from __future__ import annotations

from pathlib import Path

import click

from pan2cli.constants import DTYPE_NAMES
from pan2cli.outputs import fps_problem

device_option = click.option(
    "--device",
    default=None,
    metavar="DEVICE",
    help="Where to run: `cuda`, `cuda:N` or `cpu`.  [default: cuda when available, else cpu]",
)
dtype_option = click.option(
    "--dtype",
    type=click.Choice(DTYPE_NAMES),
    default=None,
    help="Weights and activations: bf16 (fp32 accumulation in the convolutions) or fp32.  "
    "[default: bf16 on CUDA, fp32 on CPU]",
)
gpus_option = click.option(
    "--gpus",
    type=click.IntRange(min=1),
    default=None,
    metavar="N",
    help="Split the work across N GPUs (one process each, started through torch.distributed.run); "
    "with --device cpu, N CPU processes.  [default: 1]",
)
quiet_option = click.option(
    "-q", "--quiet", is_flag=True, help="No progress bar and no summary on stderr (errors are still printed)."
)


def check_fps(ctx, param, value):
    """`--fps`: a frame rate an MP4 carries (`pan2cli.outputs.FPS_RANGE`), refused when parsed: before anything loads."""
    if value is not None and (problem := fps_problem(value)) is not None:
        raise click.BadParameter(problem)
    return value


def ignored_revision(revision: str | None, source: str | None, flag: str) -> str | None:
    """The warning for `--revision` beside a local `--vae`/`--model` (a revision names a commit of a hub repo), or None."""
    if revision is None or source is None or not Path(source).expanduser().exists():
        return None
    return f"--revision {revision} is ignored: {flag} {source} is a local path, not a Hugging Face repo"


def parse_size(ctx, param, value):
    """`--size HxW`: (height, width) integers, checked as settings later."""
    if value is None:
        return None
    try:
        height, width = (int(part) for part in value.lower().split("x"))
    except ValueError:
        raise click.BadParameter(f"{value!r} is not HEIGHTxWIDTH, e.g. 704x1248") from None
    return height, width
