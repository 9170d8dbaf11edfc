"""Stream some layers of a model (the DiT's blocks, the text encoder's layers) from page-locked host memory to the
device, one at a time, the next one prefetched; the others stay resident on the device.

`LayerStreamer(device, streamed)` keeps the layers of `streamed` (indices into an `nn.ModuleList`) each in a
host arena (`pan2cli.pipeline.pinned.HostArena`: one page-locked buffer per layer), and the rest on the device.
A forward pre-hook on a streamed layer waits for its copy (one asynchronous copy of the whole arena, on a side
stream on CUDA) and points its tensors at it, then starts the copy of the next streamed layer, which overlaps
this layer's compute and that of the resident layers in between; a forward hook points them back at the host.
At most two streamed layers occupy the device. The output is the same: the same weights, the same ops.

Which layers stream is the memory plan's choice (`pan2cli.pipeline.memory_plan`): spread evenly over the model
(`memory_plan.spread`), so that each copy has the compute of several layers to hide behind.

The streamer moves parameters and buffers (what `.to()` moves); a streamed layer holding any other tensor
(`stray_tensors`) is refused, since that tensor would stay behind.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from typing import Iterable

import torch
from torch import nn

from pan2cli.pipeline.pinned import ALIGN, HostArena


def stray_tensors(module: nn.Module) -> list[str]:
    """Names of the tensors `module` (or a submodule) holds outside its parameters and buffers, which neither
    `.to()` nor a streamer moves (attributes, and tensors in a dataclass, list, tuple or dict held by one)."""
    found: list[str] = []

    def visit(value, name: str, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            found.append(name)
        elif depth >= 3 or isinstance(value, nn.Module):
            return  # submodules are walked by `named_modules`
        elif dataclasses.is_dataclass(value) and not isinstance(value, type):
            for field in dataclasses.fields(value):
                visit(getattr(value, field.name), f"{name}.{field.name}", depth + 1)
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(item, f"{name}[{i}]", depth + 1)
        elif isinstance(value, dict):
            for key, item in value.items():
                visit(item, f"{name}[{key!r}]", depth + 1)

    for prefix, sub in module.named_modules():
        for attr, value in vars(sub).items():
            if attr not in ("_parameters", "_buffers", "_modules"):
                visit(value, f"{prefix}.{attr}" if prefix else attr, 0)
    return found


class LayerStreamer:
    """Layers of a `nn.ModuleList` on `device`, those of `streamed` in host memory and streamed in (module docstring).

    Build it, `stage` layers as they load (optional: a streamed layer then goes to host memory as soon as it
    exists, so that the whole model is never on the device), then `attach` it to the layers.

    Args:
        device: where the forward runs.
        streamed: indices of the layers kept in host memory.
    """

    def __init__(self, device: torch.device | str, streamed: Iterable[int]):
        self.device = torch.device(device)
        self.streamed = sorted(set(streamed))
        self.cuda = self.device.type == "cuda"
        self.arenas: dict[int, HostArena] = {}
        self.layers: nn.ModuleList | None = None
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._ready: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self._handles: list = []

    @property
    def host_bytes(self) -> int:
        """Bytes of host memory the streamed layers take (page-locked on CUDA)."""
        return sum(arena.nbytes for arena in self.arenas.values())

    def stage(self, index: int, layer: nn.Module) -> None:
        """Put layer `index` where it runs from: a host arena if it streams, else the device."""
        if index in self.streamed:
            if index not in self.arenas:
                stray = stray_tensors(layer)
                if stray:
                    raise ValueError(
                        f"layer {index} holds tensors outside its parameters and buffers ({', '.join(stray)}); "
                        "a streamer cannot move them: register them as buffers"
                    )
                self.arenas[index] = HostArena(layer, pin=self.cuda)
        else:
            for tensor in (*layer.parameters(), *layer.buffers()):
                if tensor.device != self.device:
                    tensor.data = tensor.data.to(self.device)

    def attach(self, layers: nn.ModuleList) -> "LayerStreamer":
        """Stage every layer not staged yet and install the hooks; returns self."""
        self.layers = layers
        for index, layer in enumerate(layers):
            self.stage(index, layer)
        for index in self.streamed:
            layer = layers[index]
            self._handles.append(layer.register_forward_pre_hook(lambda module, args, i=index: self._load(i)))
            self._handles.append(
                layer.register_forward_hook(lambda module, args, out, i=index: self._unload(i))
            )
        return self

    def _fetch(self, index: int) -> None:
        """Start copying layer `index` to the device (no-op if already under way)."""
        if index in self._ready:
            return
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            flat = self.arenas[index].to_device(self.device)
            event = torch.cuda.Event() if self.stream is not None else None
            if event is not None:
                event.record(self.stream)
        self._ready[index] = (flat, event)

    def _load(self, index: int) -> None:
        self._fetch(index)
        flat, event = self._ready.pop(index)
        if event is not None:
            current = torch.cuda.current_stream(self.device)
            current.wait_event(event)
            # allocated on the side stream, used on this one: keep the memory until this stream is done with it
            flat.record_stream(current)
        self.arenas[index].point_to(flat)
        following = self.streamed[(self.streamed.index(index) + 1) % len(self.streamed)]
        self._fetch(following)  # the next streamed layer (or the first, for the next forward)

    def _unload(self, index: int) -> None:
        arena = self.arenas[index]
        arena.point_to(arena.buffer)

    def remove(self) -> None:
        """Take the hooks off; the streamed layers stay in host memory (pointed back there, should a forward have
        stopped halfway through one)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._ready.clear()
        for arena in self.arenas.values():
            arena.point_to(arena.buffer)

    def compact_resident(self) -> None:
        """Give each resident layer one device allocation of its own (`pack_on_device`), then hand the device
        memory the load left free back to CUDA.

        A partly streamed model is loaded layer by layer: an fp8 block's bf16 weights are read and quantised on
        the device, and a streamed block's leave for host memory, so the resident layers' tensors end up
        scattered among freed blocks of the caching allocator that it can neither reuse for the streamed
        layers' copies (each one allocation of a whole layer) nor give back. On an H100 capped at 24 GiB, a
        bench run that had moved 28 of 44 fp8 blocks out of a resident model ran out of memory with 16.5 GiB
        allocated and 6.9 GiB reserved but free. (This compaction is not yet measured on a GPU.)"""
        if not self.cuda or self.layers is None:
            return
        for index, layer in enumerate(self.layers):
            if index not in self.streamed:
                pack_on_device(layer, self.device)
        torch.cuda.empty_cache()

    def replan(self, streamed: Iterable[int]) -> "LayerStreamer":
        """A streamer of the same layers with another set streamed (this one's hooks removed): the layers that
        start streaming go to host memory first (freeing device memory), then those that stop come back to the
        device; the others keep their arenas."""
        if self.layers is None:
            raise RuntimeError("replan() needs an attached streamer")
        self.remove()
        successor = LayerStreamer(self.device, streamed)
        successor.arenas = {i: arena for i, arena in self.arenas.items() if i in successor.streamed}
        for index in successor.streamed:
            successor.stage(index, self.layers[index])
        for index, arena in self.arenas.items():
            if index not in successor.streamed:
                arena.release_to(self.device)
        self.arenas = {}
        return successor.attach(self.layers)


