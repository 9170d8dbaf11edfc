"""`pan2 kernels build | status | clean`: the build cache of the compiled kernels (the Wan2.2 decoder's, the fp8 attention's)."""

from __future__ import annotations

import json
import time

import click

from pan2cli.cli._output import info, result, status
from pan2cli.errors import KernelBuildError

# pan2cli.vae.kernel and pan2cli.dit (torch) are imported inside each command: `pan2 --help` does not load torch.


@click.group("kernels")
def kernels_group():
    """Build, inspect or empty the cache of the compiled kernels.

    Two extensions: the VAE decoder's (sm_90a for H100/H200, sm_100a/sm_103a for B200/B300) and the fp8
    attention's (sm_90a: the default attention of --precision fp8 there). Each is built on first use for the
    GPU it runs on with torch.utils.cpp_extension and ninja, and cached under PAN2_CACHE_DIR (default
    ~/.cache/pan2) by source hash, pan2cli, torch and CUDA versions and arch.

    \b
    Examples:
      pan2 kernels build
      pan2 kernels status --json
      pan2 kernels clean
    """


@kernels_group.command("build")
def build_command():
    """Build the kernels for this machine's GPU and compile the decoder's Triton convolutions; prints the folders.

    The decode kernel and its convolutions (then the first `pan2 decode` runs as fast as later ones, for
    every video size and number of GPUs: the convolutions are compiled once per layer, not per size) and,
    on sm_90 GPUs, the fp8 attention (the first `--precision fp8` run then starts at once). A no-op when all
    are cached.

    \b
    Examples:
      pan2 kernels build
      PAN2_KERNEL_VERBOSE=1 pan2 kernels build    # show the compiler output
      MAX_JOBS=4 pan2 kernels build
    """
    import torch

    from pan2cli.dit import cuda_fp8_attention
    from pan2cli.triton_support import triton_available
    from pan2cli.vae.kernel.build import current_arch, load_kernel
    from pan2cli.vae.kernel.choice import compile_convolutions
    from pan2cli.vae.kernel.status import kernel_status

    if current_arch() is None:
        why = kernel_status().decode_path.split(": ", 1)[-1]
        raise KernelBuildError(
            f"nothing to build: {why}",
            hint="the kernel targets H100/H200 (sm_90a) and B200/B300 (sm_100a, sm_103a)",
        )
    start = time.perf_counter()
    with status("Building the decode kernel (about a minute the first time)…"):
        load_kernel()
    info(f"Decode kernel ready in {time.perf_counter() - start:.1f} s.")
    if triton_available():
        start = time.perf_counter()
        with status("Compiling the decoder's Triton convolutions (about half a minute the first time)…"):
            compile_convolutions()
        info(f"Triton convolutions ready in {time.perf_counter() - start:.1f} s.")
    result(str(kernel_status().build_dir))
    device = torch.device("cuda", torch.cuda.current_device())
    why_not = cuda_fp8_attention.why_not_runnable(device, cuda_fp8_attention.HEAD_DIM)
    if why_not is not None:
        info(f"No fp8 attention kernel to build: {why_not} (the fp8 tier runs the Triton one).")
        return
    start = time.perf_counter()
    with status("Building the fp8 attention (once, the first time)…"):
        cuda_fp8_attention.extension_ops(device)
    info(f"fp8 attention ready in {time.perf_counter() - start:.1f} s.")
    result(str(cuda_fp8_attention.extension_spec().build_dir))


@kernels_group.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status_command(as_json):
    """Say what is built, where, which decode path `pan2 decode` would run and why, and the fp8 attention's build.

    \b
    Examples:
      pan2 kernels status
      pan2 kernels status --json
    """
    from pan2cli.dit.cuda_fp8_attention import build_status
    from pan2cli.vae.kernel.status import kernel_status

    report = kernel_status()
    fp8_built, fp8_dir, fp8_line = build_status()
    values = {
        "arch": report.arch,
        "built": report.built,
        "build_dir": str(report.build_dir) if report.build_dir else None,
        "decode_path": report.decode_path,
        "convs": report.convs,
        "convs_compiled": report.convs_compiled,
        "fp8_attention": {"built": fp8_built, "build_dir": fp8_dir, "status": fp8_line},
    }
    if as_json:
        result(json.dumps(values, indent=2))
        return
    if report.arch is None:  # no kernel target here: say so instead of printing Nones
        why = report.decode_path.split(": ", 1)[-1]
        values = {
            "kernel": f"nothing to build or load: {why}; the compiled decoder targets H100/H200 (sm_90a) and "
            "B200/B300 (sm_100a, sm_103a)",
            "decode_path": report.decode_path,
            "convs": report.convs,
        }
    else:  # the key reads as a question there: say the answer in words
        values["convs_compiled"] = (
            "yes" if report.convs_compiled else "no: the first decode compiles them (or `pan2 kernels build`)"
        )
    values["fp8_attention"] = fp8_line + (f" ({fp8_dir})" if fp8_dir else "")
    for key, value in values.items():
        result(f"{key:<14} {value}")


@kernels_group.command("clean")
def clean_command():
    """Remove every cached build of the kernels (both extensions, every version); prints the folder removed (on
    stderr, that there was none).

    \b
    Examples:
      pan2 kernels clean
      PAN2_CACHE_DIR=/scratch/pan2 pan2 kernels clean
    """
    from pan2cli.kernel_build import clean_kernel_cache

    folder, removed = clean_kernel_cache()
    if removed:
        result(str(folder))
    else:
        info(f"Nothing to clean: {folder} does not exist.")
