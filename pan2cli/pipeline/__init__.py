"""The PAN 2 pipeline: prompt (and start image) → text encoding → flow-matching sampling with the MMDiT → VAE decode."""

from __future__ import annotations

__all__ = ["GenerationResult", "VideoGenerator"]


def __getattr__(name: str):
    # Lazy: the torch-free modules of the package (prompts, jobs, batch_plan, memory_plan) import without torch.
    if name in ("GenerationResult", "VideoGenerator"):
        from pan2cli.pipeline import generator

        return getattr(generator, name)
    raise AttributeError(f"module 'pan2cli.pipeline' has no attribute {name!r}")
