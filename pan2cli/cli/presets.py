"""`pan2 presets list | show NAME`: the shipped generation presets and user preset files."""

from __future__ import annotations

import json

import click

from pan2cli.cli._output import result
from pan2cli.presets import DEFAULT_PRESET, list_presets, load_preset, preset_to_dict, preset_to_toml


@click.group("presets")
def presets_group():
    """List and show generation presets (frames, size, fps, sampler settings).

    A preset is a TOML file; pass a shipped name or the path of your own file wherever a preset is taken.

    \b
    Examples:
      pan2 presets list
      pan2 presets show pan2-5s
      pan2 presets show ./my-preset.toml --json
    """


@presets_group.command("list")
def list_command():
    """List the shipped presets, one per line: name, frames, size (HxW, as --size takes it), fps, description.

    \b
    Examples:
      pan2 presets list
      pan2 presets list | grep default
    """
    for preset in list_presets():
        default = " (default)" if preset.name == DEFAULT_PRESET else ""
        result(
            f"{preset.name:<10} {preset.frames:>4} frames  {preset.height}x{preset.width}  {preset.fps} fps  "
            f"{preset.description}{default}"
        )


@presets_group.command("show")
@click.argument("name")
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print the preset as JSON (with its name, source and derived values) instead of TOML.",
)
def show_command(name, as_json):
    """Show every setting of preset NAME (a shipped name or a .toml path).

    The TOML printed loads back as a preset: save it, edit it, pass its path to --preset. The name, source
    and derived values (latent frames and shape) are comments.

    \b
    Examples:
      pan2 presets show pan2-10s
      pan2 presets show pan2-5s > my.toml
      pan2 presets show pan2-20s --json
    """
    preset = load_preset(name)
    if as_json:
        values = preset_to_dict(preset)
        values["latent_frames"] = preset.latent_frames
        values["latent_shape"] = list(preset.latent_shape)
        result(json.dumps(values, indent=2))
        return
    result(preset_to_toml(preset).rstrip("\n"))
