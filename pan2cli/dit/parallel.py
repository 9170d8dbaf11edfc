"""Ulysses sequence parallelism for the PAN 2 transformer: one video's tokens over several processes.

Each rank of the group keeps a contiguous band of the video tokens (sizes differ by at most one) through
everything that works token by token: patch embedding, norms, modulation, Q/K RMSNorm + RoPE (its rows of
the table), the MLPs. Only the joint attention needs every token, and there the layout is switched:

    q, k, v of my tokens, all heads  [B, n_r, H, d]  --all-to-all-->  all tokens, my heads  [B, N, H/W, d]

the [video ; text] attention runs for those heads (the text stream is replicated: every rank holds all
text tokens and takes its heads' slice), the video output goes back with the inverse all-to-all and the
text output is gathered over heads, so every rank keeps the same text stream. The final projection's
tokens are gathered once. Attention is per head and every other op is per token, so the result is one
process's, up to the kernels' own rounding (exact in float64 on the CPU: tests/pipeline/test_sampling.py).

The heads must divide evenly over the group (32 heads: 2, 4, 8 or 16 ranks).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pan2cli.errors import InputError


def token_sizes(tokens: int, world: int) -> list[int]:
    """A contiguous band per rank, the first `tokens % world` ranks one token longer."""
    base, extra = divmod(tokens, world)
    return [base + (r < extra) for r in range(world)]


@dataclass(frozen=True)
class SequenceParallel:
    """The process group (None: the default one) over which one video's tokens are split."""

    group: dist.ProcessGroup | None = None

    @property
    def world(self) -> int:
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.group)

    def check_heads(self, heads: int) -> None:
        if heads % self.world:
            raise InputError(
                f"sequence parallelism over {self.world} processes needs a multiple of {self.world} heads, the model has {heads}"
            )

    def band(self, tokens: int) -> tuple[int, int]:
        """[start, stop) of this rank's tokens."""
        sizes = token_sizes(tokens, self.world)
        start = sum(sizes[: self.rank])
        return start, start + sizes[self.rank]

    def _all_to_all(self, pieces: list[torch.Tensor], shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
        """Send pieces[j] to rank j and receive a tensor of shapes[j] from it. One flat all_to_all_single
        with split sizes: gloo's list all_to_all wants equal shapes, and bands may differ by a token."""
        sent = torch.cat([p.reshape(-1) for p in pieces])
        sizes = [math.prod(shape) for shape in shapes]
        received = torch.empty(sum(sizes), dtype=sent.dtype, device=sent.device)
        dist.all_to_all_single(
            received,
            sent,
            output_split_sizes=sizes,
            input_split_sizes=[p.numel() for p in pieces],
            group=self.group,
        )
        return [flat.view(shape) for flat, shape in zip(received.split(sizes), shapes)]

    def video_to_heads(self, t: torch.Tensor, tokens: int) -> torch.Tensor:
        """[B, n_r, H, d] (my tokens, all heads) → [B, N, H/W, d] (all tokens, my heads)."""
        batch, _, heads, dim = t.shape
        per_rank = heads // self.world
        pieces = list(t.split(per_rank, dim=2))
        shapes = [(batch, n, per_rank, dim) for n in token_sizes(tokens, self.world)]
        return torch.cat(self._all_to_all(pieces, shapes), dim=1)

    def heads_to_video(self, t: torch.Tensor) -> torch.Tensor:
        """[B, N, H/W, d] (all tokens, my heads) → [B, n_r, H, d] (my tokens, all heads)."""
        batch, tokens, per_rank, dim = t.shape
        pieces = list(t.split(token_sizes(tokens, self.world), dim=1))
        start, stop = self.band(tokens)
        shapes = [(batch, stop - start, per_rank, dim)] * self.world
        return torch.cat(self._all_to_all(pieces, shapes), dim=2)

    def gather_heads(self, t: torch.Tensor) -> torch.Tensor:
        """[B, L, H/W, d] (my heads) → [B, L, H, d] on every rank."""
        pieces = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(pieces, t.contiguous(), group=self.group)
        return torch.cat(pieces, dim=2)

    def gather_tokens(self, t: torch.Tensor, tokens: int) -> torch.Tensor:
        """[B, n_r, C] (my tokens) → [B, N, C] on every rank (bands of unequal length)."""
        batch, _, channels = t.shape
        shapes = [(batch, n, channels) for n in token_sizes(tokens, self.world)]
        return torch.cat(self._all_to_all([t] * self.world, shapes), dim=1)
