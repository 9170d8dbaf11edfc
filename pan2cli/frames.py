"""Frame math and host copies: decoded frames to uint8 pixels, PSNR, and chunks of frames copied to (pinned) host memory."""

from __future__ import annotations

import math

import torch


def frames_to_uint8(video: torch.Tensor) -> torch.Tensor:
    """Map decoded frames from [-1, 1] to uint8 pixels, on the same device.

    Args:
        video: [3, F, H, W] floating tensor (any float dtype, any device), values in [-1, 1].

    Returns:
        uint8 [F, H, W, 3] contiguous tensor on `video.device`: round((x + 1) * 127.5),
        clamped to [0, 255].

    Raises:
        ValueError: `video` is not a [3, F, H, W] floating tensor.
    """
    if video.ndim != 4 or video.shape[0] != 3 or not video.is_floating_point():
        raise ValueError(f"expected a floating [3, F, H, W] video, got {video.dtype} {tuple(video.shape)}")
    # float32 math even for bf16/fp16 input: bf16 cannot represent (x + 1) * 127.5 to 0.5.
    x = (video.to(torch.float32) + 1.0) * 127.5
    # torch.round rounds half to even: 127.5 (x = 0) -> 128, 0.5 -> 0, 1.5 -> 2. Exact .5
    # values are rare in decoded output, so the bias is negligible and matches numpy.
    x = x.round_().clamp_(0.0, 255.0).to(torch.uint8)
    # Permute after the cast so the layout copy moves 1 byte per value, not 4.
    return x.permute(1, 2, 3, 0).contiguous()


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    """Peak signal-to-noise ratio in dB of two uint8 videos (or frames) of one shape, on [0, 255]; the
    mean squared error in float64; inf when they are equal."""
    mse = (a.double() - b.double()).square().mean().item()
    return math.inf if mse == 0 else 10 * math.log10(255.0**2 / mse)


def copy_to_host(frames: torch.Tensor) -> torch.Tensor:
    """Copy a whole chunk of frames to CPU memory in one transfer.

    Args:
        frames: any tensor (typically uint8 [f, H, W, 3]) on any device.

    Returns:
        The same tensor if it is already on CPU; otherwise a CPU copy (pinned for CUDA),
        complete when this function returns.
    """
    return copy_to_host_async(frames).wait()


class HostCopy:
    """A chunk of frames on its way to pinned host memory: `wait()` returns it once it has landed."""

    def __init__(self, host: torch.Tensor, ready: "torch.cuda.Event | None"):
        self._host = host
        self._ready = ready

    def wait(self) -> torch.Tensor:
        if self._ready is not None:
            self._ready.synchronize()
        return self._host


def copy_to_host_async(frames: torch.Tensor) -> HostCopy:
    """Start ONE copy of a whole chunk to pinned host memory on a side stream, and return at once.

    The GPU goes on with the next chunk while the copy runs; `HostCopy.wait()` hands the frames over.

    Args:
        frames: any tensor (typically uint8 [f, H, W, 3]) on any device.
    """
    if frames.device.type != "cuda":
        return HostCopy(frames.to("cpu"), None)
    stream = _copy_streams.setdefault(frames.device, torch.cuda.Stream(frames.device))
    stream.wait_stream(torch.cuda.current_stream(frames.device))  # the frames are computed
    host = torch.empty(frames.shape, dtype=frames.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(frames, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(stream)
    # The caching allocator must not hand the frames' memory to the decode before the copy is done.
    frames.record_stream(stream)
    return HostCopy(host, ready)


_copy_streams: dict = {}
