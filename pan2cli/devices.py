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
            raise InputError("--device cuda: CUDA is not available on this machine", hint="pass --device cpu")
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
