"""Write a tiny random-weight PAN 2 repository in the IFM/PAN2 release layout, offline, in a few seconds (for tests).

Usage: PYTHONPATH=. python scripts/make_tiny_pan2.py OUT [--seed 0] [--multimodal-text-encoder]
       [--scheduler-option KEY=JSON ...]

The layout and the writers are `pan2cli.testing.tiny_pan2`'s (the tests' fixture). Prints OUT.
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from pan2cli.testing.tiny_pan2 import write_tiny_pan2


def _scheduler_option(ctx, param, values: tuple[str, ...]) -> dict:
    options = {}
    for value in values:
        key, sep, text = value.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{value!r} is not KEY=JSON, e.g. shift=5.0")
        try:
            options[key] = json.loads(text)
        except json.JSONDecodeError:
            raise click.BadParameter(f"{value!r}: the value is not JSON (e.g. 5.0, true, null)") from None
    return options


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of every random weight.")
@click.option(
    "--multimodal-text-encoder",
    is_flag=True,
    help="Write text_encoder/ as a multimodal Qwen3.5 checkpoint (config qwen3_5 with a tiny vision tower).",
)
@click.option(
    "--scheduler-option",
    "scheduler_options",
    multiple=True,
    callback=_scheduler_option,
    metavar="KEY=JSON",
    help="Set a key of scheduler/scheduler_config.json (repeatable; null drops it), e.g. shift=5.0.",
)
def main(out: Path, seed: int, multimodal_text_encoder: bool, scheduler_options: dict) -> None:
    """Write a tiny random-weight PAN 2 repository in the IFM/PAN2 layout to OUT (offline, a few seconds)."""
    click.echo(
        write_tiny_pan2(
            out,
            seed=seed,
            multimodal_text_encoder=multimodal_text_encoder,
            scheduler_options=scheduler_options,
        )
    )


if __name__ == "__main__":
    main()
