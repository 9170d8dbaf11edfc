"""What `pan2 kernels status` and `pan2 doctor` report: the build for this GPU, the decode path it gives."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pan2cli.triton_support import triton_available
from pan2cli.vae.kernel.build import convs_compiled, current_arch, kernel_spec


@dataclass(frozen=True)
class KernelStatus:
    arch: str | None
    built: bool
    build_dir: Path | None
    decode_path: str  # which path `pan2 decode` would take, and why
    convs: str | None = None  # the convolution engines of the path `pan2 decode` would run
    convs_compiled: bool | None = None  # the Triton convolutions are compiled (None: no kernel target)


def kernel_status(device: torch.device | None = None) -> KernelStatus:
    """What is built for this machine's GPU and which decode path a default decode would run."""
    arch = current_arch(device)
    if arch is None:
        if not torch.cuda.is_available():
            reason, convs = (
                "reference PyTorch decoder: no CUDA GPU",
                "PyTorch's CPU convolutions (the reference decoder)",
            )
        else:
            major, minor = torch.cuda.get_device_capability(device)
            reason = f"reference PyTorch decoder: sm_{major}{minor} is not a kernel target (sm_90a, sm_100a, sm_103a)"
            convs = "cuDNN (the reference decoder)"
        return KernelStatus(None, False, None, reason, convs)
    spec = kernel_spec(arch)
    built = spec.library.exists()
    path = (
        f"compiled kernel ({arch}, bf16): built, loads from the cache"
        if built
        else f"compiled kernel ({arch}, bf16): built on first use (about a minute), or now with `pan2 kernels build`"
    )
    convs = (
        "cuDNN at the two highest resolutions, the fixed-order Triton kernel below (chunk sizes and GPU splits round alike)"
        if triton_available()
        else "cuDNN everywhere: Triton is not installed, so chunk sizes and GPU splits may round a few levels apart"
    )
    return KernelStatus(arch, built, spec.build_dir, path, convs, convs_compiled(arch))
