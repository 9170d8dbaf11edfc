"""Build, cache and import the compiled Wan2.2 decode kernel; the only module that imports the extension.

The extension (C++/CUDA in `kernels/wan22_vae_decode/`, shipped as `pan2cli/_kernels`) is built on first
use with `torch.utils.cpp_extension` (ninja) for the GPU it runs on only (sm_90a for H100/H200, sm_100a /
sm_103a for B200/B300) into

    <cache>/kernels/<pan2cli version>/torch<torch>-cu<cuda>-<arch>/<source hash>/

(`<cache>` is `PAN2_CACHE_DIR` or `~/.cache/pan2`) with `build.log` beside the library. An OS-level file
lock (`filelock`, freed by the OS if its holder dies) is held across build and load, so several ranks on
one host build once and a killed build never blocks later runs. `PAN2_KERNEL_VERBOSE=1` streams the
compiler output to the terminal as well. The build folder also records which Triton caches hold the
decoder's compiled convolutions (`convs_compiled`). `PAN2_KERNEL_EXPERIMENTAL=1` adds the prototypes of
`kernels/experimental/` (not yet measured; the decode does not call them), as another build.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import shutil
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType, SimpleNamespace

import torch

from pan2cli.errors import InputError, KernelBuildError
from pan2cli.paths import cache_dir
from pan2cli.resources import kernels_dir
from pan2cli.triton_support import triton_available
from pan2cli.vae.kernel.ops import register_ops
from pan2cli.version import __version__

EXTENSION = "wan22_vae_decode"
# Compute capability -> the arch-specific target we compile for (wgmma/TMA need the `a` variants).
SUPPORTED_ARCHS = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}

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


def _cutlass_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nvidia-cutlass")
    except PackageNotFoundError:
        return "none"


@dataclass(frozen=True)
class KernelSpec:
    """What identifies one build: sources, flags, the target arch and the versions around them."""

    arch: str
    sources: tuple[Path, ...]
    source_hash: str

    @property
    def build_dir(self) -> Path:
        cuda = (torch.version.cuda or "none").replace(".", "")
        torch_version = torch.__version__.split("+")[0]
        return (
            cache_dir()
            / "kernels"
            / __version__
            / f"torch{torch_version}-cu{cuda}-{self.arch}"
            / self.source_hash
        )

    @property
    def log_path(self) -> Path:
        return self.build_dir / "build.log"

    @property
    def library(self) -> Path:
        return self.build_dir / f"{EXTENSION}.so"

    @property
    def convs_marker(self) -> Path:
        """Lists the Triton cache folders into which a decoder's convolutions were compiled, one a line."""
        return self.build_dir / "triton-convs-compiled"

    @property
    def cuda_flags(self) -> list[str]:
        number = self.arch.removeprefix("sm_")
        # Only the present GPU's arch: `-gencode` keeps nvcc from adding a plain sm_XX pass that rejects
        # arch-specific instructions. NDEBUG: a device-side assert is a function call, across which ptxas
        # serialises CUTLASS's wgmma pipeline (warning C7510, a large slowdown).
        flags = [
            "-O3",
            "-std=c++17",
            f"-gencode=arch=compute_{number},code={self.arch}",
            "--use_fast_math",
            "-DNDEBUG",
        ]
        conv = CUTLASS_CONV_TARGETS.get(self.arch)
        if conv is not None and cutlass_include_dirs():
            flags.append(f"-DPAN2_CUTLASS_CONV={conv}")
        return flags + experimental_flags()


def experimental_flags() -> list[str]:
    """`-DPAN2_EXPERIMENTAL` (for nvcc and the C++ binding) where PAN2_KERNEL_EXPERIMENTAL=1."""
    return ["-DPAN2_EXPERIMENTAL"] if os.environ.get("PAN2_KERNEL_EXPERIMENTAL", "") not in ("", "0") else []


def kernel_sources() -> tuple[Path, ...]:
    folders = [kernels_dir() / EXTENSION]
    if experimental_flags():
        folders.append(kernels_dir() / "experimental")
    return tuple(
        sorted(p for folder in folders for p in folder.iterdir() if p.suffix in (".cu", ".cpp", ".h", ".cuh"))
    )


def current_arch(device: torch.device | None = None) -> str | None:
    """The build target for this CUDA device, or None when it is not one we compile for."""
    if not torch.cuda.is_available():
        return None
    return SUPPORTED_ARCHS.get(torch.cuda.get_device_capability(device))


def kernel_spec(arch: str) -> KernelSpec:
    sources = kernel_sources()
    digest = hashlib.sha256()
    for path in sources:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    digest.update(" ".join(KernelSpec(arch, (), "").cuda_flags).encode())
    digest.update(_cutlass_version().encode())  # other headers, another build
    return KernelSpec(arch, sources, digest.hexdigest()[:16])


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


def _first_compiler_error(log: str) -> str:
    for line in log.splitlines():
        if re.search(r"\berror\b", line, re.IGNORECASE) and "Error building extension" not in line:
            return line.strip()
    return log.strip().splitlines()[-1] if log.strip() else "the build failed without output"


