"""Image-to-video conditioning: read a start image, fit it to the video size as PAN 2 was trained, encode it.

PAN 2 conditions on the start image by channel concatenation (pan2cli.pipeline.conditioning): the image's
normalised VAE latent fills latent frame 0 of the condition, with mask 1 there. Preparation follows the
release (vLLM-Omni's PAN 2 pipeline, vllm-project/vllm-omni
`vllm_omni/diffusion/models/pan2/pipeline_pan2.py` `prepare_condition_latents`): scale to cover H x W with sizes rounded, LANCZOS, centre crop
at offsets `round((w − W)/2)`, `round((h − H)/2)` (Python's round: halves to even), pixels `/255·2 − 1`
in float32, the posterior's mode (its mean, for a diagonal Gaussian) of the VAE encoder, normalised.
"""

from __future__ import annotations

from pathlib import Path

import torch

from pan2cli.constants import VAE_SPATIAL_FACTOR
from pan2cli.errors import InputError
from pan2cli.latents import normalize

# A start image smaller than one latent pixel (16x16 pixels of the Wan2.2 VAE) holds no picture to start from.
MIN_IMAGE_SIDE = VAE_SPATIAL_FACTOR


def load_image(path: str | Path, what: str = "--image") -> "PIL.Image.Image":  # noqa: F821
    """Open an image file as RGB.

    Args:
        path: the file.
        what: how messages name it: the flag, or the field of a prompt-file record (`'image'`).

    Raises:
        InputError: missing or unreadable (not an image).
    """
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise InputError(f"{what} {path} does not exist (or is not a file)")
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InputError(
            f"{what} {path} could not be read as an image: {exc}", hint="pass a PNG or JPEG file"
        ) from exc


def load_start_image(path: str | Path, what: str = "--image") -> "PIL.Image.Image":  # noqa: F821
    """`load_image`, for the start of a video: at least `MIN_IMAGE_SIDE` pixels on each side.

    Raises:
        InputError: as `load_image`, or a side shorter than `MIN_IMAGE_SIDE` (a 1x1 picture).
    """
    image = load_image(path, what)
    if min(image.size) < MIN_IMAGE_SIDE:
        raise InputError(
            f"{what} {path} is {image.width}x{image.height} pixels: a start image needs at least "
            f"{MIN_IMAGE_SIDE}x{MIN_IMAGE_SIDE} (one latent pixel of the VAE) to hold a picture",
            hint="pass the picture the video starts from, ideally of the video's size (--size) or larger",
        )
    return image


def fit_image(image, height: int, width: int) -> torch.Tensor:
    """Cover `height x width` (aspect kept, LANCZOS, sizes rounded), centre-crop, scale to [−1, 1].

    Returns:
        `[3, height, width]` float32.
    """
    from PIL import Image

    scale = max(width / image.width, height / image.height)
    image = image.resize((round(image.width * scale), round(image.height * scale)), resample=Image.LANCZOS)
    left, top = round((image.width - width) / 2), round((image.height - height) / 2)
    image = image.crop((left, top, left + width, top + height))
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(height, width, 3)
    return pixels.permute(2, 0, 1).float().div(255.0).mul(2.0).sub(1.0)


def encode_image(encoder, pixels: torch.Tensor) -> torch.Tensor:
    """The normalised latent of one frame: `(mode − mean) / std`, `[1, 48, 1, H/16, W/16]` float32.

    Args:
        encoder: a `pan2cli.vae.encoder.WanVAEEncoder` (it returns the posterior's mean = its mode).
        pixels: `[3, H, W]` in [−1, 1].
    """
    raw = encoder.encode(pixels[None, :, None]).float()
    cfg = encoder.config
    return normalize(raw, cfg.latents_mean, cfg.latents_std)
