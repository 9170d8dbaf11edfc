"""The fused-norm conv prototype (`kernels/experimental/`): its own extension, built on request only.

conv(SiLU(RMS-norm(x))) with the norm applied to the activation tile in shared memory, on the decode's
CUTLASS conv (sm_90a). Measured 2.7-3.0x slower than the decode's two passes (docs/KERNEL_NOTES.md), so the
decode never calls it, its sources stay out of the wheel and out of the decode's extension, and it is built
(another extension, `pan2cli.kernel_build`) only by its tests and `scripts/bench_kernels.py fused-norm`.
"""

from __future__ import annotations

from types import ModuleType

import torch

from pan2cli.errors import KernelBuildError
from pan2cli.kernel_build import ExtensionSpec, current_arch, load_extension, sources_in
from pan2cli.resources import kernels_dir
from pan2cli.vae.kernel.build import EXTENSION, cuda_flags, cutlass_include_dirs, cutlass_version

PROTOTYPES = "pan2_vae_prototypes"
FOLDER = "experimental"


def prototype_spec(arch: str) -> ExtensionSpec:
    """The prototype's build for `arch`: this folder's sources, the decode kernel's headers and flags.

    Raises:
        KernelBuildError: the sources are not here (an installed wheel ships the decode's kernels only).
    """
    folder = kernels_dir() / FOLDER
    if not folder.is_dir():
        raise KernelBuildError(
            "the fused-norm prototype's sources are in a source checkout only (kernels/experimental)",
            hint="run it from a clone of the repository",
        )
    return ExtensionSpec(
        name=PROTOTYPES,
        arch=arch,
        sources=sources_in(folder),
        headers=tuple(p for p in sources_in(kernels_dir() / EXTENSION) if p.suffix in (".h", ".cuh")),
        cuda_flags=tuple(cuda_flags(arch)),
        include_dirs=tuple(cutlass_include_dirs()),
        extra_key=f"nvidia-cutlass {cutlass_version()}",
        what="the fused-norm prototype",
    )


def load_prototypes(device: torch.device | None = None) -> ModuleType:
    """Build (once, cached) and import the prototype for this GPU: `rms_inv`, `conv_cutlass_norm`.

    Raises:
        KernelBuildError: not an sm_90a GPU, the sources missing, or a failed build.
    """
    arch = current_arch(device)
    if arch != "sm_90a":
        raise KernelBuildError(
            f"the fused-norm prototype is built for sm_90a only, this GPU is {arch or 'none'}"
        )
    if not cutlass_include_dirs():
        raise KernelBuildError(
            "the fused-norm prototype needs the CUTLASS headers (pip install nvidia-cutlass)"
        )
    return load_extension(prototype_spec(arch))
