"""Read Wan2.2 VAE latents from `.pt`/`.pth` or `.safetensors` files and check them."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from pan2cli.checkpoints.files import ReadErrors, read_pickle, read_safetensors
from pan2cli.constants import LATENT_CHANNELS
from pan2cli.errors import InputError

_SAFETENSORS_KEY = "latents"
# A latents file is the user's input: its failures are InputErrors that say "latents file PATH ...".
_READ_ERRORS = ReadErrors(
    error=InputError,
    noun="latents file",
    loads="latents",
    hint="pass a .pt/.pth file saved with torch.save, or a .safetensors file with a 'latents' tensor",
    objects_hint="save only the tensor, or a dict {'latents': tensor, 'fps': number}",
)


@dataclass(frozen=True)
class LatentInput:
    """Latents read from one file.

    Attributes:
        path: the file they came from.
        latents: float32 contiguous CPU tensor, [B, C, T, H, W].
        fps: frame rate stored with the latents, or None when the file has none.
        vae: the identity of the VAE they were made for (`pan2cli.vae.identity`), or None when the file has none.
    """

    path: Path
    latents: torch.Tensor
    fps: float | None
    vae: dict | None = None


def load_latents(path: str | os.PathLike[str], channels: int = LATENT_CHANNELS) -> LatentInput:
    """Read and check a latents file.

    `.safetensors` files must hold a tensor named `latents`; the optional frame rate is the
    string metadata entry `fps`. Any other suffix is read with
    `torch.load(..., weights_only=True)` and may hold a tensor, or a dict with a `latents`
    tensor and an optional `fps` (int, float or 0-dim tensor).

    Args:
        path: the file to read.
        channels: the expected channel count C (48 for Wan2.2).

    Returns:
        A `LatentInput` whose `latents` are float32, contiguous, on CPU, [B, C, T, H, W]
        (a [C, T, H, W] tensor gets a batch dimension of 1).

    Raises:
        InputError: the file is missing, empty, unreadable, holds pickled objects other than
            plain tensors, or the latents have the wrong rank, channel count or dtype, an empty
            dimension, or NaN/Inf values; or the fps is not a positive number.
    """
    path = Path(path)
    if not path.exists():
        raise InputError(f"latents file {path} does not exist")
    if path.is_dir():
        raise InputError(f"latents file {path} is a folder, not a file")
    if not os.access(path, os.R_OK):
        raise InputError(f"latents file {path} is not readable (permission denied)")

    vae = None
    if path.suffix.lower() == ".safetensors":
        raw, fps = _read_safetensors(path)
    else:
        raw, fps, vae = _read_torch(path)
    return LatentInput(path=path, latents=_check_latents(path, raw, channels), fps=fps, vae=vae)


def unnormalize(
    latents: torch.Tensor,
    mean: Sequence[float] | torch.Tensor,
    std: Sequence[float] | torch.Tensor,
) -> torch.Tensor:
    """Undo the per-channel latent normalization: `z * std + mean`.

    Args:
        latents: [B, C, T, H, W] floating tensor, any device.
        mean: C per-channel means (sequence or 1-D tensor).
        std: C per-channel standard deviations (sequence or 1-D tensor).

    Returns:
        A new tensor of the same shape, dtype and device as `latents`.

    Raises:
        ValueError: `latents` is not 5-D, or `mean`/`std` are not C values.
    """
    mean_t, std_t = _channel_stats(latents, mean, std)
    # addcmul computes mean + z * std in one kernel, in the latents' dtype.
    return torch.addcmul(mean_t, latents, std_t)


def normalize(
    latents: torch.Tensor,
    mean: Sequence[float] | torch.Tensor,
    std: Sequence[float] | torch.Tensor,
) -> torch.Tensor:
    """Apply the per-channel latent normalization: `(z - mean) / std` (inverse of `unnormalize`).

    Args:
        latents: [B, C, T, H, W] floating tensor, any device.
        mean: C per-channel means (sequence or 1-D tensor).
        std: C per-channel standard deviations, none of them 0.

    Returns:
        A new tensor of the same shape, dtype and device as `latents`.

    Raises:
        ValueError: `latents` is not 5-D, `mean`/`std` are not C values, or a std is 0.
    """
    mean_t, std_t = _channel_stats(latents, mean, std)
    if bool((std_t == 0).any()):
        raise ValueError("std has a zero entry; cannot normalize")
    return (latents - mean_t) / std_t


def _channel_stats(
    latents: torch.Tensor,
    mean: Sequence[float] | torch.Tensor,
    std: Sequence[float] | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Turn per-channel mean/std into [1, C, 1, 1, 1] tensors matching `latents`."""
    if latents.ndim != 5:
        raise ValueError(f"latents must be [B, C, T, H, W], got shape {tuple(latents.shape)}")
    c = latents.shape[1]
    out = []
    for name, values in (("mean", mean), ("std", std)):
        t = torch.as_tensor(values, dtype=latents.dtype, device=latents.device)
        if t.ndim != 1 or t.numel() != c:
            raise ValueError(f"{name} must hold {c} values (one per channel), got shape {tuple(t.shape)}")
        out.append(t.view(1, c, 1, 1, 1))
    return out[0], out[1]


