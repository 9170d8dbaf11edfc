"""Build, cache and load the compiled Wan2.2 decode kernel; the only module that imports the extension.

The extension (C++/CUDA in `kernels/wan22_vae_decode/`, shipped as `pan2cli/_kernels`) is built on first
use with `torch.utils.cpp_extension` (ninja) for the GPU it runs on only (sm_90a for H100/H200, sm_100a /
sm_103a for B200/B300) into

    <cache>/kernels/<pan2cli version>/torch<torch>-cu<cuda>-<arch>/<source hash>/

(`<cache>` is `PAN2_CACHE_DIR` or `~/.cache/pan2`) with `build.log` beside the library. An OS-level file
lock (`filelock`, freed by the OS if its holder dies) is held across build and load, so several ranks on
one host build once and a killed build never blocks later runs. `PAN2_KERNEL_VERBOSE=1` streams the
compiler output to the terminal as well.
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

import pan2cli
from pan2cli.errors import InputError, KernelBuildError
from pan2cli.paths import cache_dir
from pan2cli.resources import kernels_dir
from pan2cli.triton_support import triton_available

EXTENSION = "wan22_vae_decode"
# Compute capability -> the arch-specific target we compile for (wgmma/TMA need the `a` variants).
SUPPORTED_ARCHS = {(9, 0): "sm_90a", (10, 0): "sm_100a", (10, 3): "sm_103a"}

_loaded: dict[str, SimpleNamespace] = {}


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
            / pan2cli.__version__
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
        # arch-specific instructions.
        return ["-O3", "-std=c++17", f"-gencode=arch=compute_{number},code={self.arch}", "--use_fast_math"]


def kernel_sources() -> tuple[Path, ...]:
    folder = kernels_dir() / EXTENSION
    return tuple(sorted(p for p in folder.iterdir() if p.suffix in (".cu", ".cpp", ".h", ".cuh")))


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


# The ops' schemas: every op writes into tensors the caller allocated and returns nothing. No argument
# has a default (torch 2.11 drops defaulted arguments before bumping the version counters of mutated
# ones, then indexes past the end). Shapes (channels-last bf16, fp32 vectors) are checked in binding.cpp.
_OP_SCHEMAS = {
    # out = SiLU?(RMS(x + bias + residual) * gamma) over C, or the plain sum without `normalize`.
    # x, residual, sum_out, out: [B, T, H, W, C] bf16, dense over (H, W, C) (frames may be strided);
    # gamma, bias: [C] fp32 (gamma already times sqrt(C)); history: [B, 2, H, W, C] bf16, receives the
    # last two frames of out. fp32 statistics; the sum is rounded to bf16 once before the norm.
    "rms_norm_silu": "rms_norm_silu(Tensor x, Tensor gamma, Tensor? bias, Tensor? residual, Tensor(a!)? sum_out, "
    "Tensor(b!) out, bool silu, Tensor(c!)? history, bool normalize) -> ()",
    # out [B, T, 2h, 2w, C] bf16 = interleaved phases [B*T, h+1, w+1, 4C] + bias [C] fp32 + DupUp3D(shortcut);
    # shortcut: the block input [B, T_in, h, w, C_in] bf16; fp32 sum, one bf16 rounding.
    "phase_interleave": "phase_interleave(Tensor phases, Tensor bias, Tensor? shortcut, Tensor(a!) out, "
    "int factor_t, int frame_offset) -> ()",
    # out [N, 2H, 2W, 3] uint8 = round((clamp(unpatchify(y [N, H, W, 12] bf16 + bias [12] fp32)) + 1) * 127.5).
    "head_to_uint8": "head_to_uint8(Tensor y, Tensor bias, Tensor(a!) out) -> ()",
}
_library: list[torch.library.Library] = []  # the `pan2` op namespace, defined once per process


def _register_ops(module: ModuleType) -> SimpleNamespace:
    """Expose the extension's three ops as `torch.ops.pan2.*`, with shape-only fakes for `torch.compile`.

    Registered through `torch.library.Library` (schema, CUDA kernel, fake), not `torch.library.custom_op`:
    a custom op's first call imports torch's whole compiler stack (torch._dynamo, sympy: about 3 s,
    issue 14) to wrap its kernel, and these ops run inside every decode. The fakes are no-ops (the
    ops return nothing); `torch.compile` sees the writes through the `(a!)` annotations.
    """
    if not _library:
        library = torch.library.Library("pan2", "DEF")
        for name, schema in _OP_SCHEMAS.items():
            library.define(schema)
            # Looked up at call time: a rebuilt extension (tests) replaces the module behind the ops.
            # CPU too, so tests can stand in a module without a GPU: the real binding refuses CPU tensors.
            for key in ("CUDA", "CPU"):
                library.impl(name, _calling_the_extension(name), key)
            torch.library.register_fake(f"pan2::{name}", lambda *args, **kwargs: None, lib=library)
        _library.append(library)
    _extension.append(module)
    return SimpleNamespace(**{name: getattr(torch.ops.pan2, name) for name in _OP_SCHEMAS})


def _calling_the_extension(name: str):
    def op(*args) -> None:
        getattr(_ops(), name)(*args)

    return op


_extension: list[ModuleType] = []


def _ops() -> ModuleType:
    return _extension[-1]


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
                log.write(
                    f"# pan2 {pan2cli.__version__}: building {EXTENSION} for {arch} ({spec.source_hash})\n"
                )
        module = _import_built(spec.library) if spec.library.exists() else None
        try:
            if module is None:
                from torch.utils import cpp_extension  # imports setuptools: only when building

                with _output_to(spec.log_path, echo=verbose):
                    module = cpp_extension.load(
                        name=EXTENSION,
                        sources=[str(p) for p in spec.sources if p.suffix in (".cu", ".cpp")],
                        extra_cflags=["-O3", "-std=c++17"],
                        extra_cuda_cflags=spec.cuda_flags,
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
        _loaded[arch] = _register_ops(module)
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


def _mark_convs_compiled(arch: str) -> None:
    if triton_available() and not convs_compiled(arch):
        marker = kernel_spec(arch).convs_marker
        marker.parent.mkdir(parents=True, exist_ok=True)
        with open(marker, "a") as f:  # one line each: another TRITON_CACHE_DIR does not undo this one
            f.write(_triton_cache_dir() + "\n")


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


def clean_kernel_cache() -> Path:
    """Remove every cached build of every version; returns the folder emptied."""
    folder = cache_dir() / "kernels"
    if folder.exists():
        shutil.rmtree(folder)
    return folder


def select_decode_path(decoder, mode: str | None = None):
    """The decoder to run: the compiled kernel path where it applies, else the reference one.

    Args:
        decoder: a loaded `WanVAEDecoder`.
        mode: "auto" | "off" | "require"; default the decoder config's `decode_kernel`.

    Returns:
        `(decoder, note)`: a `WanKernelDecoder` or the reference itself, and one line saying why the
        reference runs on a GPU under "auto" (None otherwise, and on the CPU, where it is the only path).

    Raises:
        InputError: "require" where the kernel cannot apply (CPU, fp32, another GPU).
        KernelBuildError: "require" and the build failed.
    """
    mode = mode or decoder.config.decode_kernel
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
                _mark_convs_compiled(current_arch(decoder.device))
            return kernel_decoder, None
    elif mode == "require":
        raise InputError(f"--decode-kernel require: {reason}", hint="use --decode-kernel auto or off")
    if decoder.device.type == "cpu":
        return decoder, None  # the reference decoder is the CPU path: nothing to explain
    return decoder, f"Using the reference decoder: {reason}."
