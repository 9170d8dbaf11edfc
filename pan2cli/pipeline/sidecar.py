"""What a batch runs (`BatchRan`, decided once before anything loads) and each video's JSON sidecar (`sidecar`): its
settings, where they came from, the model, the run-time options, what ran, how the processes split the work, and
its seconds and memory per stage."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from pan2cli import distributed
from pan2cli.config import GenerationSettings, RuntimeConfig
from pan2cli.outputs import DEFAULT_X264_PRESET
from pan2cli.pipeline.jobs import GenerationResult
from pan2cli.pipeline.sampling import split_ranks
from pan2cli.scheduler import uses_guidance
from pan2cli.version import __version__

if TYPE_CHECKING:
    import torch

    from pan2cli.components.locate import PAN2Components
    from pan2cli.pipeline.memory_plan import MemoryPlan


@dataclass(frozen=True)
class BatchRan:
    """How one batch runs, decided once before anything loads (the sidecar's `config`, `ran`, `memory_plan` and
    `processes`); what a video's own run chose (its attention, its decoder) is in its `GenerationResult`.

    Attributes:
        config: the run-time options, the preset's resolved (`runtime_with`).
        precision: the DiT's arithmetic as it runs: "fp8", else its dtype ("bf16"; "float32" on the CPU, where
            `--precision bf16` runs the float32 model).
        dit_fused_kernels: the fused Triton DiT kernels run (CUDA with Triton, a power-of-two head dim).
        ranks_share_jobs: under torchrun, every rank was given the same jobs (one video made together); False: each
            rank makes its own (a sharded prompt file), or one process.
        decode_rows_split: a shared video's decode is split by rows over the ranks.
        memory_plan: what stays on the GPU and what streams from host memory (None on the CPU).
        clock_start: `time.perf_counter()` at the start `time_to_first_step` counts from.
        clock_from: what that start is: "command start" or "batch start".
    """

    config: RuntimeConfig
    precision: str
    dit_fused_kernels: bool
    ranks_share_jobs: bool
    decode_rows_split: bool
    memory_plan: MemoryPlan | None
    clock_start: float
    clock_from: str


def ran_precision(config: RuntimeConfig, dtype: torch.dtype) -> str:
    """The DiT's arithmetic as it runs (`BatchRan.precision`) for the resolved `config` and the model's dtype."""
    if config.precision == "fp8":
        return "fp8"
    name = str(dtype).removeprefix("torch.")
    return "bf16" if name == "bfloat16" else name


def processes(settings: GenerationSettings, ran: BatchRan, heads: int) -> dict:
    """How many processes made the batch (`--gpus N`, torchrun) and how they split this video's work."""
    world = distributed.world_size()
    if world == 1:
        return {"count": 1}
    if not ran.ranks_share_jobs:  # a sharded prompt file: each process makes its own videos
        return {"count": world, "split": "prompts", "rank": distributed.rank()}
    groups = split_ranks(world, 2 if uses_guidance(settings.guidance) else 1)
    return {
        "count": world,
        "split": "one video",
        "cfg_parallel": len(groups) == 2,  # the two guidance passes on the two halves of the processes
        # processes per pass that split its tokens (Ulysses; 1 where the heads do not divide evenly)
        "sequence_parallel": [len(g) if len(g) >= 2 and heads % len(g) == 0 else 1 for g in groups],
        "decode_rows_split": ran.decode_rows_split,
    }


def _rounded(entry: dict) -> dict:
    """A shared load's entry with its seconds rounded."""
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in entry.items()}


def sidecar(
    result: GenerationResult,
    ran: BatchRan,
    *,
    components: PAN2Components,
    device: torch.device,
    dtype: torch.dtype,
    generator_device: torch.device,
    heads: int,
) -> dict:
    """The JSON record of one video: settings (the start image by its absolute path), the job's metadata (preset,
    overrides and where each came from), model, versions, the run-time options (`config`) and what ran (`ran`: the
    DiT's fused kernels, the decoder, the precision, the fp8 attention), the processes and how they split the work,
    this video's seconds and peak GPU memory per stage (`write`: the MP4's end and the latents file), and the loads
    it shared with the other videos of the batch (`shared_loads`, each said once).

    Args:
        result: the video's job and what its run gave and chose.
        ran: the batch's `BatchRan`.
        components: the checkpoint (model id, revision, the scheduler's shift).
        device, dtype, generator_device: where the models ran, the DiT's dtype, where the noise was drawn.
        heads: the transformer's attention heads (`processes`).
    """
    job = result.job
    settings = asdict(job.settings)
    settings["image"] = os.path.abspath(settings["image"]) if settings["image"] is not None else None
    # The shift that ran (the settings' or the checkpoint's) and where it came from.
    settings["flow_shift"], shift_source = components.scheduler.resolve_shift(
        job.settings.flow_shift, job.flow_shift_source
    )
    return {
        **settings,
        "flow_shift_source": shift_source,
        "crf": job.crf,  # the MP4's H.264 quality and x264's speed preset
        "x264_preset": DEFAULT_X264_PRESET,
        **job.metadata,
        "model": components.model_id,
        "revision": components.revision,
        "pan2cli_version": __version__,
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "config": asdict(ran.config),
        "generator_device": generator_device.type,  # where the initial noise was drawn
        "attention": result.attention,  # the SDPA backend of the denoising (pan2cli.dit.attention)
        # what stayed on the GPU and what streamed from host memory (pan2cli.pipeline.memory_plan); null on the CPU
        "memory_plan": ran.memory_plan.record() if ran.memory_plan is not None else None,
        "ran": {
            "dit_fused_kernels": ran.dit_fused_kernels,
            "decoder": result.decoder,
            "precision": ran.precision,
            "fp8_attention": result.fp8_attention,
        },
        "processes": processes(job.settings, ran, heads),
        "seconds": {k: round(v, 3) for k, v in result.seconds.items()},
        "peak_gpu_memory_gib": {k: round(v, 2) for k, v in result.peak_gpu_gib.items()},
        "shared_loads": {k: _rounded(v) for k, v in result.shared_loads.items()},
        # to this video's first denoising step, from the command's start (or the batch's: `time_to_first_step_from`)
        "time_to_first_step": round(result.time_to_first_step, 3)
        if result.time_to_first_step is not None
        else None,
        "time_to_first_step_from": ran.clock_from,
    }
