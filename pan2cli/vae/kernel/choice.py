"""Choose the decode path: the compiled kernel (`WanKernelDecoder`) where it applies, else the reference.

Also the work around that choice: Triton's start-up beside the weights' loading, the one-line note of a
first use, and compiling the convolutions ahead (`pan2 kernels build`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

import torch

from pan2cli.errors import InputError, KernelBuildError
from pan2cli.triton_support import triton_available
from pan2cli.vae.kernel.build import (
    convs_compiled,
    current_arch,
    kernel_spec,
    load_kernel,
    mark_convs_compiled,
    why_not_applicable,
)

if TYPE_CHECKING:
    from pan2cli.vae.model import WanVAEDecoder
    from pan2cli.vae.protocol import Decoder

# The architecture fields that decide which convolution shapes a decoder launches.
_LAYER_FIELDS = (
    "decoder_base_dim",
    "z_dim",
    "dim_mult",
    "num_res_blocks",
    "temperal_downsample",
    "out_channels",
    "patch_size",
)


def _has_release_layers(config) -> bool:
    from pan2cli.vae.config import WanVAEConfig

    release = WanVAEConfig()
    return all(getattr(config, field) == getattr(release, field) for field in _LAYER_FIELDS)


def start_loading_triton(device: torch.device, dtype: torch.dtype, mode: str) -> threading.Thread | None:
    """Import Triton and the conv kernel in a thread while the caller loads the weights; join it before
    `select_decode_path`. None where the kernel path will not run.

    A process's first Triton launch imports Triton (~0.15 s) and hashes Triton's own files into its
    cache key (~0.35 s, `triton_key`; the hashing releases the GIL): about half a second that would
    otherwise sit between loading the weights and the decode.
    """
    if mode == "off" or not triton_available() or why_not_applicable(device, dtype) is not None:
        return None

    def load() -> None:
        try:
            from triton.runtime.cache import triton_key

            import pan2cli.vae.kernel.conv_triton  # noqa: F401  (the kernel's module, JIT-wrapped)

            triton_key()  # cached for the process
        except Exception:
            pass  # another Triton version: the first launch does the same work itself

    thread = threading.Thread(target=load, name="pan2-load-triton", daemon=True)
    thread.start()
    return thread


def first_use_note(device: torch.device, dtype: torch.dtype, mode: str) -> str | None:
    """One line for a decode that will build the kernel or compile its convolutions first, else None."""
    if mode == "off" or why_not_applicable(device, dtype) is not None:
        return None
    arch = current_arch(device)
    built = kernel_spec(arch).library.exists()
    if built and convs_compiled(arch):
        return None
    work = (
        "compiles its Triton convolutions"
        if built
        else "builds the decode kernel and compiles its Triton convolutions"
    )
    return f"First use on this machine: the decode {work} first (about a minute, once); `pan2 kernels build` does it ahead."


def compile_convolutions(device: torch.device | None = None) -> None:
    """Compile (or load from Triton's cache) every fixed-order conv the full-size Wan2.2 decoder launches.

    One compiled kernel per layer serves every video size, row band and chunk (`conv_triton`),
    so a decode of a tiny latent with the full architecture covers the 5, 10 and 20 s presets on any
    number of GPUs. The weights are left uninitialised: only the kernels matter here.
    """
    from pan2cli.vae.config import WanVAEConfig
    from pan2cli.vae.model import WanVAEDecoder

    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    with torch.device("meta"):
        reference = WanVAEDecoder(WanVAEConfig())
    reference = reference.to_empty(device=device).to(torch.bfloat16).eval()
    # The decode's own path: it builds the kernel, warms the decoder up and marks the convs compiled.
    select_decode_path(reference, "require")


def check_decode_kernel_mode(mode: str, device: torch.device, dtype: torch.dtype) -> None:
    """`--decode-kernel require` where the kernel cannot apply (the CPU, fp32, another GPU), refused from the options
    alone: before anything loads (`pan2 decode` and `pan2 generate` alike), and again by `select_decode_path`.

    Raises:
        InputError: `mode` is "require" and the kernel cannot run on `device` in `dtype`.
    """
    if mode == "require" and (reason := why_not_applicable(device, dtype)) is not None:
        raise InputError(f"--decode-kernel require: {reason}", hint="use --decode-kernel auto or off")


def select_decode_path(decoder: WanVAEDecoder, mode: str = "auto") -> tuple[Decoder, str | None]:
    """The decoder to run: the compiled kernel path where it applies, else the reference one.

    Args:
        decoder: a loaded `WanVAEDecoder`.
        mode: "auto" | "off" | "require" (`RuntimeConfig.decode_kernel`, `--decode-kernel`).

    Returns:
        `(decoder, note)`: a `WanKernelDecoder` or the reference itself, and one line saying why the
        reference runs on a GPU under "auto" (None otherwise, and on the CPU, where it is the only path).

    Raises:
        InputError: "require" where the kernel cannot apply (CPU, fp32, another GPU).
        KernelBuildError: "require" and the build failed.
    """
    if mode == "off":
        return decoder, None
    reason = why_not_applicable(decoder.device, decoder.dtype)
    if reason is None:
        try:
            ops = load_kernel(decoder.device)
        except KernelBuildError as exc:
            if mode == "require":
                raise
            reason = str(exc)
        else:
            from pan2cli.vae.kernel.decoder import WanKernelDecoder

            kernel_decoder = WanKernelDecoder(decoder, ops)
            kernel_decoder.warm_up()  # Triton's and cuDNN's first-call costs, here rather than in the decode
            if _has_release_layers(decoder.config):  # a smaller test VAE compiles other layer shapes
                mark_convs_compiled(current_arch(decoder.device))
            return kernel_decoder, None
    else:
        check_decode_kernel_mode(mode, decoder.device, decoder.dtype)
    if decoder.device.type == "cpu":
        return decoder, None  # the reference decoder is the CPU path: nothing to explain
    return decoder, f"Using the reference decoder: {reason}."
