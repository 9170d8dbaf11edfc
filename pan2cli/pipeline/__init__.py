"""The PAN 2 pipeline: prompt (and start image) → text encoding → flow-matching sampling with the MMDiT → VAE decode."""

from __future__ import annotations

from pan2cli.pipeline.config import PAN2PipelineConfig
from pan2cli.pipeline.generator import GenerationResult, VideoGenerator

__all__ = ["GenerationResult", "PAN2PipelineConfig", "VideoGenerator"]
