"""The compiled kernel decode path at full TI2V-5B width (random weights) on a CUDA GPU.

Accuracy against the fp32 reference (judged relative to the bf16 reference, as flash-attention's tests
judge their kernels), chunk-size invariance, the first-use build and its cached reuse in new processes,
and the peak memory of long decodes. Meant to take about three minutes on one H200.

Order matters for the memory tests: they run first, with nothing else on the GPU, and every group of
tests builds its decoders in class-scoped fixtures, freed when the group ends.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from pan2cli.config import DEFAULT_CHUNK_LATENT_FRAMES
from pan2cli.frames import psnr
from pan2cli.testing.random_weights import decoder_from_state
from pan2cli.vae.model import WanVAEDecoder
from tests.subprocess_env import python_env

REPO = Path(__file__).resolve().parents[3]

# Full-width decodes take up to 76 GiB of an 80 GB card (their fp32 references): one worker runs them in turn
# (`--dist loadgroup`, docs/TESTING.md).
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.xdist_group("full-size-gpu-memory"),
]

GIB = 2**30


# -- helpers ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module", autouse=True)
def _kernel_target():
    """The kernel is built for sm_90a / sm_100a / sm_103a only; on another GPU there is nothing to test."""
    from pan2cli.vae.kernel.build import current_arch

    if current_arch() is None:
        major, minor = torch.cuda.get_device_capability()
        pytest.skip(f"sm_{major}{minor} is not a kernel target")


@pytest.fixture(autouse=True)
def _release_cached_memory():
    """Give the caching allocator's free blocks back after every test (full-size activations are GiBs)."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


def _decoder(state, dtype, device) -> WanVAEDecoder:
    """The reference decoder at full size with `state`'s weights in `dtype` on `device`."""
    return decoder_from_state(state, dtype=dtype, device=device)


def _kernel_decoder(reference):
    from pan2cli.vae.kernel.build import load_kernel
    from pan2cli.vae.kernel.decoder import WanKernelDecoder

    return WanKernelDecoder(reference, load_kernel())


def _latents(t: int, h: int, w: int, seed: int) -> torch.Tensor:
    return torch.randn(1, 48, t, h, w, generator=torch.Generator().manual_seed(seed))


def _frames(decoder, z: torch.Tensor, chunk_latent_frames: int = DEFAULT_CHUNK_LATENT_FRAMES) -> torch.Tensor:
    """uint8 `(B, F, H, W, 3)` on the GPU: the decoder's chunks put together along time."""
    return torch.cat(list(decoder.decode_uint8_chunks(z, chunk_latent_frames)), dim=1)


def _mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).pow(2).mean().item()


@contextmanager
def _tf32_off():
    """IEEE fp32 matmuls and cuDNN convolutions (PyTorch runs fp32 cuDNN convolutions as TF32 by default)."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _forget_last_failure() -> None:
    """Drop the traceback pytest keeps of an earlier failed test: its frames would keep that test's GPU tensors."""
    for name in ("last_type", "last_value", "last_traceback", "last_exc"):
        if hasattr(sys, name):
            setattr(sys, name, None)


# -- peak memory (first: nothing else may be on the GPU) -----------------------------------------------
@pytest.fixture(scope="class")
def lone_kernel_decoder(full_size_state):
    """The kernel decoder alone on the GPU: its bf16 weights and nothing else (the reference is dropped)."""
    _forget_last_failure()
    gc.collect()
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    assert baseline <= 64 * 2**20, (
        f"{baseline / GIB:.2f} GiB already allocated before the kernel decoder is built"
    )
    reference = _decoder(full_size_state, torch.bfloat16, "cuda")
    kernel = _kernel_decoder(reference)
    del reference
    gc.collect()
    torch.cuda.empty_cache()
    return kernel


