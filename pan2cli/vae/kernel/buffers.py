"""What the kernel decode path keeps between stages, chunks and frames: pending sums, conv inputs with their
history and halo rows, full-resolution rings, conv_out's time partials.

* A pending sum (`Pending`) is a conv output whose bias and residual the next norm kernel adds as it reads.
* Every causal conv reads one buffer `(B, 2 + t, h + 2, W, C)` whose first two frames are its history: the
  fused norm writes the chunk straight behind them (no `cat`, no `pad`). Rows 0 and h + 1 are halo rows:
  the neighbouring ranks' rows under a row split, zeros otherwise, so one process and a split run the
  same convolution problem on different heights.
* At full resolution each conv of the last up-block keeps its input in a ring of three frames: the norm
  writes frame f into slot f mod 3 and the conv reads the three slots in memory order with its time taps
  rotated to match (`layout.ring_weight`), so no history is ever copied (on an H200 the copies of a 5 s
  decode went from 0.092 to 0.039 s and the norms wrote 81 GB less).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pan2cli.vae.parallel import RowSplit


@dataclass
class Pending:
    """`z + bias + residual`, not yet materialised: the next norm kernel adds it as it reads.

    Also the unit of ownership between stages: a stage that consumes its input clears the fields it no
    longer needs, so a tensor is freed after its last read rather than when the caller's frame ends
    (the high-resolution activations are 112-225 MB per frame).
    """

    z: torch.Tensor | None  # (B, t, H, W, C) bf16
    bias: torch.Tensor | None = None  # (C,) fp32
    residual: torch.Tensor | None = None  # like z

    def take(self) -> torch.Tensor:
        """The materialised sum; the pending object gives up its references."""
        z = self.z
        if self.residual is not None:
            z.add_(self.residual)
        if self.bias is not None:
            z.add_(self.bias.to(z.dtype))
        self.z = self.bias = self.residual = None
        return z


def interior_rows(frames: torch.Tensor) -> torch.Tensor:
    """`(B, t, h + 2, W, C)` frames without their halo rows."""
    return frames[:, :, 1:-1]


class FrameBuffers:
    """The state of one decode between its chunks and frames, by conv name: histories, rings, and conv_out's
    time partials; and the row split whose halo rows the buffers carry.

    Args:
        ring_keys: the convs whose input lives in a ring of three frames (`ring`) instead of a history
            buffer (`buffer`).
    """

    def __init__(self, ring_keys: set[str]):
        self.ring_keys = ring_keys
        self.rows: RowSplit | None = None  # set per decode; None in one process
        self.forget()

    def forget(self) -> None:
        """Drop what a decode keeps between its frames: histories, rings and conv_out's partials."""
        self.history: dict[str, torch.Tensor] = {}
        self.rings: dict[str, torch.Tensor] = {}
        self.ring_frames: dict[str, int] = {}
        self.head_partials: list[torch.Tensor] = []  # conv_out's partials of frames f - 2, f - 1

    def buffer(
        self, key: str, like: torch.Tensor, channels: int, halo: bool = True
    ) -> tuple[torch.Tensor, bool]:
        """(B, 2 + t, H', W, C) conv input buffer whose first two frames hold the conv's history.

        With `halo` (every 3x3 conv), H' = h + 2: rows 0 and h + 1 hold the neighbouring ranks' rows
        under a row split and zeros otherwise, and the conv pads only W. One process and a split thus
        run the same convolution problem on different heights (`interior` is where the rows go).
        Returns the buffer and whether the history is fresh (all zeros: the decode's first chunk).
        """
        b, t, h, w, _ = like.shape
        rows = h + 2 if halo else h
        history = self.history.get(key)
        fresh = history is None
        if fresh:
            history = torch.zeros(b, 2, rows, w, channels, dtype=torch.bfloat16, device=like.device)
            self.history[key] = history
        buf = torch.empty(b, 2 + t, rows, w, channels, dtype=torch.bfloat16, device=like.device)
        if not (fresh and t == 1):  # a one-frame first chunk skips the zero history (`_conv`)
            buf[:, :2].copy_(history)
        return buf, fresh

    @staticmethod
    def interior(buf: torch.Tensor) -> torch.Tensor:
        """The chunk's frames of a conv buffer without the halo rows: where the norm writes."""
        return interior_rows(buf[:, 2:])

    def halo(self, frames: torch.Tensor) -> None:
        """Fill the halo rows of `(…, h + 2, W, C)` frames: the neighbours' rows, zeros at the frame's edges."""
        if self.rows is not None:
            self.rows.fill_halo_rows(frames)
        else:
            frames[..., :: frames.shape[-3] - 1, :, :].zero_()  # rows 0 and h + 1 in one kernel

    def keep_history(self, key: str, buf: torch.Tensor) -> None:
        """Keep the last two frames of conv `key`'s buffer as the history of its next chunk."""
        history, t = self.history[key], buf.shape[1] - 2
        if t == 1:  # the buffer's history frames may not have been filled (`buffer`): shift, then append
            history[:, :1].copy_(history[:, 1:])
            history[:, 1:].copy_(buf[:, 2:])
        else:
            history.copy_(buf[:, t : t + 2])

    def ring(self, key: str, like: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The ring `(B, 3, h + 2, W, C)` of conv `key` (zeros at the decode's start: the history before frame
        0 and, without a split, the halo rows) and the index of the frame about to enter it."""
        b, t, h, w, c = like.shape
        if t != 1:
            raise ValueError(f"{key}: the full-resolution stages take one frame at a time, got {t}")
        ring = self.rings.get(key)
        if ring is None:
            ring = torch.zeros(b, 3, h + 2, w, c, dtype=torch.bfloat16, device=like.device)
            self.rings[key] = ring
        frame = self.ring_frames.get(key, 0)
        self.ring_frames[key] = frame + 1
        return ring, frame