@contextlib.contextmanager
def _output_to(log_path: Path, echo: bool):
    """Send the build's stdout/stderr (ours and the compiler's, at the fd level) to the log.

    With `echo` the output also reaches the terminal (stderr): a pipe and a thread copy it to both, so
    the log keeps the whole output either way.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        tee = None
        if echo:
            read_end, write_end = os.pipe()

            def copy() -> None:
                while chunk := os.read(read_end, 65536):
                    log.write(chunk)
                    os.write(saved[1], chunk)

            tee = threading.Thread(target=copy, daemon=True)
            tee.start()
            target = write_end
        else:
            target = log.fileno()
        os.dup2(target, 1)
        os.dup2(target, 2)
        if echo:
            os.close(write_end)  # fds 1 and 2 hold the pipe now
        try:
            yield
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            if tee is not None:
                tee.join()  # the pipe's last writer is gone: the copy ends
                os.close(read_end)
            os.close(saved[0])
            os.close(saved[1])


def _import_built(library: Path) -> ModuleType | None:
    """Import a cached build directly: the build folder is named by the source hash, flags and versions,
    so a library there is current, and `cpp_extension.load` would run ninja (and import setuptools) only
    to find that out. None if it cannot be imported (a build killed mid-link): then it is rebuilt."""
    import importlib.util

    try:
        module_spec = importlib.util.spec_from_file_location(EXTENSION, library)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    except ImportError:
        return None
    return module


def load_kernel(device: torch.device | None = None) -> SimpleNamespace:
    """Build (once, cached) and import the extension for this GPU; returns its ops (`torch.ops.pan2.*`).

    Raises:
        KernelBuildError: unsupported GPU, missing compiler, or a failed build; names the first compiler
            error and the build log's path (which keeps the whole output).
    """
    arch = current_arch(device)
    if arch is None:
        raise KernelBuildError("no supported CUDA GPU (the decode kernel needs sm_90a, sm_100a or sm_103a)")
    if arch in _loaded:
        return _loaded[arch]
    from filelock import FileLock

    spec = kernel_spec(arch)
    spec.build_dir.mkdir(parents=True, exist_ok=True)
    verbose = os.environ.get("PAN2_KERNEL_VERBOSE", "") not in ("", "0")
    with FileLock(str(spec.build_dir / "pan2.lock")):
        # torch's own lock file is created exclusively and outlives a killed build: under our lock no
        # other process is building here, so a leftover one is stale.
        (spec.build_dir / "lock").unlink(missing_ok=True)
        # MAX_JOBS: honoured when set; ninja's default otherwise.
        if not spec.library.exists():
            with open(spec.log_path, "w") as log:
                log.write(f"# pan2 {__version__}: building {EXTENSION} for {arch} ({spec.source_hash})\n")
        module = _import_built(spec.library) if spec.library.exists() else None
        try:
            if module is None:
                from torch.utils import cpp_extension  # imports setuptools: only when building

                with _output_to(spec.log_path, echo=verbose):
                    module = cpp_extension.load(
                        name=EXTENSION,
                        sources=[str(p) for p in spec.sources if p.suffix in (".cu", ".cpp")],
                        extra_cflags=["-O3", "-std=c++17", *experimental_flags()],
                        extra_cuda_cflags=spec.cuda_flags,
                        extra_include_paths=[str(d) for d in cutlass_include_dirs()],
                        build_directory=str(spec.build_dir),
                        verbose=True,
                    )
        except Exception as exc:
            log = spec.log_path.read_text(errors="replace") if spec.log_path.exists() else str(exc)
            first = _first_compiler_error(log + "\n" + str(exc))
            raise KernelBuildError(
                f"building the decode kernel failed: {first} (full log: {spec.log_path})",
                hint="set PAN2_KERNEL_VERBOSE=1 to see the compiler output; --decode-kernel off uses the reference decoder",
            ) from exc
        _loaded[arch] = register_ops(module)
    return _loaded[arch]


def _triton_cache_dir() -> str:
    import triton

    return str(triton.knobs.cache.dir)


def convs_compiled(arch: str) -> bool:
    """Whether this machine compiled the fixed-order Triton convolutions for `arch` (into the Triton
    cache in use now), so that a decode only loads them; always True where Triton is not used."""
    if not triton_available():
        return True
    marker = kernel_spec(arch).convs_marker
    return marker.exists() and _triton_cache_dir() in marker.read_text().splitlines()


def mark_convs_compiled(arch: str) -> None:
    if triton_available() and not convs_compiled(arch):
        marker = kernel_spec(arch).convs_marker
        marker.parent.mkdir(parents=True, exist_ok=True)
        with open(marker, "a") as f:  # one line each: another TRITON_CACHE_DIR does not undo this one
            f.write(_triton_cache_dir() + "\n")


def clean_kernel_cache() -> tuple[Path, bool]:
    """Remove every cached build of every version.

    Returns:
        `(folder, removed)`: the cache's kernel folder, and whether it was there to remove.

    Raises:
        InputError: the folder, or one above it (`PAN2_CACHE_DIR=/etc/passwd`), is a file.
    """
    folder = cache_dir() / "kernels"
    for path in (folder, *folder.parents):
        if path.exists() or path.is_symlink():
            if not path.is_dir():
                raise InputError(
                    f"the kernel cache {folder} cannot be there: {path} is a file, not a folder",
                    hint="set PAN2_CACHE_DIR to a folder (default ~/.cache/pan2)",
                )
            break
    if not folder.exists():
        return folder, False
    shutil.rmtree(folder)
    return folder, True
