"""`check_run_options`: every check of a generation's run-time options that needs no model, made before anything loads."""

from __future__ import annotations

import torch

from pan2cli.config import RuntimeConfig
from pan2cli.presets import Preset, preset_label


def precision_source(preset: Preset | None, given: RuntimeConfig) -> str:
    """What asked for the precision that runs, for its errors: the option, or the preset that sets it."""
    if given.precision is not None or preset is None or preset.precision is None:
        return f"--precision {given.precision or 'bf16'}"
    return f'preset {preset_label(preset)} sets precision = "{preset.precision}"'


def check_run_options(
    config: RuntimeConfig, *, precision_from: str = "--precision fp8", writes_mp4: bool = True
) -> torch.device:
    """The device, where the noise is drawn, the precision on that device, `--decode-kernel require` for the VAE's
    device and dtype, and the MP4 encoder (imageio-ffmpeg's ffmpeg) when videos are written: said in seconds,
    not after the denoising.

    Args:
        config: the run-time options.
        precision_from: what asked for the precision, for its error (`preset NAME sets precision = "fp8"`).
        writes_mp4: whether the run writes MP4 files.

    Returns:
        The device the models run on.

    Raises:
        InputError: an option that cannot run here (exit 2).
        Pan2Error: no usable ffmpeg (exit 1).
    """
    from pan2cli.ffmpeg import check_mp4_encoder
    from pan2cli.vae.kernel.choice import check_decode_kernel_mode

    device = config.torch_device()
    config.torch_generator_device(device)
    config.check_precision(device, given_by=precision_from)
    check_decode_kernel_mode(config.decode_kernel, device, config.torch_vae_dtype(device))
    if writes_mp4:
        check_mp4_encoder()
    return device
