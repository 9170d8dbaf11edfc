"""Write random-weight Wan2.2 VAE checkpoints (`.pth`, ComfyUI safetensors, diffusers folder) for tests.

Usage: PYTHONPATH=. python scripts/make_test_checkpoint.py OUT_DIR [--decoder-base-dim 256] [--base-dim 160]
       [--seed 0] [--dtype fp32|bf16] [--formats pth,safetensors,diffusers] [--no-encoder]

Prints the paths written, one per line (the diffusers layout as its `vae` folder). The defaults give the
full-size TI2V-5B VAE: 704,688,668 values, 2.8 GB per fp32 file.
"""

from __future__ import annotations

from pathlib import Path

import click
import torch

from pan2cli.testing.random_weights import FORMATS, write_test_checkpoints
from pan2cli.vae.config import WanVAEConfig

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _parse_formats(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    formats = tuple(dict.fromkeys(f.strip() for f in value.split(",") if f.strip()))
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise click.BadParameter(f"expected a comma-separated list of {', '.join(FORMATS)}; got {value!r}")
    return formats


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--decoder-base-dim",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Decoder width unit (stage widths are 4x, 4x, 4x, 2x, 1x it).",
)
@click.option(
    "--base-dim", type=click.IntRange(min=1), default=160, show_default=True, help="Encoder width unit."
)
@click.option(
    "--seed", type=int, default=0, show_default=True, help="Seed of the values (the same in every format)."
)
@click.option(
    "--dtype", type=click.Choice(sorted(_DTYPES)), default="fp32", show_default=True, help="Stored dtype."
)
@click.option(
    "--formats",
    default=",".join(FORMATS),
    show_default=True,
    callback=_parse_formats,
    help="Comma-separated layouts to write.",
)
@click.option(
    "--encoder/--no-encoder", default=True, show_default=True, help="Include the encoder and quant_conv."
)
def main(
    out_dir: Path,
    decoder_base_dim: int,
    base_dim: int,
    seed: int,
    dtype: str,
    formats: tuple[str, ...],
    encoder: bool,
) -> None:
    """Write a random-weight Wan2.2 VAE into OUT_DIR in each layout pan2 reads.

    \b
    Examples:
      PYTHONPATH=. python scripts/make_test_checkpoint.py /tmp/vae
      PYTHONPATH=. python scripts/make_test_checkpoint.py /tmp/vae16 --decoder-base-dim 16 --base-dim 16
      PYTHONPATH=. python scripts/make_test_checkpoint.py /tmp/vae --formats pth --dtype bf16 --no-encoder
    """
    config = WanVAEConfig(base_dim=base_dim, decoder_base_dim=decoder_base_dim)
    written = write_test_checkpoints(
        out_dir, config, seed=seed, dtype=_DTYPES[dtype], formats=formats, encoder=encoder
    )
    for path in written.values():
        click.echo(str(path))


if __name__ == "__main__":
    main()
