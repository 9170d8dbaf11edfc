"""The collectives pan2 runs between ranks: agreement, the row split's halo swaps and gathers, and what
`pan2 generate` shares (rank 0's noise, every rank's latents, counts). Each is the identity in a single process."""

from __future__ import annotations

import time
from typing import Sequence

import torch
import torch.distributed as dist

from pan2cli.distributed.group import comm_device, rank, world_size


# -- agreement --------------------------------------------------------------------------------------
def agree_all(flag: bool) -> bool:
    """True only if every rank passes True (all-reduce MIN); `flag` itself in a single process."""
    if world_size() == 1:
        return bool(flag)
    value = torch.tensor([int(bool(flag))], dtype=torch.int32, device=comm_device())
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


# -- the row split --------------------------------------------------------------------------------
class NeighbourSwap:
    """Rows in flight to/from the ranks above (rank − 1) and below (rank + 1); `wait()` returns what came."""

    def __init__(self, to_above: torch.Tensor | None, to_below: torch.Tensor | None):
        r = rank()
        ops = []
        self.from_above = self.from_below = None
        if to_above is not None:
            to_above = to_above.contiguous()
            self.from_above = torch.empty_like(to_above)
            ops += [dist.P2POp(dist.isend, to_above, r - 1), dist.P2POp(dist.irecv, self.from_above, r - 1)]
        if to_below is not None:
            to_below = to_below.contiguous()
            self.from_below = torch.empty_like(to_below)
            ops += [dist.P2POp(dist.isend, to_below, r + 1), dist.P2POp(dist.irecv, self.from_below, r + 1)]
        self._sent = (to_above, to_below)  # alive until the sends complete
        self._requests = dist.batch_isend_irecv(ops) if ops else []

    def wait(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        for request in self._requests:
            request.wait()
        return self.from_above, self.from_below


def all_gather_uneven(x: torch.Tensor, dim: int, sizes: Sequence[int]) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`, in rank order, where rank r's `x.shape[dim]` is `sizes[r]`.

    Collectives want equal shapes: each rank pads to `max(sizes)`, the padding is dropped after.

    Args:
        x: this rank's part, `x.shape[dim] == sizes[rank]`; the other dims equal on every rank.
        dim: the dimension to concatenate along.
        sizes: every rank's size along `dim`.

    Returns:
        The whole tensor, `sum(sizes)` along `dim`, on `x`'s device.
    """
    if len(sizes) == 1:
        return x
    dim = dim % x.dim()
    most = max(sizes)
    if x.shape[dim] == most:
        padded = x.contiguous()
    else:
        shape = list(x.shape)
        shape[dim] = most
        padded = x.new_zeros(shape)
        padded.narrow(dim, 0, x.shape[dim]).copy_(x)
    parts = [torch.empty_like(padded) for _ in sizes]
    dist.all_gather(parts, padded)
    return torch.cat([part.narrow(dim, 0, size) for part, size in zip(parts, sizes)], dim=dim)


# -- `pan2 generate` --------------------------------------------------------------------------------
def broadcast_from_main(x: torch.Tensor) -> torch.Tensor:
    """Rank 0's `x` on every rank (same shape and dtype everywhere), on `x`'s device; `x` itself in one process."""
    if world_size() == 1:
        return x
    y = x.to(comm_device()).contiguous()
    dist.broadcast(y, 0)
    return y.to(x.device)


def gather_equal(x: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's `x` (same shape and dtype everywhere), in rank order, on `x`'s device; `[x]` in one process."""
    if world_size() == 1:
        return [x]
    y = x.to(comm_device()).contiguous()
    pieces = [torch.empty_like(y) for _ in range(world_size())]
    dist.all_gather(pieces, y)
    return [piece.to(x.device) for piece in pieces]


def sum_all(value: int) -> int:
    """The sum of `value` over the ranks (all-reduce SUM); `value` itself in a single process."""
    if world_size() == 1:
        return value
    total = torch.tensor([value], dtype=torch.int64, device=comm_device())
    dist.all_reduce(total)
    return int(total.item())


def wait_for_all(tag: str, poll_s: float = 1.0) -> None:
    """Wait, without a collective's timeout, until every rank reached this point (ranks of a sharded batch
    finish minutes apart, longer than PAN2_DIST_TIMEOUT). A counter in torchrun's store; no-op in one process."""
    if world_size() == 1:
        return
    store = dist.distributed_c10d._get_default_store()  # the rendezvous store every rank already shares
    key = f"pan2/{tag}"
    store.add(key, 1)
    while store.add(key, 0) < world_size():
        time.sleep(poll_s)
