"""A module's tensors in one page-locked host buffer, for streaming it to the GPU (`pan2cli.pipeline.offload`).

`HostArena.take(module)` moves every parameter and buffer of a module (from whatever device) into one flat host
buffer, each tensor a view 256 bytes aligned, and page-locks the buffer with `cudaHostRegister`: exactly its
size. torch's own pinned allocator (`pin_memory()`) rounds each allocation up to a power of two, so the
float32 AdaLN weight of a PAN 2 block (384 MiB) would take 512 MiB, 5.5 GiB over the 44 blocks. One buffer
per module also makes a block's trip to the GPU one copy into one allocation (`to_device`).

The registration ends when the arena is collected (after the device has finished its copies); the memory
itself goes when the last view of it does.
"""

from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from pan2cli.errors import Pan2Error

ALIGN = 256  # bytes: where each tensor starts in an arena (cudaMalloc's alignment)
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


@dataclass(frozen=True)
class _Slot:
    tensor: torch.Tensor  # the module's parameter or buffer (its `.data` is swapped, the object stays)
    start: int
    nbytes: int
    dtype: torch.dtype
    shape: torch.Size


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def module_bytes(module: nn.Module) -> int:
    """Bytes an arena of `module` takes: its parameters and buffers, each rounded up to `ALIGN`."""
    return sum(_aligned(t.numel() * t.element_size()) for t in (*module.parameters(), *module.buffers()))


def _whole_pages(nbytes: int) -> torch.Tensor:
    """`nbytes` of host memory starting on a page of its own and ending a page short of the allocation's end, so
    that no other allocation shares a page with it: `cudaHostRegister` locks whole pages, and a page locked twice
    (by two arenas from the same heap) is an error."""
    raw = torch.empty(nbytes + 2 * PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % PAGE
    return raw[start : start + nbytes]


def _page_lock(buffer: torch.Tensor) -> None:
    error = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    code = int(getattr(error, "value", error))
    if code != 0:
        raise Pan2Error(
            f"could not page-lock {buffer.numel() / 2**30:.2f} GiB of host memory for streaming to the GPU "
            f"(cudaHostRegister error {code})",
            hint="free host memory, or let fewer blocks stream: --precision fp8, or a larger --max-gpu-memory",
        )


def _unlock(pointer: int) -> None:
    try:
        torch.cuda.synchronize()  # no copy from the buffer may be in flight when it stops being page-locked
        torch.cuda.cudart().cudaHostUnregister(pointer)
    except Exception:
        pass  # the process is ending (CUDA already torn down): its memory goes with it


class HostArena:
    """One module's parameters and buffers in one host buffer (page-locked when `pin`), as views.

    Args:
        module: its tensors are moved here (`.data` swapped: the module's parameter objects stay the same).
        pin: page-lock the buffer (for asynchronous copies to a GPU); False on a CPU-only run.
    """

    def __init__(self, module: nn.Module, pin: bool):
        tensors = list(dict.fromkeys((*module.parameters(), *module.buffers())))
        self.slots: list[_Slot] = []
        total = 0
        for tensor in tensors:
            nbytes = tensor.numel() * tensor.element_size()
            self.slots.append(_Slot(tensor, total, nbytes, tensor.dtype, tensor.shape))
            total += _aligned(nbytes)
        self.nbytes = total
        self.buffer = _whole_pages(total)
        self.pinned = False
        if pin and total:
            _page_lock(self.buffer)
            self.pinned = True
            finalizer = weakref.finalize(self, _unlock, self.buffer.data_ptr())
            finalizer.atexit = False  # at exit the process's memory is released whole
        for slot, view in zip(self.slots, self.views(self.buffer)):
            view.copy_(slot.tensor.data)
            slot.tensor.data = view

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each slot's tensor as a view of `flat` (this arena's buffer, or a device copy of it), in slot order."""
        return [
            flat[slot.start : slot.start + slot.nbytes].view(slot.dtype).view(slot.shape)
            for slot in self.slots
        ]

    def to_device(self, device: torch.device) -> torch.Tensor:
        """The whole buffer copied to `device` in one copy, asynchronous where the buffer is page-locked."""
        return self.buffer.to(device, non_blocking=self.pinned, copy=True)

    def point_to(self, flat: torch.Tensor) -> None:
        """Make the module's tensors views of `flat`: a device copy of the buffer, or the buffer itself."""
        for slot, view in zip(self.slots, self.views(flat)):
            slot.tensor.data = view

    def release_to(self, device: torch.device) -> None:
        """Copy the module's tensors to `device` for good (they stop being views of this arena)."""
        for slot in self.slots:
            slot.tensor.data = slot.tensor.data.to(device, copy=True)
