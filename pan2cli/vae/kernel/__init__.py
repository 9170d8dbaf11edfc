"""The compiled decode path of the Wan2.2 VAE, one job per module.

* `build`: the CUDA extension's build (`pan2cli.kernel_build` builds and caches it); the Triton compiled markers.
* `ops`: the extension's ops registered as `torch.ops.pan2.*`.
* `status`: what is built for this GPU and which decode path a decode takes.
* `choice`: the kernel decoder or the reference one, and the start-up work around that choice.
* `decoder`: `WanKernelDecoder`, the decode with the compiled kernels: the walk through the decoder's stages,
  over `resample` (the resamplers), `layers` (norms and convs by engine), `buffers` (histories, rings,
  halo rows, pending sums) and `layout` (the weights in the kernels' layout).
* `conv` (launcher) and `conv_triton` (its Triton kernel): the fixed-order implicit-GEMM convolution.

Import from the submodule; the names below are the package's face for its callers.
"""

from pan2cli.vae.kernel.build import current_arch, load_kernel
from pan2cli.vae.kernel.choice import select_decode_path
from pan2cli.vae.kernel.status import KernelStatus, kernel_status

__all__ = [
    "KernelStatus",
    "current_arch",
    "kernel_status",
    "load_kernel",
    "select_decode_path",
]
