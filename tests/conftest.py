"""Shared fixtures: a tiny random-weight Wan2.2 VAE in every checkpoint layout, latent files, a CLI runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from pan2cli.cli import cli
from pan2cli.testing.random_weights import random_vae_state_dict, write_test_checkpoints
from pan2cli.vae.config import WanVAEConfig

# Reduced decoder width (16 instead of 256): same structure, CPU-sized.
SMALL_VAE = WanVAEConfig(base_dim=16, decoder_base_dim=16)


def pytest_collection_modifyitems(config, items):
    """GPU tests skip without CUDA."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _gpu_memory_given_back(request):
    """A GPU test gives its cached GPU memory back when it ends: pytest-xdist runs the GPU tests in two processes
    on one card, and memory one of them keeps cached (70 GiB after the DiT tests on an 80 GB H100) is memory
    the other's full-size decode cannot have. `PAN2_TEST_GPU_MEMORY_LOG=FILE` appends each GPU test's peak
    (reserved GiB) to FILE, to see which tests must not run side by side (docs/TESTING.md)."""
    if "gpu" not in request.keywords or not torch.cuda.is_available():
        yield
        return
    import gc
    import os

    torch.cuda.reset_peak_memory_stats()
    yield
    log = os.environ.get("PAN2_TEST_GPU_MEMORY_LOG")
    if log:
        with open(log, "a") as file:
            file.write(f"{torch.cuda.max_memory_reserved() / 2**30:.2f} {request.node.nodeid}\n")
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def _hub_offline_state_per_test(monkeypatch):
    """The hub reachability probe switches the process to offline mode for good (pan2cli.checkpoints.hub): undo it after
    each test, so that no test's outcome depends on which test probed first."""
    import os

    from huggingface_hub import constants

    import pan2cli.checkpoints.hub

    monkeypatch.setattr(pan2cli.checkpoints.hub, "_unreachable", pan2cli.checkpoints.hub._unreachable)
    monkeypatch.setattr(
        pan2cli.checkpoints.hub, "_said_unreachable", pan2cli.checkpoints.hub._said_unreachable
    )
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", constants.HF_HUB_OFFLINE)
    # setenv records the variable's value (or its absence) for the teardown; delenv then restores "absent" now
    monkeypatch.setenv("HF_HUB_OFFLINE", os.environ.get("HF_HUB_OFFLINE", ""))
    if not os.environ["HF_HUB_OFFLINE"]:
        monkeypatch.delenv("HF_HUB_OFFLINE")


def _triton_interprets_here() -> bool:
    """Whether this machine runs the Triton kernels in Triton's CPU interpreter: Triton installed, no CUDA."""
    import importlib.util

    return importlib.util.find_spec("triton") is not None and not torch.cuda.is_available()


def pytest_configure(config):
    """Without CUDA, import Triton with `TRITON_INTERPRET=1` before anything else does, and restore the
    environment at once (a test that needs the interpreter's mode sets it for itself:
    `triton_interpreter_without_cuda`).

    Triton defines its own library (`tl.sum`, ...) with `triton.jit` when it is imported, in the mode the
    variable says then; an interpreted kernel calling a compiled library function fails ("Cannot call
    @triton.jit'd outside of the scope of a kernel"). Imported here, before collection, it does not matter
    which test or module imports Triton first."""
    import os
    import sys

    if not _triton_interprets_here():
        return
    if "triton" not in sys.modules:
        with pytest.MonkeyPatch.context() as patch:
            if "TRITON_INTERPRET" not in os.environ:
                patch.setenv("TRITON_INTERPRET", "1")
            import triton  # noqa: F401
    # Its fp8 cast and run-time loop bounds need two fixes (pan2cli.testing.triton_interpreter), for every
    # test module: applied by one module only, a test run alone or first in its worker got the raw cast.
    from pan2cli.testing.triton_interpreter import apply as fix_interpreter

    fix_interpreter()


@pytest.fixture
def triton_interpreter_without_cuda(monkeypatch):
    """Without CUDA, the Triton kernels run in Triton's CPU interpreter (`TRITON_INTERPRET=1`, unless the
    caller's environment sets it); with CUDA, the real kernels. For the test only: set when a test module
    was imported, the variable once stayed set for every later module of the session.

    Early enough: `triton.jit` reads the variable when a kernel is defined, and pan2cli imports its kernel
    modules at their first call, inside a test; `triton_interpreting()` (pan2cli.triton_support) reads it
    at each call; Triton's own library was defined in the interpreter's mode (`pytest_configure`). A
    kernel module once imported keeps the mode it was defined in for the rest of the session. Modules
    with Triton kernels take it with `pytestmark = pytest.mark.usefixtures(...)`."""
    import os

    if _triton_interprets_here() and "TRITON_INTERPRET" not in os.environ:
        monkeypatch.setenv("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def full_size_state():
    """Decoder tensors of the full TI2V-5B VAE (random, γ and biases perturbed), fp32 on the CPU (GPU tests)."""
    state = random_vae_state_dict(WanVAEConfig(), seed=3, encoder=False)
    return {k: v for k, v in state.items() if k.startswith(("decoder.", "post_quant_conv."))}


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """format -> path: `pth` (original keys), `safetensors` (ComfyUI, original keys), `diffusers` (vae/ folder)."""
    return write_test_checkpoints(tmp_path_factory.mktemp("vae"), SMALL_VAE, seed=0)


@pytest.fixture(scope="session")
def tiny_vae(tiny_checkpoints) -> Path:
    return tiny_checkpoints["diffusers"]


@pytest.fixture
def latents_file(tmp_path):
    """Write random normalised latents `[48, T, H, W]` (or with batch) to a .pt file; returns the path."""

    def make(shape=(48, 3, 2, 3), name="latents.pt", fps=None, seed=0):
        latents = torch.randn(*shape, generator=torch.Generator().manual_seed(seed))
        path = tmp_path / name
        torch.save(latents if fps is None else {"latents": latents, "fps": fps}, path)
        return path

    return make


@pytest.fixture
def writer_chunks(monkeypatch) -> list[int]:
    """The frame count of each `VideoWriter.write` call during the test, in order: the decoder's passes as
    the writer receives them (each pass hands its frames over in one piece)."""
    from pan2cli.video import VideoWriter

    chunks: list[int] = []
    real_write = VideoWriter.write

    def recording_write(self, frames):
        chunks.append(frames.shape[0])
        return real_write(self, frames)

    monkeypatch.setattr(VideoWriter, "write", recording_write)
    return chunks


@pytest.fixture
def run_cli():
    """Invoke `pan2 ARGS...` in-process; returns click's Result (stdout and stderr kept apart)."""
    runner = CliRunner()

    def invoke(*args):
        return runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)

    return invoke


@pytest.fixture(scope="session")
def tiny_pan2(tmp_path_factory) -> Path:
    """A tiny random PAN 2 repository in the IFM/PAN2 layout (`pan2cli.testing.tiny_pan2`): modular_model_index.json,
    transformer/, text_encoder/ (Qwen3.5 text model), tokenizer/ (ChatML template), vae/ (with encoder), scheduler/."""
    from pan2cli.testing.tiny_pan2 import write_tiny_pan2

    return write_tiny_pan2(tmp_path_factory.mktemp("pan2") / "PAN2")
