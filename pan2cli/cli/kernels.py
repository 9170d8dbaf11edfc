"""`pan2 kernels build | status | clean`: the compiled Wan2.2 decode kernel's build cache."""

from __future__ import annotations

import json
import time

import click

from pan2cli.cli._output import info, result, status
from pan2cli.errors import KernelBuildError

# pan2cli.vae.kernel (torch) is imported inside each command: `pan2 --help` does not load torch.


@click.group("kernels")
def kernels_group():
    """Build, inspect or empty the cache of the compiled decode kernel.

    The kernel is built on first use for the GPU it runs on (sm_90a for H100/H200, sm_100a/sm_103a
    for B200/B300) with torch.utils.cpp_extension and ninja, and cached under PAN2_CACHE_DIR
    (default ~/.cache/pan2) by source hash, pan2cli, torch and CUDA versions and arch.

    \b
    Examples:
      pan2 kernels build
      pan2 kernels status --json
      pan2 kernels clean
    """


@kernels_group.command("build")
def build_command():
    """Build the decode kernel for this machine's GPU and compile its Triton convolutions; prints its folder.

    After it, the first `pan2 decode` runs as fast as later ones, for every video size and number of
    GPUs (the convolutions are compiled once per layer, not per size). A no-op when both are cached.

    \b
    Examples:
      pan2 kernels build
      PAN2_KERNEL_VERBOSE=1 pan2 kernels build    # show the compiler output
      MAX_JOBS=4 pan2 kernels build
    """
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


@kernels_group.command("status")
@click.option("--json", "as_json", is_flag=True, help="Print the status as JSON.")
def status_command(as_json):
    """Say what is built, where, and which decode path `pan2 decode` would run and why.

    \b
    Examples:
      pan2 kernels status
      pan2 kernels status --json
    """
    from pan2cli.vae.kernel.status import kernel_status

    report = kernel_status()
    values = {
        "arch": report.arch,
        "built": report.built,
        "build_dir": str(report.build_dir) if report.build_dir else None,
        "decode_path": report.decode_path,
        "convs": report.convs,
        "convs_compiled": report.convs_compiled,
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
    for key, value in values.items():
        result(f"{key:<12} {value}")


@kernels_group.command("clean")
def clean_command():
    """Remove every cached build of the decode kernel; prints the folder removed (on stderr, that there was none).

    \b
    Examples:
      pan2 kernels clean
      PAN2_CACHE_DIR=/scratch/pan2 pan2 kernels clean
    """
    from pan2cli.vae.kernel.build import clean_kernel_cache

    folder, removed = clean_kernel_cache()
    if removed:
        result(str(folder))
    else:
        info(f"Nothing to clean: {folder} does not exist.")
