"""Options shared by several commands (device, dtype, quiet, gpus); their values resolve in pan2cli.devices."""

from __future__ import annotations

import click

from pan2cli.constants import DTYPE_NAMES

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
