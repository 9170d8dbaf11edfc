"""Which device and dtype a run uses when the user leaves them out, checks on the ones they name, and what a
device can run (fp8 tensor cores, the GPU generation a kernel needs).

torch is imported when a device is resolved, not with this module (the dtype names are in pan2cli.constants).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pan2cli.constants import TORCH_DTYPES
from pan2cli.errors import InputError

if TYPE_CHECKING:
    import torch

# Ada (sm_89), Hopper (sm_90) and Blackwell (sm_100, sm_120) have fp8 tensor cores; Ampere and older do not.
FP8_MIN_CAPABILITY = (8, 9)


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


def compute_capability(device: torch.device | str) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device that exists, else None (the CPU, no CUDA, an index past the last GPU)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index >= torch.cuda.device_count():
        return None
    return torch.cuda.get_device_capability(index)


def fp8_unsupported_reason(device: torch.device | str) -> str | None:
    """Why the fp8 tier cannot run on `device`, or None when it can (a CUDA GPU with fp8 tensor cores, torch's
    fp8 GEMM, Triton)."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return f"fp8 needs a CUDA GPU with fp8 tensor cores (Ada, Hopper, Blackwell); this run is on the {device.type}"
    if not torch.cuda.is_available():
        return "fp8 needs a CUDA GPU, and torch sees none"
    capability = compute_capability(device)
    if capability is None:
        return f"there is no GPU {device.index}"
    if capability < FP8_MIN_CAPABILITY:
        name = torch.cuda.get_device_name(device)
        return (
            f"{name} (sm_{capability[0]}{capability[1]}) has no fp8 tensor cores; "
            f"fp8 needs sm_{FP8_MIN_CAPABILITY[0]}{FP8_MIN_CAPABILITY[1]} or newer (Ada, Hopper, Blackwell)"
        )
    if not hasattr(torch, "_scaled_mm"):
        return f"this torch ({torch.__version__}) has no fp8 GEMM (torch._scaled_mm)"
    from pan2cli.triton_support import triton_available

    if not triton_available():
        return "the fp8 tier's fused kernels need Triton, which is not installed"
    return None