class TestPeakMemory:
    @pytest.mark.parametrize("latent_frames", [31, 121], ids=["5s", "20s"])
    def test_peak_memory_of_a_long_decode_is_bounded(self, lone_kernel_decoder, latent_frames):
        """A 704x1248 decode of 5 s and 20 s (121 / 481 frames) at default chunking peaks at ≤ 6 GiB allocated
        (the bound the README states), weights included, with the chunks consumed as they come (as `pan2 decode` does):
        memory must not grow with the video's length.

        Measured on an H200 by scripts/bench_decode.py, whose latents sit on the GPU (here on the CPU):
        5.80 GiB (5 s) and 5.86 GiB (20 s) since conv_out keeps time partials instead of a history ring
        (docs/KERNEL_NOTES.md)."""
        z = _latents(latent_frames, 44, 78, seed=latent_frames)  # on the CPU, like loaded latents
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        frames = 0
        for chunk in lone_kernel_decoder.decode_uint8_chunks(z):
            assert chunk.dtype == torch.uint8
            assert chunk.shape[0] == 1 and chunk.shape[2:] == (704, 1248, 3)
            frames += chunk.shape[1]
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        assert frames == 4 * latent_frames - 3
        assert peak <= 6 * GIB, f"peak {peak / GIB:.2f} GiB allocated"


# -- accuracy and chunk invariance ------------------------------------------------------------------------
@pytest.fixture(scope="class")
def fp32_reference(full_size_state):
    return _decoder(full_size_state, torch.float32, "cuda")


@pytest.fixture(scope="class")
def bf16_reference(full_size_state):
    return _decoder(full_size_state, torch.bfloat16, "cuda")


@pytest.fixture(scope="class")
def kernel_decoder(bf16_reference):
    return _kernel_decoder(bf16_reference)


# (T, H, W) latent shapes: small frames (96x160) for the temporal cases, then 704x1248 (the TI2V-5B
# 720p size's latent) and 704x1280 at full frame size.
ACCURACY_SHAPES = [
    *((t, 6, 10) for t in (1, 2, 5, 9)),
    *((t, 44, 78) for t in (1, 2, 5, 9)),
    *((t, 44, 80) for t in (1, 2, 5)),
]


class TestFullWidthKernel:
    @pytest.mark.parametrize("t, h, w", ACCURACY_SHAPES, ids=[f"T{t}-{h}x{w}" for t, h, w in ACCURACY_SHAPES])
    def test_kernel_is_as_accurate_as_the_bf16_reference(
        self, fp32_reference, bf16_reference, kernel_decoder, t, h, w
    ):
        """Against the fp32 reference (TF32 off), the kernel's uint8 frames have an MSE at most twice the bf16
        reference's (+ 0.05, so that a bf16 error of exactly 0 cannot make this flaky) and a PSNR ≥ 35 dB.

        The bf16 reference is the yardstick for "rounding error of a bf16 decode"; a kernel bug (wrong
        tap, history, phase or halo) costs far more than a factor of 2.
        """
        z = _latents(t, h, w, seed=1000 * t + h + w).cuda()
        with _tf32_off():
            truth = _frames(fp32_reference, z)
            reference = _frames(bf16_reference, z)
            got = _frames(kernel_decoder, z)
        shape = (1, 4 * t - 3, 16 * h, 16 * w, 3)
        assert got.shape == reference.shape == truth.shape == shape
        assert got.dtype == torch.uint8
        kernel_error, reference_error = _mse(got, truth), _mse(reference, truth)
        message = f"MSE against fp32: kernel {kernel_error:.4f}, bf16 reference {reference_error:.4f}"
        assert kernel_error <= 2 * reference_error + 0.05, message
        assert psnr(got, truth) >= 35, message

    def test_kernel_output_does_not_depend_on_the_chunk_size(self, kernel_decoder):
        """At 704x1248, chunks of 1, 2, 4 and 8 latent frames give the frames of chunks of 4 within 1 level
        (other chunk shapes may round differently in bf16, never by more)."""
        z = _latents(9, 44, 78, seed=9).cuda()
        expected = _frames(kernel_decoder, z, 4).to(torch.int16)
        assert expected.shape == (1, 33, 704, 1248, 3)
        for n in (1, 2, 8):
            got = _frames(kernel_decoder, z, n).to(torch.int16)
            assert got.shape == expected.shape
            assert (got - expected).abs().max().item() <= 1, f"chunk_latent_frames={n}"


# -- first-use build, cached reuse -------------------------------------------------------------------------
_LOAD_AND_REPORT = """
import json, time
from pan2cli.vae.kernel.build import kernel_spec, load_kernel
from pan2cli.vae.kernel.status import kernel_status

before = kernel_status()
start = time.perf_counter()
load_kernel()
seconds = time.perf_counter() - start
after = kernel_status()
spec = kernel_spec(after.arch)
print(json.dumps({
    "built_before": before.built, "built_after": after.built, "arch": after.arch,
    "build_dir": str(after.build_dir), "library": str(spec.library), "log": str(spec.log_path),
    "decode_path": after.decode_path, "seconds": seconds,
}))
"""


