"""Image-to-video conditioning: read a start image, fit it to the video size, encode it to the clean first latent frame."""

from __future__ import annotations

from pathlib import Path

import torch

from pan2cli.errors import InputError
from pan2cli.latents import normalize


def load_image(path: str | Path) -> "PIL.Image.Image":  # noqa: F821
    """Open an image file as RGB.

    Raises:
        InputError: missing or unreadable (not an image).
    """
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise InputError(f"--image {path} does not exist (or is not a file)")
    try:
        with Image.open(path) as image:
            return image.convert("RGB")
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InputError(f"--image {path} could not be read as an image: {exc}", hint="pass a PNG or JPEG file") from exc


def fit_image(image, height: int, width: int) -> torch.Tensor:
    """Resize so that the image covers `height x width` (aspect kept, bicubic), then centre-crop.

    Returns:
        `[3, height, width]` float32 in [−1, 1].
    """
    from PIL import Image

    scale = max(height / image.height, width / image.width)
    size = (max(width, round(image.width * scale)), max(height, round(image.height * scale)))
    image = image.resize(size, Image.BICUBIC)
    left, top = (size[0] - width) // 2, (size[1] - height) // 2
    image = image.crop((left, top, left + width, top + height))
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(height, width, 3)
    return pixels.permute(2, 0, 1).float().div(127.5).sub(1.0)


def encode_image(encoder, pixels: torch.Tensor) -> torch.Tensor:
    """The normalised latent of one frame: `(encoder(image) − mean) / std`, `[1, 48, 1, H/16, W/16]` float32.

    Args:
        encoder: a `pan2cli.vae.encoder.WanVAEEncoder`.
        pixels: `[3, H, W]` in [−1, 1].
    """
    raw = encoder.encode(pixels[None, :, None]).float()
    cfg = encoder.config
    return normalize(raw, cfg.latents_mean, cfg.latents_std)
