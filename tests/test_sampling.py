"""The denoising loop (pan2cli.pipeline.sampling): CFG-parallel over gloo ranks equals one process (float64)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pan2cli.pipeline.conditioning import condition_latents
from pan2cli.pipeline.sampling import denoise
from pan2cli.pipeline.scheduler import flow_sigmas

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
from make_tiny_pan2 import TEXT_HIDDEN, tiny_transformer  # noqa: E402  (the release-shaped tiny transformer)

SHAPE = (1, 48, 2, 4, 6)  # latent [1, 48, T, h, w]
STEPS, GUIDANCE, SHIFT = 3, 2.5, 9.0


class _Counting(torch.nn.Module):
    """The transformer, counting its forward passes (CFG-parallel: one per rank and step, not two)."""

    def __init__(self, model):
        super().__init__()
        self.model, self.calls = model, 0

    def forward(self, *args):
        self.calls += 1
        return self.model(*args)


def _inputs():
    gen = torch.Generator().manual_seed(5)
    latents = torch.randn(SHAPE, generator=gen, dtype=torch.float32)
    cond = torch.randn(1, 7, TEXT_HIDDEN, generator=gen, dtype=torch.float64)
    uncond = torch.randn(1, 3, TEXT_HIDDEN, generator=gen, dtype=torch.float64)  # another length, as a negative prompt has
    condition = condition_latents(SHAPE).to(torch.float64)
    return latents, condition, cond, uncond


def _run(cfg_parallel: bool) -> tuple[torch.Tensor, int]:
    model = _Counting(tiny_transformer(seed=2).double())
    latents, condition, cond, uncond = _inputs()
    sigmas = flow_sigmas(STEPS, SHIFT).tolist()
    with torch.inference_mode():
        out = denoise(model, latents, condition, cond, uncond, sigmas, GUIDANCE, 1000, cfg_parallel=cfg_parallel)
    return out, model.calls


def _rank(rank: int, world: int, init_file: str, out_prefix: str) -> None:
    torch.set_num_threads(1)  # the ranks share the CI machine's cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        out, calls = _run(cfg_parallel=True)
        torch.save({"latents": out, "calls": calls}, f"{out_prefix}{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 3])
def test_cfg_parallel_equals_one_process_float64(tmp_path, world):
    """Issue 15: ranks 0 and 1 take the conditional and unconditional passes and swap them; every rank ends
    with one process's latents (float64 model: measured difference 0; bound 1e-9 as the issue states), and
    each rank ran one forward per step instead of two."""
    expected, calls = _run(cfg_parallel=False)
    assert calls == 2 * STEPS
    prefix = str(tmp_path / "rank")
    mp.spawn(_rank, args=(world, str(tmp_path / "init"), prefix), nprocs=world, join=True)
    for rank in range(world):
        got = torch.load(f"{prefix}{rank}.pt", weights_only=True)
        assert got["calls"] == STEPS
        assert (got["latents"] - expected).abs().max().item() <= 1e-9


def test_guidance_uses_both_passes():
    """The unconditional pass matters (the test above would pass with it ignored everywhere otherwise)."""
    with_cfg, _ = _run(cfg_parallel=False)
    model = tiny_transformer(seed=2).double()
    latents, condition, cond, _ = _inputs()
    with torch.inference_mode():
        cond_only = denoise(model, latents, condition, cond, None, flow_sigmas(STEPS, SHIFT).tolist(), GUIDANCE, 1000)
    assert (with_cfg - cond_only).abs().max().item() > 1e-3
