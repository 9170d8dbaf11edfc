"""3D rotary position embedding of PAN 2's video tokens: the cos/sin table and the reference rotation.

Each head's 128 channels form 64 pairs; pair i turns by the angle `position_axis · θ^(−2j/d_axis)` of its
axis: the first d_t/2 pairs take the latent frame, the next d_h/2 the patch row, the last d_w/2 the patch
column (j counts within the axis; PAN 2: θ = 256, axes (16, 56, 56)). Frame positions are multiplied by
`temporal_scale` (16/24 in PAN 2: "the frame rate the rotary embedding was trained at"); positions start
at 0. PAN 2 pairs channels GPT-J style ("interleaved": pair i is channels 2i, 2i+1); the "halves" layout
(pair i is channels i, i + 64) is kept for the kernels' tests.
"""

from __future__ import annotations

import torch


def rope_table(
    grid: tuple[int, int, int],
    axes_dim: tuple[int, int, int],
    theta: float,
    temporal_scale: float = 1.0,
    *,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin of every video token's pair angles, tokens in (t, h, w) order.

    Angles are computed in float64 and rounded once to `dtype` (float32 for bf16/fp32 models: positions
    reach a few hundred, where float32 angles would lose ~1e-5 rad; float64 for a float64 model).

    Args:
        grid: (T, H, W) tokens along each axis (latent frames, patch rows, patch columns).
        axes_dim: head-dim channels per axis (even, summing to head_dim).
        theta: RoPE base.
        temporal_scale: factor on the frame positions.
        dtype, device: of the returned tables.

    Returns:
        (cos, sin), each `[T·H·W, head_dim/2]`, contiguous.
    """
    per_axis = []
    for axis, (size, dim) in enumerate(zip(grid, axes_dim)):
        inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # [dim/2]
        positions = torch.arange(size, dtype=torch.float64)
        if axis == 0:
            positions = positions * temporal_scale
        per_axis.append(positions[:, None] * inv_freq[None, :])  # [size, dim/2]
    t, h, w = grid
    angles = torch.cat(
        [
            per_axis[0][:, None, None, :].expand(t, h, w, -1),
            per_axis[1][None, :, None, :].expand(t, h, w, -1),
            per_axis[2][None, None, :, :].expand(t, h, w, -1),
        ],
        dim=-1,
    ).reshape(t * h * w, -1)
    cos = angles.cos().to(device=device, dtype=dtype).contiguous()
    sin = angles.sin().to(device=device, dtype=dtype).contiguous()
    return cos, sin


def apply_rope(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = True
) -> torch.Tensor:
    """Rotate each head's channel pairs (the reference path; math in the promoted dtype of x and the table).

    Args:
        x: `[B, N, H, head_dim]`.
        cos, sin: `[N, head_dim/2]` from `rope_table`.
        interleaved: pairs (2i, 2i+1) (PAN 2) or (i, i + head_dim/2).

    Returns:
        `[B, N, H, head_dim]`.
    """
    c, s = cos[:, None, :], sin[:, None, :]
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).flatten(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
