"""`StagedReader`: safetensors tensors read to a device at the storage and host-to-device limits.

`safe_open(...).get_tensor(key).to("cuda")` reads one tensor at a time through the page cache into pageable
memory and copies it with a synchronous transfer: 3.5 GB/s on an H200 host from a warm page cache, 18 s for
the transformer's 63 GB. Here the files' bytes are read by several threads (`os.preadv` releases the GIL) in
chunks of `CHUNK_BYTES`, each thread into two pinned host buffers of its own, and copied to the device on a
CUDA stream per thread, so that reading one chunk overlaps copying the last. A chunk spans neighbouring
tensors and large tensors span chunks; the bytes land as they are stored (no cast: the caller casts on the
device, where it is cheap). On the CPU the threads read straight into the tensors' memory.

The header is safetensors' documented format (8-byte little-endian length, a JSON table of dtype, shape and
`data_offsets` per tensor, then the data), parsed here because the library does not expose the offsets;
every entry is checked against the file's size before anything is read.

    with StagedReader(files, device) as reader:          # files: tensor name → safetensors path
        tensors = reader.read(keys, on_tensor=tick)       # tick() after each tensor is on the device
"""

from __future__ import annotations

import itertools
import json
import math
import os
import struct
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping

import torch

from pan2cli.checkpoints.files import CHECKPOINT_ERRORS, SAFETENSORS_DTYPES, ReadErrors

CHUNK_BYTES = 32 << 20  # per read and copy: large enough for full-rate reads, small enough to cancel quickly
READERS = 8  # threads: 8.0, 16.2, 19.6, 24.0 GB/s with 2, 6, 8, 12 from an H200 host's page cache
ALIGN = 256  # bytes between tensors of one flat allocation: cudaMalloc's own alignment
_MAX_HEADER = 100 << 20  # safetensors' own limit


@dataclass(frozen=True)
class TensorSpan:
    """Where one tensor's bytes are: its file, dtype, shape and absolute byte range."""

    path: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int
    end: int


def safetensors_spans(path: Path, errors: ReadErrors = CHECKPOINT_ERRORS) -> dict[str, TensorSpan]:
    """Every tensor's `TensorSpan` in a safetensors file, from its header alone, each checked to fit the file.

    Raises:
        errors.error: empty, truncated, or not a safetensors file (a header that does not parse or does not fit).
    """
    path = Path(path)
    size = path.stat().st_size
    if size == 0:
        raise errors.empty(path)
    try:
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8).rjust(8, b"\0"))
            if size < 8 or length > min(_MAX_HEADER, size - 8):
                raise ValueError(f"header of {length} bytes in a file of {size}")
            header = json.loads(handle.read(length))
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        start = 8 + length
        spans = {}
        for key, entry in header.items():
            if key == "__metadata__":
                continue
            dtype = SAFETENSORS_DTYPES[entry["dtype"]]
            shape = tuple(int(n) for n in entry["shape"])
            begin, end = (int(n) for n in entry["data_offsets"])
            nbytes = math.prod(shape) * torch.empty(0, dtype=dtype).element_size()
            if end - begin != nbytes or begin < 0 or start + end > size:
                raise ValueError(f"tensor {key}: bytes {begin}..{end} do not fit its shape or the file")
            spans[key] = TensorSpan(path, dtype, shape, start + begin, start + end)
    except (ValueError, KeyError, TypeError) as exc:
        raise errors.unreadable(path, exc, "safetensors file") from exc
    return spans


@dataclass
class _Chunk:
    """One read: `length` bytes of `path` from `offset`, and the parts of tensors they hold."""

    path: Path
    offset: int
    length: int = 0
    pieces: list[tuple[str, int, int, int]] = field(
        default_factory=list
    )  # key, tensor byte, chunk byte, bytes

    @property
    def keys(self) -> list[str]:
        return [piece[0] for piece in self.pieces]


