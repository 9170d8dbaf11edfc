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


def _register_ops(module: ModuleType) -> SimpleNamespace:
    """Expose the extension's three ops as `torch.ops.pan2.*` custom ops with shape-only fakes.

    Every op writes into tensors the caller allocated (`out`, and `sum_out` / `history` where given) and
    returns nothing, so each fake is a no-op; `torch.compile` sees the mutations through `mutates_args`.
    No argument has a default: torch 2.11 drops defaulted arguments before bumping the version counters
    of mutated ones and then indexes past the end (seen with `history=None`).
    Shapes (channels-last bf16, fp32 vectors) are checked in binding.cpp.
    """
    if not hasattr(torch.ops.pan2, "rms_norm_silu"):

        @torch.library.custom_op("pan2::rms_norm_silu", mutates_args=("sum_out", "out", "history"))
        def rms_norm_silu(
            x: torch.Tensor,
            gamma: torch.Tensor,
            bias: torch.Tensor | None,
            residual: torch.Tensor | None,
            sum_out: torch.Tensor | None,
            out: torch.Tensor,
            silu: bool,
            history: torch.Tensor | None,
            normalize: bool,
        ) -> None:
            """out = SiLU?(RMS(x + bias + residual) * gamma) over C, or the plain sum without `normalize`.

            x, residual, sum_out, out: [B, T, H, W, C] bf16, dense over (H, W, C) (frames may be strided);
            gamma, bias: [C] fp32 (gamma already times sqrt(C)); history: [B, 2, H, W, C] bf16, receives the
            last two frames of out. fp32 statistics; the sum is rounded to bf16 once before the norm.
            """
            _ops().rms_norm_silu(x, gamma, bias, residual, sum_out, out, silu, history, normalize)

        @torch.library.custom_op("pan2::phase_interleave", mutates_args=("out",))
        def phase_interleave(
            phases: torch.Tensor,
            bias: torch.Tensor,
            shortcut: torch.Tensor | None,
            out: torch.Tensor,
            factor_t: int,
            frame_offset: int,
        ) -> None:
            """out [B, T, 2h, 2w, C] bf16 = interleaved phases [B*T, h+1, w+1, 4C] + bias [C] fp32 + DupUp3D(shortcut).

            shortcut: the block input [B, T_in, h, w, C_in] bf16; fp32 sum, one bf16 rounding.
            """
            _ops().phase_interleave(phases, bias, shortcut, out, factor_t, frame_offset)

        @torch.library.custom_op("pan2::head_to_uint8", mutates_args=("out",))
        def head_to_uint8(y: torch.Tensor, bias: torch.Tensor, out: torch.Tensor) -> None:
            """out [N, 2H, 2W, 3] uint8 = round((clamp(unpatchify(y [N, H, W, 12] bf16 + bias [12] fp32)) + 1) * 127.5)."""
            _ops().head_to_uint8(y, bias, out)

        for op in (rms_norm_silu, phase_interleave, head_to_uint8):
            op.register_fake(lambda *args, **kwargs: None)
    _extension.append(module)
    return SimpleNamespace(
        rms_norm_silu=torch.ops.pan2.rms_norm_silu,
        phase_interleave=torch.ops.pan2.phase_interleave,
        head_to_uint8=torch.ops.pan2.head_to_uint8,
    )


_extension: list[ModuleType] = []


def _ops() -> ModuleType:
    return _extension[-1]


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
    from torch.utils import cpp_extension

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
                log.write(f"# pan2 {pan2cli.__version__}: building {EXTENSION} for {arch} ({spec.source_hash})\n")
        try:
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


@dataclass(frozen=True)
class KernelStatus:
    arch: str | None
    built: bool
    build_dir: Path | None
    decode_path: str  # which path `pan2 decode` would take, and why
    convs: str | None = None  # the convolution engines of the path `pan2 decode` would run


def kernel_status(device: torch.device | None = None) -> KernelStatus:
    """What is built for this machine's GPU and which decode path a default decode would run."""
    arch = current_arch(device)
    if arch is None:
        if not torch.cuda.is_available():
            reason, convs = "reference PyTorch decoder: no CUDA GPU", "PyTorch's CPU convolutions (the reference decoder)"
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
    return KernelStatus(arch, built, spec.build_dir, path, convs)


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
            from pan2cli.vae.kernel_decoder import WanKernelDecoder

            return WanKernelDecoder(decoder, ops), None
    elif mode == "require":
        raise InputError(f"--decode-kernel require: {reason}", hint="use --decode-kernel auto or off")
    if decoder.device.type == "cpu":
        return decoder, None  # the reference decoder is the CPU path: nothing to explain
    return decoder, f"Using the reference decoder: {reason}."
