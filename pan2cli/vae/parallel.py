"""Row split of the VAE decode across ranks: which rows each rank holds, halo rows for 3x3 convs, gathers.

Rank r holds latent rows `[a_r, b_r)` of every frame (contiguous, as even as possible). Every op of
the decoder keeps that mapping: pointwise ops and norms over channels are local, each spatial ×2
(nearest upsampling, `DupUp3D`, unpatchify) sends band `[a, b)` to `[2a, 2b)`, each 3x3 convolution
reads one halo row from each neighbour (zeros at the frame's top and bottom, as the reference's
padding), and the mid-block attention runs on the whole gathered frame, each rank keeping its rows.
So the decode equals the single-process one up to the order of floating-point sums.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from pan2cli import distributed
from pan2cli.errors import InputError


def split_rows(height: int, parts: int) -> tuple[int, ...]:
    """Row counts of `parts` contiguous bands, as even as possible, larger first: 44 over 3 → (15, 15, 14).

    Raises:
        InputError: fewer rows than parts (a rank would hold nothing).
    """
    if height < parts:
        raise InputError(
            f"latents of {height} rows cannot be split over {parts} processes (at least one row each)",
            hint=f"use --gpus {height} or fewer" if height > 1 else "decode them in one process",
        )
    base, extra = divmod(height, parts)
    return tuple(base + (i < extra) for i in range(parts))


class RowSplit:
    """This rank's band of rows and the exchanges with the other ranks that keep the decode exact.

    Args:
        sizes: every rank's latent rows, in rank order (sum = the latent height).
        rank: this rank.
    """

    def __init__(self, sizes: Sequence[int], rank: int):
        self.sizes = tuple(sizes)
        self.rank = rank
        self.world = len(self.sizes)
        self.start = sum(self.sizes[:rank])
        self.stop = self.start + self.sizes[rank]

    def __repr__(self) -> str:
        return f"RowSplit(rank {self.rank}/{self.world}, latent rows [{self.start}, {self.stop}) of {sum(self.sizes)})"

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's latent rows of `x` (rows on dim −2): `(…, H, W)` → `(…, b − a, W)`."""
        return x[..., self.start : self.stop, :]

    def _sizes_at(self, local_rows: int) -> list[int]:
        """Every rank's rows at the resolution where this rank holds `local_rows` (a power-of-2 multiple)."""
        scale, rest = divmod(local_rows, self.sizes[self.rank])
        if rest:
            raise ValueError(
                f"{local_rows} rows is not a multiple of this rank's {self.sizes[self.rank]} latent rows"
            )
        return [size * scale for size in self.sizes]

    def total_rows(self, local_rows: int) -> int:
        """The whole frame's rows at the resolution where this rank holds `local_rows`."""
        return sum(self._sizes_at(local_rows))

    def halo(self, x: torch.Tensor, pad_w: int = 0) -> torch.Tensor:
        """`x` with one row above and one below from the neighbouring ranks, and `pad_w` zero columns each side.

        The rows above rank 0 and below the last rank are zeros: the reference's zero padding.

        Args:
            x: `(…, h, w)` this rank's rows (any leading dims: `(B, C, T, h, w)` or `(N, C, h, w)`).
            pad_w: zero columns added on the left and on the right.

        Returns:
            `(…, h + 2, w + 2·pad_w)`, a new tensor.
        """
        w = x.shape[-1]
        # Post the swap first, then make the padded copy while the rows travel.
        swap = distributed.NeighbourSwap(
            x[..., :1, :] if self.rank > 0 else None,
            x[..., -1:, :] if self.rank < self.world - 1 else None,
        )
        out = F.pad(x, (pad_w, pad_w, 1, 1))
        above, below = swap.wait()
        if above is not None:
            out[..., :1, pad_w : pad_w + w] = above
        if below is not None:
            out[..., -1:, pad_w : pad_w + w] = below
        return out

    def fill_halo_rows(self, buf: torch.Tensor) -> None:
        """Fill the first and last row of a channels-last band `(…, h + 2, W, C)` from the neighbours, in place.

        Row 0 gets the last interior row of the rank above, row h + 1 the first interior row of the
        rank below; zeros at the frame's top and bottom (the reference's padding).
        """
        swap = distributed.NeighbourSwap(
            buf[..., 1:2, :, :] if self.rank > 0 else None,
            buf[..., -2:-1, :, :] if self.rank < self.world - 1 else None,
        )
        above, below = swap.wait()
        if above is None:
            buf[..., :1, :, :].zero_()
        else:
            buf[..., :1, :, :].copy_(above)
        if below is None:
            buf[..., -1:, :, :].zero_()
        else:
            buf[..., -1:, :, :].copy_(below)

    def gather_rows(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's rows of `x` along `dim`, concatenated in rank order (an all-gather: every rank gets all).

        Args:
            x: this rank's rows along `dim`, a power-of-2 multiple of its latent rows (e.g. uint8
                frames `(f, 16·h, W, 3)` with `dim=1`).

        Returns:
            The whole frames along `dim`.
        """
        return distributed.all_gather_uneven(x, dim, self._sizes_at(x.shape[dim]))


def row_split_for(height: int, enabled: bool = True) -> RowSplit | None:
    """The row split for latents of `height` rows in the current process group, or None to decode whole frames.

    None in a single process or when not `enabled` (`RuntimeConfig.decode_kernel_parallel` off: every
    rank then decodes the whole video).

    Raises:
        InputError: fewer latent rows than ranks.
    """
    world = distributed.world_size()
    if world == 1 or not enabled:
        return None
    return RowSplit(split_rows(height, world), distributed.rank())