def pack_on_device(module: nn.Module, device: torch.device) -> None:
    """Move every parameter and buffer of `module` into one new allocation on `device`, each a view `ALIGN`-byte
    aligned (`.data` swapped: the parameter objects stay); the old storage is freed as the last view goes."""
    tensors = list(dict.fromkeys((*module.parameters(), *module.buffers())))
    sizes = [t.numel() * t.element_size() for t in tensors]
    flat = torch.empty(sum(-(-n // ALIGN) * ALIGN for n in sizes), dtype=torch.uint8, device=device)
    offset = 0
    for tensor, nbytes in zip(tensors, sizes):
        view = flat[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor.data)
        tensor.data = view
        offset += -(-nbytes // ALIGN) * ALIGN


def stream_layers(
    model: nn.Module, name: str, device: torch.device | str, streamer: LayerStreamer
) -> LayerStreamer:
    """Put everything of `model` but its `name` ModuleList on `device`, and `streamer` on that list's layers
    (the text encoder's `layers`; `enable_block_offload` for the DiT's blocks)."""
    layers = getattr(model, name)
    setattr(model, name, nn.ModuleList())
    model.to(device)
    setattr(model, name, layers)
    return streamer.attach(layers)


def enable_block_offload(
    model: nn.Module,
    device: torch.device | str,
    streamed: Iterable[int] | None = None,
    streamer: LayerStreamer | None = None,
) -> LayerStreamer:
    """Put everything but `model.transformer_blocks` on `device` and stream the blocks of `streamed` (default: all)
    in during forward; the others go to `device` too.

    Args:
        model: a `PAN2Transformer3DModel` (anything with a `transformer_blocks` ModuleList), on any device.
        device: where the forward runs.
        streamed: block indices kept in host memory (default: every block).
        streamer: a streamer whose blocks were staged while the model loaded (then `streamed` is its own).

    Returns:
        The streamer (its hooks stay until `remove()`), also kept as `model.block_streamer`.
    """
    if streamer is None:
        count = len(model.transformer_blocks)
        streamer = LayerStreamer(device, range(count) if streamed is None else streamed)
    model.block_streamer = stream_layers(model, "transformer_blocks", device, streamer)
    return streamer
