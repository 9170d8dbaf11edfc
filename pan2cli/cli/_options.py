"""Options shared by several commands (device, dtype, decode kernel, MP4 quality, overwrite, quiet, gpus); their
values resolve in pan2cli.devices and pan2cli.config."""

from __future__ import annotations

from pathlib import Path

import click

from pan2cli.config import DECODE_KERNEL_MODES
from pan2cli.constants import DTYPE_NAMES
from pan2cli.outputs import DEFAULT_CRF, fps_problem

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
decode_kernel_option = click.option(
    "--decode-kernel",
    type=click.Choice(DECODE_KERNEL_MODES),
    default="auto",
    show_default=True,
    help="The compiled CUDA decoder (bf16, sm_90a/sm_100a/sm_103a; built on first use and cached): auto uses it "
    "where it applies and says why not on a GPU, off always runs the reference PyTorch decoder, require fails "
    "when the kernel cannot run.",
)
crf_option = click.option(
    "--crf",
    type=click.IntRange(0, 51),
    default=DEFAULT_CRF,
    show_default=True,
    help="H.264 quality for MP4 (0 lossless, 51 worst; 17 is visually lossless).",
)
overwrite_option = click.option(
    "--overwrite", is_flag=True, help="Replace existing outputs (otherwise they are an error)."
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
