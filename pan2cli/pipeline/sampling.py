"""The denoising loop: flow-matching Euler with classifier-free guidance, on one process or split over several.

One video on several processes, every rank holding the whole transformer:
- CFG-parallel: the first half of the ranks runs the conditional pass, the second half the
  unconditional one, and the two predictions are swapped with one all-gather per step, so a step costs
  one pass per GPU instead of two;
- Ulysses sequence parallelism within each half of two or more ranks (`pan2cli.dit.parallel`): the
  video tokens are split over the half and the attention switches to a split over heads (the heads must
  divide evenly, else that half runs its pass whole on each rank);
- without guidance, the sequence split over all ranks.
Every rank starts from rank 0's initial noise (`initial_noise`: each rank draws it from the same seed on the
same kind of device, and rank 0's is broadcast, so that GPUs that draw differently cannot split a video)
and applies the same guidance and Euler step to the same tensors, so all hold the same latents, equal to
one process's up to the kernels' rounding (exact in float64 on the CPU over 2, 3 and 4 gloo ranks:
tests/pipeline/test_sampling.py).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from pan2cli import distributed
from pan2cli.dit.parallel import SequenceParallel
from pan2cli.scheduler import euler_step, guided, uses_guidance


def initial_noise(
    shape: Sequence[int],
    seed: int,
    generator_device: torch.device,
    device: torch.device,
    *,
    split: bool = False,
) -> torch.Tensor:
    """The initial noise of a sample as the release draws it: float32 `randn` from a generator on `generator_device`
    seeded with `seed`, drawn on that device, then moved to `device`.

    IFM's vLLM-Omni runner makes `torch.Generator(device=generator_device or <the worker's GPU>).manual_seed(seed)`
    and draws `randn(shape, dtype=float32)` with it on that device (diffusers' `randn_tensor`); the same seed on
    another kind of device gives other numbers (and on a GPU, a large draw depends on the GPU's SM count).

    Args:
        shape: `[1, 48, T, h, w]`.
        seed: 0 ≤ seed < 2**64.
        generator_device: where the generator draws (`RuntimeConfig.torch_generator_device`).
        device: where the latents go (the model's device).
        split: every rank samples this video: all take rank 0's noise.
    """
    generator = torch.Generator(device=generator_device).manual_seed(seed)
    noise = torch.randn(tuple(shape), generator=generator, device=generator_device, dtype=torch.float32)
    if split:
        noise = distributed.broadcast_from_main(noise)
    return noise.to(device)


def split_ranks(world: int, passes: int) -> list[list[int]]:
    """The ranks of each pass: two halves for CFG (the first half one rank shorter when `world` is odd,
    so the conditional pass is never the one left alone), else all ranks together."""
    if passes == 2 and world >= 2:
        half = world // 2
        return [list(range(half)), list(range(half, world))]
    return [list(range(world))]


_groups: dict[tuple, dist.ProcessGroup] = {}  # per default group: NCCL sets each one up once (seconds)


def _group(ranks: list[int]) -> dist.ProcessGroup:
    """The process group of `ranks`, made once per default group. `new_group` is collective: every rank
    asks for every group, in the same order (`_split_model` walks them all)."""
    key = (id(dist.group.WORLD), *ranks)
    if key not in _groups:
        _groups[key] = dist.new_group(ranks)
    return _groups[key]


@contextmanager
def _split_model(model, groups: list[list[int]], heads: int) -> Iterator[int]:
    """Give the model this rank's sequence-parallel group for the duration; yields the index of its pass."""
    rank = distributed.rank()
    previous = model.sequence_parallel
    mine = next(i for i, ranks in enumerate(groups) if rank in ranks)
    for i, ranks in enumerate(groups):
        group = _group(ranks) if len(ranks) >= 2 and heads % len(ranks) == 0 else None
        if i == mine and group is not None:
            model.sequence_parallel = SequenceParallel(group)
    try:
        yield mine
    finally:
        model.sequence_parallel = previous


def guidance_passes(
    model, x: torch.Tensor, timestep: torch.Tensor, cond: torch.Tensor, uncond: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The conditional and unconditional velocities of one step (the second None without `uncond`). Both passes
    run through each block in one call (`forward_passes`): a streamed block crosses the bus once per step, not
    once per pass, and every block computes its AdaLN modulation (float32 GEMVs over 403 MB of weights a
    block) once for the two."""
    if uncond is not None:
        v_cond, v_uncond = model.forward_passes(x, timestep, [cond, uncond])
        return v_cond, v_uncond
    return model(x, timestep, cond), None


def denoise(
    model,
    latents: torch.Tensor,
    condition: torch.Tensor,
    cond: torch.Tensor,
    uncond: torch.Tensor | None,
    sigmas: Sequence[float],
    guidance: float,
    num_train_timesteps: int,
    *,
    split: bool = False,
    cfg_parallel: bool = True,
    on_step: Callable[[int], None] | None = None,
) -> torch.Tensor:
    """Run the Euler steps from `latents` and return the final latents (float32, on their device).

    Args:
        model: the PAN 2 transformer.
        latents: `[1, 48, T, h, w]` float32 initial noise.
        condition: `[1, 49, T, h, w]` condition channels in the model's dtype (`condition_latents`); the
            latents are cast to it for each pass.
        cond, uncond: prompt and negative-prompt features; `uncond` None (or guidance ≤ 1): no CFG.
        sigmas: the schedule, σ_0 … σ_N (`flow_sigmas`); the timestep is σ·num_train_timesteps.
        split: share this video's passes among the processes of the default group (module docstring);
            every rank calls this with the same arguments.
        cfg_parallel: with `split` and guidance, give the two passes to the two halves of the ranks; False
            runs both passes sequence-parallel over all ranks (to measure sequence parallelism alone).
        on_step: called with 1 after each step (progress).
    """
    dtype = condition.dtype  # the model's: the latents enter with the condition in one dtype
    use_uncond = uses_guidance(guidance) and uncond is not None
    world = distributed.world_size() if split else 1
    groups = split_ranks(world, 2 if use_uncond and cfg_parallel else 1)
    with (
        _split_model(model, groups, model.config.num_attention_heads) if world > 1 else nullcontext(0) as mine
    ):
        for sigma, sigma_next in zip(sigmas[:-1], sigmas[1:]):
            timestep = torch.full(
                (1,), sigma * num_train_timesteps, device=latents.device, dtype=torch.float32
            )
            x = torch.cat([latents.to(dtype), condition], dim=1)
            if (
                len(groups) == 2
            ):  # CFG-parallel: my half's pass, then the first rank of each half's prediction
                predictions = distributed.gather_equal(model(x, timestep, cond if mine == 0 else uncond))
                v_cond, v_uncond = predictions[groups[0][0]], predictions[groups[1][0]]
            else:
                v_cond, v_uncond = guidance_passes(model, x, timestep, cond, uncond if use_uncond else None)
            latents = euler_step(latents, guided(v_cond, v_uncond, guidance), sigma, sigma_next)
            if on_step is not None:
                on_step(1)
    return latents
