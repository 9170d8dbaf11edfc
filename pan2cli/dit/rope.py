"""3D rotary position embedding over (t, h, w) for video tokens: the cos/sin table and the reference rotation.

Layout ("halves", GPT-NeoX style): channel j of a head is rotated with channel j + head_dim/2, by angle
`pos_axis(j) · theta^(-2 i / d_axis)`, where the first d_t/2 pairs take the latent-frame index, the next
d_h/2 the row and the last d_w/2 the column (i counts within the axis). Halves, not interleaved pairs,
because each half is one contiguous vector load in the fused kernel. A checkpoint trained with
interleaved pairs (Wan's complex layout) converts exactly by permuting the rows of its q/k projection
weights and biases and its Q/K RMSNorm weights (pair (2i, 2i+1) → (i, i + head_dim/2)).
"""

from __future__ import annotations

import torch


def rope_table(
    grid: tuple[int, int, int],
    axes_dim: tuple[int, int, int],
    theta: float = 10000.0,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cos and sin of every video token's rotation angles, tokens in (t, h, w) order.

    Angles are computed in float64 per axis and rounded once to float32 (positions reach a few hundred,
    where float32 angles would lose ~1e-5 rad).

    Args:
        grid: (T, H, W) tokens along each axis (latent frames, patch rows, patch columns).
        axes_dim: head-dim channels per axis (even, summing to head_dim).
        theta: RoPE base.
        device: where the table lives.

    Returns:
        (cos, sin), each `[T·H·W, head_dim/2]` float32, contiguous.
    """
    per_axis = []
    for size, dim in zip(grid, axes_dim):
        inv_freq = theta ** (-torch.arange(0, dim, 2, dtype=torch.float64) / dim)  # [dim/2]
        per_axis.append(torch.arange(size, dtype=torch.float64)[:, None] * inv_freq[None, :])  # [size, dim/2]
    t, h, w = grid
    angles = torch.cat(
        [
            per_axis[0][:, None, None, :].expand(t, h, w, -1),
            per_axis[1][None, :, None, :].expand(t, h, w, -1),
            per_axis[2][None, None, :, :].expand(t, h, w, -1),
        ],
        dim=-1,
    ).reshape(t * h * w, -1)
    cos = angles.cos().to(torch.float32).to(device).contiguous()
    sin = angles.sin().to(torch.float32).to(device).contiguous()
    return cos, sin


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the halves of each head (the reference path; math in the dtype of `x`, fp32 in practice).

    Args:
        x: `[B, N, H, head_dim]`.
        cos, sin: `[N, head_dim/2]` from `rope_table`.

    Returns:
        `[B, N, H, head_dim]`, dtype of `x` promoted with the table's (float32).
    """
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
