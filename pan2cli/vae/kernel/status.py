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
    return KernelStatus(arch, built, spec.build_dir, path, conv_engines(spec), convs_compiled(arch))


def conv_engines(spec) -> str:
    """Which engine runs each group of the decoder's convolutions with this build (`KernelLayers._engine`)."""
    triton = triton_available()
    small = (
        "the fixed-order Triton kernel for conv_in and post_quant_conv (48 input channels) and for conv_out "
        "(12 output channels: one 2-D conv of each frame by its three time taps, 36 fp32 partial sums that "
        "the head adds)"
        if triton
        else "cuDNN for conv_in, post_quant_conv and conv_out (Triton is not installed)"
    )
    if any(flag.startswith("-DPAN2_CUTLASS_CONV=") for flag in spec.cuda_flags):
        kernel = (
            "our persistent warp-specialised CUTLASS conv (TMA im2col loads, wgmma; 256x128 tiles in clusters of two sharing the activation tile)"
            if spec.arch == "sm_90a"
            else "CUTLASS's implicit-GEMM conv (tcgen05; 128x128 tiles)"
        )
        return (
            f"{kernel} for every 3x3x3, time and phase conv at every resolution (fixed summation order: chunk "
            f"sizes and GPU splits round alike); {small}; cuBLAS for the 1x1 shortcut convs"
        )
    if triton:
        return (
            "cuDNN at the two highest resolutions, the fixed-order Triton kernel below them (chunk sizes and GPU "
            "splits round alike) and for conv_out's time partials; no CUTLASS conv in this build (nvidia-cutlass "
            f"not installed, or {spec.arch} has none)"
        )
    return "cuDNN everywhere: Triton is not installed, so chunk sizes and GPU splits may round a few levels apart"