def _load_in_new_process(cache: Path) -> dict:
    env = python_env(PAN2_CACHE_DIR=str(cache))
    env.pop("PAN2_KERNEL_VERBOSE", None)  # compiler output to build.log
    command = [sys.executable, "-c", _LOAD_AND_REPORT]
    proc = subprocess.run(
        command, check=False, capture_output=True, text=True, env=env, cwd=REPO, timeout=600
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_first_use_builds_into_the_cache_and_new_processes_reuse_it(tmp_path):
    """With an empty `PAN2_CACHE_DIR` the first `load_kernel()` builds the extension there (library and
    build.log in the spec's build dir, `kernel_status` flips to built); a second process with the same
    cache loads that library without rebuilding: the .so is not rewritten and build.log is only appended
    to (its build header is written once, by the build)."""
    cache = tmp_path / "cache"
    first = _load_in_new_process(cache)
    assert not first["built_before"] and first["built_after"]
    assert Path(first["build_dir"]).is_relative_to(cache)
    library, log = Path(first["library"]), Path(first["log"])
    assert library.is_file() and library.parent == log.parent == Path(first["build_dir"])
    assert "built, loads from the cache" in first["decode_path"]
    first_log = log.read_text(errors="replace")
    assert first_log.startswith("# pan2 ") and ": building wan22_vae_decode for " in first_log
    library_mtime = library.stat().st_mtime_ns

    second = _load_in_new_process(cache)
    assert second["built_before"] and second["built_after"]
    assert second["library"] == first["library"]
    assert library.stat().st_mtime_ns == library_mtime, "the second process rebuilt the library"
    second_log = log.read_text(errors="replace")
    assert second_log.startswith(first_log), "build.log was rewritten: the second process started a build"
    assert second_log.count(": building wan22_vae_decode for ") == 1


_COMPILE_THEN_DECODE = """
import json, os, torch
from pan2cli.vae.config import WanVAEConfig
from pan2cli.vae.kernel.build import load_kernel
from pan2cli.vae.kernel.choice import compile_convolutions
from pan2cli.vae.kernel.decoder import WanKernelDecoder
from pan2cli.vae.kernel.status import kernel_status
from pan2cli.vae.model import WanVAEDecoder

before_build = kernel_status().convs_compiled
compile_convolutions()
cache = os.environ["TRITON_CACHE_DIR"]
compiled = sorted(os.listdir(cache))
with torch.device("meta"):
    reference = WanVAEDecoder(WanVAEConfig())
reference = reference.to_empty(device="cuda").to(torch.bfloat16).eval()
decoder = WanKernelDecoder(reference, load_kernel())
for shape, chunk in (((1, 48, 3, 5, 7), 2), ((1, 48, 6, 12, 20), 4), ((1, 48, 2, 16, 33), 1)):
    for _ in decoder.decode_uint8_chunks(torch.zeros(shape, device="cuda"), chunk):
        pass
torch.cuda.synchronize()
print(json.dumps({"before_build": before_build, "after_build": kernel_status().convs_compiled,
                  "compiled": len(compiled), "cutlass": bool(load_kernel().cutlass_conv_configs), "new": [e for e in sorted(os.listdir(cache)) if e not in compiled]}))
"""


def test_kernels_build_compiles_every_convolution_of_every_video_size(tmp_path):
    """`pan2 kernels build` compiles the fixed-order convolutions once per layer, and decodes
    of other sizes, frame counts and chunks then compile nothing more (Triton would otherwise compile
    a variant per divisibility of the problem's sizes, inside the first decode of each size)."""
    env = python_env(TRITON_CACHE_DIR=str(tmp_path / "triton"))
    proc = subprocess.run(
        [sys.executable, "-c", _COMPILE_THEN_DECODE], capture_output=True, text=True, env=env, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["before_build"] is False and report["after_build"] is True
    # The Triton layer kinds of the full-size decoder: 7 without the CUTLASS conv; with it, the 48-channel
    # layers only (conv_in with three time taps and with one, post_quant_conv).
    assert report["compiled"] >= (3 if report["cutlass"] else 7)
    assert report["new"] == []
