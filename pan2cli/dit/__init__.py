"""The PAN 2 transformer (config, model, checkpoint loading) and its fused Triton ops (`pan2_fusions`)."""

from __future__ import annotations

from pan2cli.dit.checkpoint import load_pan2_transformer, resolve_pan2_checkpoint, save_pan2_transformer
from pan2cli.dit.config import PAN2TransformerConfig
from pan2cli.dit.fusions import layer_norm_modulate, qk_norm_rope, set_fused_kernels
from pan2cli.dit.model import PAN2Transformer3DModel
from pan2cli.dit.rope import rope_table

__all__ = [
    "PAN2TransformerConfig",
    "PAN2Transformer3DModel",
    "layer_norm_modulate",
    "load_pan2_transformer",
    "qk_norm_rope",
    "resolve_pan2_checkpoint",
    "rope_table",
    "save_pan2_transformer",
    "set_fused_kernels",
]
