"""The `pan2` command line: one click group, a module per command.

Usage: pan2 [--debug] COMMAND ...   (`pan2 --help` lists the commands and exit codes)
"""

from __future__ import annotations

import os

import click

from pan2cli.cli._errors import Pan2Group
from pan2cli.cli.decode import decode_command
from pan2cli.cli.doctor import doctor_command
from pan2cli.cli.generate import generate_command
from pan2cli.cli.kernels import kernels_group
from pan2cli.cli.presets import presets_group
from pan2cli.version import __version__

_EPILOG = """\b
Exit codes: 0 done; 2 bad input or usage; 1 any other known failure (download, out of memory, a
rank that failed or died); 130 interrupted (Ctrl-C); 143 terminated (SIGTERM). Temporary outputs
are removed on the way out.
Known errors print one `Error:` line (and a `Hint:`); set PAN2_DEBUG=1 or pass --debug for the
traceback."""


def _set_debug(ctx, param, value):
    if value:
        os.environ["PAN2_DEBUG"] = "1"
    return value


@click.group(cls=Pan2Group, epilog=_EPILOG, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, "--version", prog_name="pan2", message="%(prog)s %(version)s")
@click.option(
    "--debug",
    is_flag=True,
    expose_value=False,
    callback=_set_debug,
    is_eager=True,
    help="Show tracebacks for known errors too.",
)
def cli():
    """pan2: run PAN 2 and decode its Wan2.2 VAE latents into video, fast.

    \b
    Examples:
      pan2 decode latents.pt -o video.mp4
      pan2 generate "a skater drops into a bowl" --preset pan2-5s -o skater.mp4
      pan2 presets list
      pan2 kernels status
      pan2 doctor
    """


cli.add_command(decode_command)
cli.add_command(generate_command)
cli.add_command(presets_group)
cli.add_command(kernels_group)
cli.add_command(doctor_command)


def main(argv: list[str] | None = None) -> None:
    """Entry point of the `pan2` script and of `python -m pan2cli`."""
    cli.main(args=argv, prog_name="pan2")
