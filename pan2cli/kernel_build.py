"""Build, cache and import pan2's compiled CUDA extensions, each described by an `ExtensionSpec`.

Two extensions ship: the Wan2.2 VAE decoder's (`pan2cli.vae.kernel.build`) and the fp8 attention's
(`pan2cli.dit.cuda_fp8_attention`). Each is built on first use with `torch.utils.cpp_extension` (ninja) for
the GPU it runs on only (sm_90a for H100/H200, sm_100a / sm_103a for B200/B300) into

    <cache>/kernels/<pan2cli version>/torch<torch>-cu<cuda>-<arch>/<name>-<hash>/

(`<cache>` is `PAN2_CACHE_DIR` or `~/.cache/pan2`) with `build.log` beside the library. The hash covers the
sources, the flags and the spec's `extra_key` (another version of headers from a package), so a change to
any of them is another build and an old one is never loaded. An OS-level file lock (`filelock`, freed by the
OS if its holder dies) is held across build and load, so several ranks on one host build once and a killed
build never blocks later runs. `PAN2_KERNEL_VERBOSE=1` streams the compiler output to the terminal as well.
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
from functools import cached_property
from pathlib import Path
from types import ModuleType

import torch

from pan2cli.errors import InputError, KernelBuildError
from pan2cli.paths import cache_dir
from pan2cli.version import __version__

# Compute capability -> the arch-specific target we compile for (wgmma/TMA need the `a` variants).
SUPPORTED_ARCHS = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}
SOURCE_SUFFIXES = (".cu", ".cpp", ".h", ".cuh")

_loaded: dict[Path, ModuleType] = {}  # build folder -> the imported extension, once per process


def current_arch(device: torch.device | None = None) -> str | None:
    """The build target for this CUDA device, or None when it is not one we compile for."""
    if not torch.cuda.is_available():
        return None
    return SUPPORTED_ARCHS.get(torch.cuda.get_device_capability(device))


def arch_flags(arch: str) -> list[str]:
    """nvcc flags every extension compiles with for `arch`."""
    number = arch.removeprefix("sm_")
    # Only the present GPU's arch: `-gencode` keeps nvcc from adding a plain sm_XX pass that rejects
    # arch-specific instructions. NDEBUG: a device-side assert is a function call, across which ptxas
    # serialises a wgmma pipeline (warning C7510, a large slowdown).
    return ["-O3", "-std=c++17", f"-gencode=arch=compute_{number},code={arch}", "--use_fast_math", "-DNDEBUG"]


def sources_in(*folders: Path) -> tuple[Path, ...]:
    """The C++/CUDA files of `folders` (sources and headers), sorted: what a build reads and hashes."""
    return tuple(sorted(p for folder in folders for p in folder.iterdir() if p.suffix in SOURCE_SUFFIXES))


@dataclass(frozen=True)
class ExtensionSpec:
    """One build of one extension: what it compiles, how, and for which GPU.

    Attributes:
        name: the Python module's name (`TORCH_EXTENSION_NAME`), e.g. "wan22_vae_decode".
        arch: the target, a value of `SUPPORTED_ARCHS`.
        sources: the extension's files (hashed); the `.cu` and `.cpp` ones are compiled.
        headers: other files its sources include (hashed, not compiled).
        cuda_flags: nvcc's flags (`arch_flags(arch)` and the extension's own).
        cxx_flags: the host compiler's flags (the binding).
        include_dirs: header folders outside `sources` (CUTLASS's).
        extra_key: anything else that changes the build, e.g. the version of the package of `include_dirs`.
        what: how messages name the extension ("the decode kernel").
        hint: what a user can do when it fails to build.
    """

    name: str
    arch: str
    sources: tuple[Path, ...]
    cuda_flags: tuple[str, ...]
    headers: tuple[Path, ...] = ()
    cxx_flags: tuple[str, ...] = ("-O3", "-std=c++17")
    include_dirs: tuple[Path, ...] = ()
    extra_key: str = ""
    what: str = "the kernel"
    hint: str = "set PAN2_KERNEL_VERBOSE=1 to see the compiler output"

    @cached_property
    def source_hash(self) -> str:
        digest = hashlib.sha256()
        for path in (*self.sources, *self.headers):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
        for part in (self.cuda_flags, self.cxx_flags, (self.extra_key,)):
            digest.update(" ".join(part).encode())
        return digest.hexdigest()[:16]

    @property
    def build_dir(self) -> Path:
        cuda = (torch.version.cuda or "none").replace(".", "")
        torch_version = torch.__version__.split("+")[0]
        versions = f"torch{torch_version}-cu{cuda}-{self.arch}"
        return cache_dir() / "kernels" / __version__ / versions / f"{self.name}-{self.source_hash}"

    @property
    def log_path(self) -> Path:
        return self.build_dir / "build.log"

    @property
    def library(self) -> Path:
        return self.build_dir / f"{self.name}.so"


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


def _import_built(name: str, library: Path) -> ModuleType | None:
    """Import a cached build directly: the build folder is named by the source hash, flags and versions,
    so a library there is current, and `cpp_extension.load` would run ninja (and import setuptools) only
    to find that out. None if it cannot be imported (a build killed mid-link): then it is rebuilt."""
    import importlib.util

    try:
        module_spec = importlib.util.spec_from_file_location(name, library)
        module = importlib.util.module_from_spec(module_spec)
        module_spec.loader.exec_module(module)
    except ImportError:
        return None
    return module


def load_extension(spec: ExtensionSpec) -> ModuleType:
    """Build (once, cached) and import the extension `spec` describes; the same module on later calls.

    Raises:
        KernelBuildError: missing compiler or a failed build; names the first compiler error and the build
            log's path (which keeps the whole output), with `spec.hint`.
    """
    if spec.build_dir in _loaded:
        return _loaded[spec.build_dir]
    from filelock import FileLock

    spec.build_dir.mkdir(parents=True, exist_ok=True)
    verbose = os.environ.get("PAN2_KERNEL_VERBOSE", "") not in ("", "0")
    with FileLock(str(spec.build_dir / "pan2.lock")):
        # torch's own lock file is created exclusively and outlives a killed build: under our lock no
        # other process is building here, so a leftover one is stale.
        (spec.build_dir / "lock").unlink(missing_ok=True)
        # MAX_JOBS: honoured when set; ninja's default otherwise.
        if not spec.library.exists():
            with open(spec.log_path, "w") as log:
                log.write(
                    f"# pan2 {__version__}: building {spec.name} for {spec.arch} ({spec.source_hash})\n"
                )
        module = _import_built(spec.name, spec.library) if spec.library.exists() else None
        try:
            if module is None:
                from torch.utils import cpp_extension  # imports setuptools: only when building

                with _output_to(spec.log_path, echo=verbose):
                    module = cpp_extension.load(
                        name=spec.name,
                        sources=[str(p) for p in spec.sources if p.suffix in (".cu", ".cpp")],
                        extra_cflags=list(spec.cxx_flags),
                        extra_cuda_cflags=list(spec.cuda_flags),
                        extra_include_paths=[str(d) for d in spec.include_dirs],
                        build_directory=str(spec.build_dir),
                        verbose=True,
                    )
        except Exception as exc:
            log = spec.log_path.read_text(errors="replace") if spec.log_path.exists() else str(exc)
            first = _first_compiler_error(log + "\n" + str(exc))
            raise KernelBuildError(
                f"building {spec.what} failed: {first} (full log: {spec.log_path})", hint=spec.hint
            ) from exc
    _loaded[spec.build_dir] = module
    return module


def clean_kernel_cache() -> tuple[Path, bool]:
    """Remove every cached build of every extension and version.

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
