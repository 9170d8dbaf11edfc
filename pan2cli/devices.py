"""Which device and dtype a run uses when the user leaves them out, and checks on the ones they name.

torch is imported when a device is resolved, not with this module (the dtype names are in pan2cli.constants).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pan2cli.constants import TORCH_DTYPES
from pan2cli.errors import InputError

if TYPE_CHECKING:
    import torch


def resolve_device(name: str | None) -> torch.device:
    """`None` → cuda when available, else cpu; a CUDA device that does not exist is bad input."""
    import torch

    if name is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as exc:
        raise InputError(f"--device {name!r} is not a device name", hint="use cuda, cuda:N or cpu") from exc
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise InputError(
                f"--device {name}: CUDA is not available on this machine", hint="pass --device cpu"
            )
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise InputError(f"--device {name}: only {torch.cuda.device_count()} GPU(s) visible")
    elif device.type != "cpu":
        raise InputError(f"--device {name!r} is not supported", hint="use cuda, cuda:N or cpu")
    return device


def resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """`None` → bf16 on CUDA, fp32 on CPU."""
    import torch

    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, TORCH_DTYPES[name])


def resolve_generator_device(name: str | None, device: torch.device) -> torch.device:
    """Where the initial noise is drawn for a model on `device`: `None` → `device` itself (as IFM's vLLM-Omni
    runner and the diffusers reference draw it); "cpu"; "cuda" → `device` when it is a GPU, else the current GPU.

    Raises:
        InputError: "cuda" on a machine without CUDA.
    """
    import torch

    if name is None:
        return device
    if name == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise InputError(
            "--generator-device cuda: CUDA is not available on this machine",
            hint="pass --generator-device cpu, or leave it out to draw the noise on the device that runs the model",
        )
    return device if device.type == "cuda" else torch.device("cuda", torch.cuda.current_device())
