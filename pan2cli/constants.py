"""The numbers of the Wan2.2 VAE and PAN 2 that several modules check against, the seed limit and the dtype names.

torch-free: the CLI imports it to build its options (`pan2 --help` does not import torch).
"""

from __future__ import annotations

# Wan2.2 VAE: 4x temporal compression (plus the first frame), 16x spatial, 48 latent channels.
VAE_TEMPORAL_FACTOR = 4
VAE_SPATIAL_FACTOR = 16
LATENT_CHANNELS = 48
# The DiT patchifies the 16x-downsampled latent by 2, so pixel sizes must be multiples of 32.
SIZE_MULTIPLE = 32
# The longest video a run accepts unless told otherwise (`pan2 generate --max-frames`, `GenerationJob.max_frames`):
# twice the longest shipped preset (pan2-20s, 481 frames), 40 s at 24 fps. A slip such as `--frames 400001` or
# `--duration 1e6` is refused before anything loads instead of running (and allocating) for hours.
MAX_FRAMES = 961
# torch.manual_seed accepts seeds up to 2**64 - 1.
MAX_SEED = 2**64 - 1

# --dtype name → torch dtype attribute.
TORCH_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
DTYPE_NAMES = tuple(TORCH_DTYPES)


def valid_frames(frames: int) -> bool:
    """Whether the Wan2.2 VAE decodes exactly `frames` video frames: 1 + 4·(latent frames − 1)."""
    return frames >= 1 and frames % VAE_TEMPORAL_FACTOR == 1


def valid_size(pixels: int) -> bool:
    """Whether a height or width in pixels is a positive multiple of `SIZE_MULTIPLE`."""
    return pixels > 0 and pixels % SIZE_MULTIPLE == 0


def valid_seed(seed: int) -> bool:
    """Whether `seed` is one that torch's generators accept: 0 to `MAX_SEED`."""
    return 0 <= seed <= MAX_SEED


def latent_frames(frames: int) -> int:
    """Latent frames the VAE decodes into `frames` video frames: `1 + (F − 1)/4`."""
    return 1 + (frames - 1) // VAE_TEMPORAL_FACTOR


def video_frames(latent_frames: int) -> int:
    """Video frames the VAE decodes from `latent_frames` latent frames: `1 + 4·(T − 1)`."""
    return 1 + VAE_TEMPORAL_FACTOR * (latent_frames - 1)


def latent_shape(frames: int, height: int, width: int) -> tuple[int, int, int, int, int]:
    """Shape of the Wan2.2 VAE latent of one video (batch, channels, frames, height, width): `[1, 48, 1 + (F − 1)/4, H/16, W/16]`."""
    return (
        1,
        LATENT_CHANNELS,
        latent_frames(frames),
        height // VAE_SPATIAL_FACTOR,
        width // VAE_SPATIAL_FACTOR,
    )
