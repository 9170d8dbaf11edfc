"""Stream the DiT's blocks from (pinned) host memory to the device one at a time, with the next one prefetched.

Everything but `model.transformer_blocks` (28 of the 29.2 B parameters) lives on the device; each block's tensors stay in host memory and are
copied in by a forward pre-hook (on a side stream on CUDA, the next block's copy overlapping the current
block's compute) and dropped by a forward hook. At most two blocks occupy the device, so PAN 2's 29B
parameters (58 GB in bf16) run on an 80 GB GPU. The output is the same: the same weights, the same ops.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import nn


class BlockStreamer:
    """Installed on a model by `enable_block_offload`; `remove()` takes the hooks off."""

    def __init__(self, model: nn.Module, device: torch.device):
        self.device = device
        self.blocks = list(model.transformer_blocks)
        cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if cuda else None
        # (parameter, host copy) per block; pinned memory makes each copy one full-speed DMA.
        self.host: list[list[tuple[nn.Parameter, torch.Tensor]]] = []
        for block in self.blocks:
            pairs = []
            for tensor in (*block.parameters(), *block.buffers()):
                host = tensor.data.to("cpu")
                pairs.append((tensor, host.pin_memory() if cuda else host))
                tensor.data = pairs[-1][1]
            self.host.append(pairs)
        self._ready: dict[int, tuple[list[torch.Tensor], torch.cuda.Event | None]] = {}
        self._handles = []
        for index, block in enumerate(self.blocks):
            self._handles.append(block.register_forward_pre_hook(lambda module, args, i=index: self._load(i)))
            self._handles.append(
                block.register_forward_hook(lambda module, args, out, i=index: self._unload(i))
            )

    def _fetch(self, index: int) -> None:
        """Start copying block `index` to the device (no-op if already under way)."""
        if index in self._ready:
            return
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            tensors = [host.to(self.device, non_blocking=True, copy=True) for _, host in self.host[index]]
            event = torch.cuda.Event() if self.stream is not None else None
            if event is not None:
                event.record(self.stream)
        self._ready[index] = (tensors, event)

    def _load(self, index: int) -> None:
        self._fetch(index)
        tensors, event = self._ready.pop(index)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            for tensor in tensors:
                # allocated on the side stream, used on this one: keep the memory until this stream is done
                tensor.record_stream(current)
        for (param, _), tensor in zip(self.host[index], tensors):
            param.data = tensor
        self._fetch((index + 1) % len(self.blocks))  # the next block (or the first, for the next step)

    def _unload(self, index: int) -> None:
        for param, host in self.host[index]:
            param.data = host

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._ready.clear()


def enable_block_offload(model: nn.Module, device: torch.device) -> BlockStreamer:
    """Put everything but `model.transformer_blocks` on `device` and stream the blocks in during forward.

    Args:
        model: a `PAN2Transformer3DModel` (anything with a `transformer_blocks` ModuleList), on any device.
        device: where the forward runs.

    Returns:
        The streamer (its hooks stay until `remove()`).
    """
    blocks = model.transformer_blocks
    model.transformer_blocks = nn.ModuleList()
    model.to(device)
    model.transformer_blocks = blocks
    return BlockStreamer(model, device)