def _read_torch(path: Path) -> tuple[object, float | None, dict | None]:
    """torch.load a file and pull out (latents candidate, fps, the VAE's identity)."""
    obj = read_pickle(path, _READ_ERRORS)
    if isinstance(obj, dict):
        if "latents" not in obj:
            keys = ", ".join(repr(k) for k in list(obj)[:10]) or "none"
            raise InputError(
                f"latents file {path} holds a dict without a 'latents' key (keys: {keys})",
                hint="save {'latents': tensor} or the tensor itself",
            )
        vae = obj.get("vae")
        return obj["latents"], _check_fps(path, obj.get("fps")), vae if isinstance(vae, dict) else None
    return obj, None, None


def _read_safetensors(path: Path) -> tuple[object, float | None]:
    """Read the `latents` tensor and the `fps` metadata entry of a safetensors file."""
    # The header, and the one tensor we need, not every tensor.
    tensors = read_safetensors(path, _READ_ERRORS)
    if _SAFETENSORS_KEY not in tensors.shapes:
        shown = ", ".join(repr(k) for k in list(tensors.shapes)[:10]) or "none"
        raise InputError(
            f"latents file {path} has no tensor named 'latents' (tensors: {shown})",
            hint="save the latents with safetensors.torch.save_file({'latents': tensor}, ...)",
        )
    tensor = tensors.load(_SAFETENSORS_KEY)
    raw_fps = tensors.metadata.get("fps")
    if raw_fps is None:
        return tensor, None
    try:
        fps_value = float(raw_fps)
    except ValueError:
        raise InputError(f"latents file {path}: fps metadata {raw_fps!r} is not a number") from None
    return tensor, _check_fps(path, fps_value)


def _check_fps(path: Path, fps: object) -> float | None:
    """Validate an fps value from a file; None means "not stored"."""
    if fps is None:
        return None
    if isinstance(fps, torch.Tensor):
        if fps.ndim != 0 or fps.dtype == torch.bool or fps.is_complex():
            raise InputError(
                f"latents file {path}: fps must be a number or a 0-dim tensor, "
                f"got a tensor of shape {tuple(fps.shape)} and dtype {fps.dtype}"
            )
        fps = fps.item()
    # bool is an int subclass; True fps is certainly a mistake.
    if isinstance(fps, bool) or not isinstance(fps, (int, float)):
        raise InputError(f"latents file {path}: fps must be a number, got {type(fps).__name__}")
    value = float(fps)
    if not math.isfinite(value) or value <= 0:
        raise InputError(f"latents file {path}: fps must be a positive number, got {fps!r}")
    return value


def _check_latents(path: Path, raw: object, channels: int) -> torch.Tensor:
    """Check shape, dtype and values; return float32 contiguous [B, C, T, H, W]."""
    expected = f"expected [{channels}, T, H, W] or [B, {channels}, T, H, W]"
    if not isinstance(raw, torch.Tensor):
        raise InputError(
            f"latents file {path} holds a {type(raw).__name__}, not a latents tensor; {expected}",
            hint="save the tensor itself, or a dict {'latents': tensor, 'fps': number}",
        )
    x = raw.detach()
    if x.layout != torch.strided:
        raise InputError(f"latents file {path} holds a {x.layout} tensor; expected a dense tensor")
    shape = tuple(x.shape)
    if x.ndim == 4:
        x = x.unsqueeze(0)
    elif x.ndim != 5:
        raise InputError(f"latents in {path} have shape {list(shape)} ({len(shape)}-D); {expected}")
    if x.shape[1] != channels:
        hint = f"pan2 decodes Wan2.2 VAE latents, which have {channels} channels"
        if x.ndim == 5 and x.shape[2] == channels:
            hint = "the layout looks like [B, T, C, H, W]; permute it to [B, C, T, H, W]"
        raise InputError(
            f"latents in {path} have shape {list(shape)} with {x.shape[1]} channels; {expected}",
            hint=hint,
        )
    if 0 in x.shape:
        raise InputError(
            f"latents in {path} have shape {list(shape)} with an empty dimension; "
            "B, T, H and W must all be at least 1"
        )
    if not x.is_floating_point():
        raise InputError(
            f"latents in {path} have dtype {x.dtype}; expected a floating-point tensor "
            "(float32, float16 or bfloat16)"
        )
    x = x.to(torch.float32).contiguous()
    # Count after the float32 cast: float64 values beyond float32's range become Inf here.
    n_nan = int(torch.isnan(x).sum())
    n_inf = int(torch.isinf(x).sum())
    if n_nan or n_inf:
        raise InputError(
            f"latents in {path} contain {n_nan} NaN and {n_inf} Inf values (of {x.numel()}); "
            "the VAE cannot decode them",
            hint="the model that produced them likely diverged; regenerate the latents",
        )
    return x
