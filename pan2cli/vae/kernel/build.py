"""Build, cache and import the compiled Wan2.2 decode kernel; the only module that imports its extension.

The extension (C++/CUDA in `kernels/wan22_vae_decode/`, shipped as `pan2cli/_kernels`) is built on first
use by `pan2cli.kernel_build` (cache folder, file lock, build log) for the GPU it runs on only (sm_90a for
H100/H200, sm_100a / sm_103a for B200/B300), with the CUTLASS headers of the pinned `nvidia-cutlass` wheel
where they are installed (their version is part of the build's key). The build folder also records which
Triton caches hold the decoder's compiled convolutions (`convs_compiled`).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import torch

from pan2cli.errors import KernelBuildError
from pan2cli.kernel_build import ExtensionSpec, arch_flags, current_arch, load_extension, sources_in
from pan2cli.resources import kernels_dir
from pan2cli.triton_support import triton_available
from pan2cli.vae.kernel.ops import register_ops

EXTENSION = "wan22_vae_decode"

# Arch -> the CUTLASS conv collectives compiled for it (conv_cutlass.cuh): sm90 (TMA + wgmma) or sm100
# (tcgen05). sm_103a has none yet: its convs run in the Triton kernel.
CUTLASS_CONV_TARGETS = {"sm_90a": 90, "sm_100a": 100}

_loaded: dict[str, SimpleNamespace] = {}


def cutlass_include_dirs() -> list[Path]:
    """The CUTLASS headers of the pinned `nvidia-cutlass` wheel (its `cutlass_library/source`), or []
    where it is not installed (the build then has no CUTLASS conv, and the Triton conv runs instead).
    Found without importing the package."""
    import importlib.util

    spec = importlib.util.find_spec("cutlass_library")
    if spec is None or not spec.submodule_search_locations:
        return []
    source = Path(next(iter(spec.submodule_search_locations))) / "source"
    dirs = [source / "include", source / "tools" / "util" / "include"]
    return dirs if all(d.is_dir() for d in dirs) else []


def cutlass_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nvidia-cutlass")
    except PackageNotFoundError:
        return "none"


def cuda_flags(arch: str) -> list[str]:
    """nvcc's flags for the decode kernel on `arch`: every extension's, and the CUTLASS conv where it has one."""
    flags = arch_flags(arch)
    conv = CUTLASS_CONV_TARGETS.get(arch)
    if conv is not None and cutlass_include_dirs():
        flags.append(f"-DPAN2_CUTLASS_CONV={conv}")
    return flags


def kernel_spec(arch: str) -> ExtensionSpec:
    """The decode kernel's build for `arch`."""
    return ExtensionSpec(
        name=EXTENSION,
        arch=arch,
        sources=sources_in(kernels_dir() / EXTENSION),
        cuda_flags=tuple(cuda_flags(arch)),
        include_dirs=tuple(cutlass_include_dirs()),
        extra_key=f"nvidia-cutlass {cutlass_version()}",  # other headers, another build
        what="the decode kernel",
        hint="set PAN2_KERNEL_VERBOSE=1 to see the compiler output; --decode-kernel off uses the reference decoder",
    )


def convs_marker(arch: str) -> Path:
    """Lists the Triton cache folders into which a decoder's convolutions were compiled, one a line."""
    return kernel_spec(arch).build_dir / "triton-convs-compiled"


def why_not_applicable(device: torch.device, dtype: torch.dtype) -> str | None:
    """None if the kernel applies to a decode on `device` in `dtype`, else the reason in a few words."""
    if device.type != "cuda":
        return f"the decode runs on {device.type}, the compiled kernel needs a CUDA GPU"
    if dtype != torch.bfloat16:
        return f"the decode runs in {str(dtype).removeprefix('torch.')}, the compiled kernel is bf16 only"
    if current_arch(device) is None:
        major, minor = torch.cuda.get_device_capability(device)
        return f"the GPU is sm_{major}{minor}; the kernel is built for sm_90a, sm_100a and sm_103a"
    return None


def load_kernel(device: torch.device | None = None) -> SimpleNamespace:
    """Build (once, cached) and import the extension for this GPU; returns its ops (`torch.ops.pan2.*`).

    Raises:
        KernelBuildError: unsupported GPU, missing compiler, or a failed build; names the first compiler
            error and the build log's path (which keeps the whole output).
    """
    arch = current_arch(device)
    if arch is None:
        raise KernelBuildError("no supported CUDA GPU (the decode kernel needs sm_90a, sm_100a or sm_103a)")
    if arch not in _loaded:
        _loaded[arch] = register_ops(load_extension(kernel_spec(arch)))
    return _loaded[arch]


def _triton_cache_dir() -> str:
    import triton

    return str(triton.knobs.cache.dir)


def convs_compiled(arch: str) -> bool:
    """Whether this machine compiled the fixed-order Triton convolutions for `arch` (into the Triton
    cache in use now), so that a decode only loads them; always True where Triton is not used."""
    if not triton_available():
        return True
    marker = convs_marker(arch)
    return marker.exists() and _triton_cache_dir() in marker.read_text().splitlines()


def mark_convs_compiled(arch: str) -> None:
    if triton_available() and not convs_compiled(arch):
        marker = convs_marker(arch)
        marker.parent.mkdir(parents=True, exist_ok=True)
        with open(marker, "a") as f:  # one line each: another TRITON_CACHE_DIR does not undo this one
            f.write(_triton_cache_dir() + "\n")
