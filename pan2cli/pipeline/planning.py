"""What a run's memory plan (`pan2cli.pipeline.memory_plan`) is made of, gathered before anything loads: the
models' sizes from their configs and headers, the jobs' largest shape, the GPU's free memory and the host's;
and the cap (`--max-gpu-memory`) applied to the process (`torch.cuda.set_per_process_memory_fraction`).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from pan2cli import distributed
from pan2cli.config import GenerationSettings, RuntimeConfig
from pan2cli.host_memory import read_host_memory
from pan2cli.pipeline.memory_plan import Alternative, LayeredSizes, MemoryPlan, RunShape, plan_memory
from pan2cli.scheduler import uses_guidance

GIB = 2**30


def transformer_sizes(shapes: dict[str, tuple[int, ...]], dtype: torch.dtype, precision: str) -> LayeredSizes:
    """The transformer's bytes as `load_pan2_transformer` makes them, per block and for the rest."""
    from pan2cli.dit.checkpoint import loaded_bytes

    blocks: dict[int, dict[str, tuple[int, ...]]] = {}
    rest = {}
    for key, shape in shapes.items():
        parts = key.split(".", 2)
        if parts[0] == "transformer_blocks" and parts[1].isdigit():
            blocks.setdefault(int(parts[1]), {})[key] = shape
        else:
            rest[key] = shape
    per_block = tuple(loaded_bytes(blocks[i], dtype, precision=precision) for i in sorted(blocks))
    return LayeredSizes(per_block, loaded_bytes(rest, dtype, precision=precision))


def text_encoder_sizes(folder: Path, dtype: torch.dtype) -> LayeredSizes:
    """The text model's bytes in `dtype`, per layer PAN 2 runs and for the rest (the embeddings), from its config."""
    from pan2cli.text.checkpoint import encoder_layers, read_text_config
    from pan2cli.text.qwen3_5 import Qwen35TextModel

    config = read_text_config(Path(folder))
    with torch.device("meta"):
        model = Qwen35TextModel(config, encoder_layers(config))
    size = torch.empty(0, dtype=dtype).element_size()

    def nbytes(module: nn.Module) -> int:
        return sum(math.prod(t.shape) * size for t in module.state_dict().values())

    layers = tuple(nbytes(layer) for layer in model.layers)
    return LayeredSizes(layers, nbytes(model) - sum(layers))


def run_shape(settings: Sequence[GenerationSettings], precision: str, dit_config: dict) -> RunShape:
    """The largest demands of the jobs: the most video tokens, the largest frame, guidance and an image if any has them."""
    patch = dit_config.get("patch_size", (1, 2, 2))
    hidden = dit_config.get("num_attention_heads", 32) * dit_config.get("attention_head_dim", 128)

    def tokens(s: GenerationSettings) -> int:
        _, _, frames, height, width = s.latent_shape
        return (frames // patch[0]) * (height // patch[1]) * (width // patch[2])

    largest = max(settings, key=tokens)
    return RunShape(
        precision=precision,
        video_tokens=tokens(largest),
        pixels=max(s.height * s.width for s in settings),
        frames=largest.frames,
        guidance=any(uses_guidance(s.guidance) for s in settings),
        image=any(s.image is not None for s in settings),
        hidden_size=hidden,
    )


def make_plan(
    config: RuntimeConfig,
    device: torch.device,
    settings: Sequence[GenerationSettings],
    *,
    transformer_shapes: dict[str, tuple[int, ...]],
    text_folder: Path,
    dit_config: dict,
    dtype: torch.dtype,
    vae_dtype: torch.dtype,
) -> MemoryPlan | None:
    """The run's memory plan on a GPU (None on the CPU, where everything is in host memory already).

    Raises:
        InputError: no plan fits the GPU, or the host lacks the memory the plan page-locks.
    """
    if device.type != "cuda" or not settings:
        return None
    from pan2cli.vae.kernel.build import why_not_applicable

    free, _ = torch.cuda.mem_get_info(device)
    cap = int(config.max_gpu_memory_gib * GIB) if config.max_gpu_memory_gib is not None else None
    host = read_host_memory()
    local_ranks = distributed.env_local_world_size(distributed.world_size())
    if host is not None and local_ranks > 1:  # every process of this machine page-locks its own copy
        host = dataclasses.replace(host, available=host.available // local_ranks)
    alternatives = []
    if config.precision == "bf16" and torch.cuda.get_device_capability(device) >= (8, 9):
        alternatives.append(
            Alternative("--precision fp8", "fp8", transformer_sizes(transformer_shapes, dtype, "fp8"))
        )
    return plan_memory(
        shape=run_shape(settings, config.precision, dit_config),
        transformer=transformer_sizes(transformer_shapes, dtype, config.precision),
        text_encoder=text_encoder_sizes(text_folder, dtype),
        free_bytes=free,
        cap_bytes=cap,
        host=host,
        decoder_kernel=config.decode_kernel != "off" and why_not_applicable(device, vae_dtype) is None,
        chunk_latent_frames=config.chunk_latent_frames,
        vae_element_bytes=torch.empty(0, dtype=vae_dtype).element_size(),
        stream_all=config.offload,
        alternatives=alternatives,
        # A batch keeps the decoder beside the transformer while videos are left to denoise (`BatchStream`).
        decoder_beside_transformer=len(settings) > 1,
    )


def apply_cap(device: torch.device, cap_gib: float | None) -> None:
    """Limit this process's allocations on `device` to `cap_gib` (the caching allocator's; CUDA's own context is
    outside it)."""
    if device.type != "cuda" or cap_gib is None:
        return
    total = torch.cuda.get_device_properties(device).total_memory
    index = device.index if device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_gib * GIB / total), index)
