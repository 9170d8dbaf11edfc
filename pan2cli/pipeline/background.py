"""`BackgroundLoad`: a model read in a thread of its own while the caller goes on (the transformer's 63 GB while
the text encoder loads and encodes the prompts), with its failure reported to the caller and its thread never
left behind.

The loader is a function of one argument, `tick`, that it calls after each tensor: `tick` counts the tensors
(the progress the caller shows once it waits) and raises `LoadCancelled` once the caller has given up (an
error of its own, Ctrl-C), so the thread ends within one tensor. On CUDA the loader's copies run on a stream
of their own, synchronised before the result is handed over, and on the caller's device (a thread starts on
device 0).

    with BackgroundLoad(lambda tick: load(..., on_tensor=tick), device) as transformer:
        ...                       # the caller's work; `transformer.check()` raises the loader's error early
        model = transformer.result()
"""

from __future__ import annotations

import threading
import time
from contextlib import nullcontext
from typing import Callable, Generic, TypeVar

import torch

T = TypeVar("T")


class LoadCancelled(Exception):
    """Raised inside a background load that its caller has given up on."""


class BackgroundLoad(Generic[T]):
    """Run `load(tick)` in a daemon thread from construction (module docstring).

    Args:
        load: reads the model; calls `tick()` after each tensor.
        device: where the model goes (CUDA: the thread works on this device, on its own stream).
        name: the thread's name (it shows in a stack dump).
        after: a load that must end before this one starts reading (the text encoder's 16 GB before the
            transformer's 67: the text path is the one the first step waits for, and two loads at once share
            the host's bandwidth); cancelling this one stops its wait.
    """

    def __init__(
        self,
        load: Callable[[Callable[[], None]], T],
        device: torch.device,
        name: str = "pan2-load",
        after: "BackgroundLoad | None" = None,
    ):
        self._load = load
        self._after = after
        self._device = device
        self._cancelled = threading.Event()
        self._result: T | None = None
        self._error: BaseException | None = None
        self.tensors = 0  # tensors read so far (the loader's ticks)
        self.started = time.perf_counter()  # on the clock of `time.perf_counter`
        self.seconds: float | None = None  # the load's own duration, once it has ended
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _tick(self) -> None:
        if self._cancelled.is_set():
            raise LoadCancelled("the load was cancelled")
        self.tensors += 1

    def _run(self) -> None:
        cuda = self._device.type == "cuda"
        stream = torch.cuda.Stream(self._device) if cuda else None
        try:
            while self._after is not None and not self._after.done:
                if self._cancelled.is_set():
                    raise LoadCancelled("the load was cancelled")
                self._after._thread.join(0.01)
            with torch.cuda.device(self._device) if cuda else nullcontext():
                with torch.cuda.stream(stream) if cuda else nullcontext():
                    self._result = self._load(self._tick)
                if stream is not None:
                    stream.synchronize()  # the caller's stream may use the tensors at once
        except BaseException as error:  # handed to the caller's thread, which raises it
            self._error = error
        finally:
            self.seconds = time.perf_counter() - self.started

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def check(self) -> None:
        """Raise the loader's error now if it has already failed (the caller stops early); else nothing."""
        if self.done and self._error is not None and not isinstance(self._error, LoadCancelled):
            raise self._error

    def wait(self, on_tick: Callable[[int], None] | None = None, poll_s: float = 0.1) -> None:
        """Block until the load has ended, calling `on_tick(new tensors)` as it advances, the tensors read before
        the call first (a progress bar opened when the caller starts to wait)."""
        seen = 0
        while self._thread.is_alive():
            self._thread.join(poll_s)
            if on_tick is not None and self.tensors > seen:
                on_tick(self.tensors - seen)
                seen = self.tensors
        if on_tick is not None and self.tensors > seen:
            on_tick(self.tensors - seen)

    def result(self) -> T:
        """The loaded model (waits for it), or the loader's error raised here."""
        self.wait()
        if self._error is not None:
            raise self._error
        return self._result

    def take(self) -> T:
        """`result()`, handed over: this load keeps no reference to it, so that the caller's release frees it."""
        model = self.result()
        self._result = None
        return model

    def cancel(self) -> None:
        """Stop the load (within one tensor), wait for its thread, and drop what it read."""
        self._cancelled.set()
        self._thread.join()
        self._result = None

    def __enter__(self) -> "BackgroundLoad[T]":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:  # the caller failed or was interrupted: no thread outlives it
            self.cancel()
