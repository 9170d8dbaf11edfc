"""A small PAN 2 transformer with random weights, for the fp8 tests (the structure of the release, few widths)."""

from __future__ import annotations

import torch

from pan2cli.dit.model import PAN2Transformer3DModel


def random_small_pan2(head_dim: int = 64, seed: int = 0) -> PAN2Transformer3DModel:
    """Two heads of `head_dim` (64 or 128), two blocks, one refiner block; weights N(0, 1/fan_in), vectors
    N(0, 0.3²): large enough for the fp8 scales to matter. float32, eval mode, on the CPU."""
    torch.manual_seed(seed)
    rope = {64: (16, 24, 24), 128: (32, 48, 48)}[head_dim]
    model = PAN2Transformer3DModel(
        num_attention_heads=2, attention_head_dim=head_dim, num_layers=2, num_refiner_layers=1,
        text_embed_dim=32, rope_axes_dim=rope,
    ).eval()  # fmt: skip
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.3)
    return model