def plan_chunks(spans: Iterable[tuple[str, TensorSpan]], chunk_bytes: int) -> list[_Chunk]:
    """The reads that cover these tensors: neighbouring tensors of a file share a chunk, none over `chunk_bytes`."""
    chunks: list[_Chunk] = []
    for key, span in sorted(spans, key=lambda item: (str(item[1].path), item[1].begin)):
        done = 0
        while done < span.end - span.begin:
            position = span.begin + done
            last = chunks[-1] if chunks else None
            if (
                last is None
                or last.path != span.path
                or last.offset + last.length != position
                or last.length >= chunk_bytes
            ):
                last = _Chunk(span.path, position)
                chunks.append(last)
            part = min(span.end - position, chunk_bytes - last.length)
            last.pieces.append((key, done, last.length, part))
            last.length += part
            done += part
    return chunks


def _read_exactly(fd: int, view: memoryview, offset: int, path: Path) -> None:
    """Fill `view` from `offset` of the open file (positional reads: threads share the descriptor)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got == 0:
            raise OSError(f"{path} ended {len(view) - done} bytes early (truncated?)")
        done += got


class _Staging:
    """One reader thread's two pinned buffers, the events of their last copies, and its CUDA stream."""

    def __init__(self, device: torch.device, chunk_bytes: int):
        self.stream = torch.cuda.Stream(device)
        self.buffers = [torch.empty(chunk_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        self.events = [torch.cuda.Event() for _ in range(2)]
        self.turn = 0

    def next(self) -> tuple[torch.Tensor, torch.cuda.Event]:
        self.turn ^= 1
        self.events[self.turn].synchronize()  # the copy out of this buffer has finished: it can be refilled
        return self.buffers[self.turn], self.events[self.turn]


class StagedReader:
    """Read tensors of safetensors files to `device` with `readers` threads (module docstring).

    Args:
        files: tensor name → the safetensors file that holds it.
        device: where the tensors go (CUDA: through pinned buffers; CPU: read in place).
        readers: reading threads (default `READERS`). chunk_bytes: bytes per read (the pinned memory is 2 · readers · chunk_bytes).
        errors: how a bad file is reported.

    Raises:
        errors.error: a header that does not parse (at construction), a file that cannot be read (in `read`).
    """

    def __init__(
        self,
        files: Mapping[str, Path],
        device: torch.device | str,
        *,
        readers: int | None = None,
        chunk_bytes: int | None = None,
        errors: ReadErrors = CHECKPOINT_ERRORS,
    ):
        self.device = torch.device(device)
        self.chunk_bytes = chunk_bytes or CHUNK_BYTES
        self._errors = errors
        paths = sorted(set(map(Path, files.values())))
        self.spans: dict[str, TensorSpan] = {}
        for path in paths:
            spans = safetensors_spans(path, errors)
            self.spans.update({key: span for key, span in spans.items() if Path(files.get(key, "")) == path})
        self._fds = {path: os.open(path, os.O_RDONLY) for path in paths}
        self._cuda = self.device.type == "cuda"
        if self._cuda and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._local = threading.local()
        self._stagings: list[_Staging] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        name = f"{threading.current_thread().name}-reader"
        self._pool = ThreadPoolExecutor(max_workers=max(1, readers or READERS), thread_name_prefix=name)

    def _staging(self) -> _Staging:
        staging = getattr(self._local, "staging", None)
        if staging is None:
            torch.cuda.set_device(self.device)  # a new thread starts on device 0
            staging = self._local.staging = _Staging(self.device, self.chunk_bytes)
            with self._lock:
                self._stagings.append(staging)
        return staging

    def _read_chunk(self, chunk: _Chunk, targets: Mapping[str, torch.Tensor]) -> _Chunk:
        """Read one chunk and start its copies into the tensors' bytes (or, on the CPU, read in place)."""
        if self._stop.is_set():
            return chunk
        fd = self._fds[chunk.path]
        try:
            if not self._cuda:
                for key, at, within, nbytes in chunk.pieces:
                    view = memoryview(targets[key].numpy())[at : at + nbytes]
                    _read_exactly(fd, view, chunk.offset + within, chunk.path)
                return chunk
            staging = self._staging()
            buffer, event = staging.next()
            _read_exactly(fd, memoryview(buffer.numpy())[: chunk.length], chunk.offset, chunk.path)
            with torch.cuda.stream(staging.stream):
                for key, at, within, nbytes in chunk.pieces:
                    targets[key][at : at + nbytes].copy_(buffer[within : within + nbytes], non_blocking=True)
                event.record(staging.stream)
        except OSError as exc:
            raise self._errors.error(
                f"{chunk.path} could not be read: {exc.strerror or exc}", hint=self._errors.hint
            ) from exc
        return chunk

    def _synchronize(self) -> None:
        with self._lock:
            for staging in self._stagings:
                staging.stream.synchronize()

    def _submit(
        self, keys: list[str], flat: bool = False
    ) -> tuple[dict[str, torch.Tensor], list[Future], dict[str, int]]:
        """Allocate the tensors of `keys` and queue their chunks' reads.

        flat: one allocation for all of them, the tensors views into it (256-byte aligned, as cudaMalloc's): a
            model's thousand-odd cudaMallocs in a burst held the allocator (and the driver) while the caller's
            thread computed; one is free of that. The buffer lives while any view does.
        """
        # Normal tensors even for a caller in inference mode: the reading threads (outside it) write into them.
        with torch.inference_mode(False):
            if flat:
                sizes = {key: self.spans[key].end - self.spans[key].begin for key in keys}
                starts, total = {}, 0
                for key in keys:
                    starts[key], total = total, total + -(-sizes[key] // ALIGN) * ALIGN
                flat_buffer = torch.empty(total, dtype=torch.uint8, device=self.device)
                tensors = {
                    key: flat_buffer[starts[key] : starts[key] + sizes[key]]
                    .view(self.spans[key].dtype)
                    .view(self.spans[key].shape)
                    for key in keys
                }
            else:
                tensors = {
                    key: torch.empty(self.spans[key].shape, dtype=self.spans[key].dtype, device=self.device)
                    for key in keys
                }
            targets = {key: tensor.view(-1).view(torch.uint8) for key, tensor in tensors.items()}
        chunks = plan_chunks(((key, self.spans[key]) for key in keys), self.chunk_bytes)
        futures = [self._pool.submit(self._read_chunk, chunk, targets) for chunk in chunks]
        return tensors, futures, {key: self.spans[key].end - self.spans[key].begin for key in keys}

    def read_each(
        self,
        groups: Iterable[Iterable[str]],
        on_tensor: Callable[[], None] | None = None,
        flat: bool = False,
    ) -> Iterator[dict[str, torch.Tensor]]:
        """Each group's tensors on the device, as stored, group after group, the next group's reads running
        while the caller works on this one (the transformer's blocks: read one, quantise the last);
        `on_tensor()` after each tensor is read (it may raise to stop).

        Raises:
            errors.error: a file that cannot be read or ends early; whatever `on_tensor` raises. Either way (and
            when the caller stops iterating) the reads in flight finish first and nothing read is kept.
        """
        groups = iter([list(keys) for keys in groups])
        queued: deque = deque()
        self._stop.clear()
        try:
            for keys in itertools.islice(groups, 2):
                queued.append(self._submit(keys, flat))
            while queued:
                tensors, futures, remaining = queued[0]
                for _ in range(sum(nbytes == 0 for nbytes in remaining.values()) if on_tensor else 0):
                    on_tensor()  # empty tensors: nothing to read
                for future in as_completed(futures):
                    for key, _, _, nbytes in future.result().pieces:
                        remaining[key] -= nbytes
                        if remaining[key] == 0 and on_tensor is not None:
                            on_tensor()
                self._synchronize()  # this group's copies have landed
                queued.popleft()
                keys = next(groups, None)
                if keys is not None:
                    queued.append(self._submit(keys, flat))
                yield tensors
        except BaseException:  # GeneratorExit too: the caller stopped
            self._stop.set()
            for _, futures, _ in queued:
                for future in futures:
                    future.cancel()
                for future in futures:  # the reads in flight end before their targets are dropped
                    if not future.cancelled():
                        future.exception()
            raise
        finally:
            self._synchronize()

    def read(
        self,
        keys: Iterable[str],
        on_tensor: Callable[[], None] | None = None,
        flat: bool | None = None,
    ) -> dict[str, torch.Tensor]:
        """The tensors `keys` on the device, as stored (`read_each` of one group; `flat` by default on a GPU)."""
        (tensors,) = self.read_each([keys], on_tensor, flat=self._cuda if flat is None else flat)
        return tensors

    def close(self) -> None:
        """End the threads, free the pinned buffers and close the files."""
        self._stop.set()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._synchronize()
        self._stagings.clear()
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()

    def __enter__(self) -> "StagedReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
