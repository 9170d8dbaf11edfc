"""Which scaled-dot-product-attention kernel the transformer runs, chosen by pan2 rather than left to torch.

The joint attention over [video; text] is 40–72 % of a PAN 2 block's FLOPs at 704x1248. On an H200,
cuDNN's SDPA reached 573–614 TFLOP/s at these shapes and the flash backend 357–365 (measured with
scripts/bench_dit.py), and torch's own pick is not guaranteed to be cuDNN. So the denoising runs under an explicit priority:

    cuDNN → flash → memory-efficient → math

through `torch.nn.attention.sdpa_kernel(..., set_priority=True)`: torch takes the first backend of the
list that accepts the inputs (dtype, head size, device), so a backend that refuses them falls through to
the next instead of failing. `PAN2_ATTENTION=flash` (or `cudnn`, `efficient`, `math`) moves one backend
to the front. `attention_backend` says which one a given problem gets: `pan2 doctor` prints it and every
video's sidecar records it.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Iterator

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from pan2cli.errors import InputError

ENV_ATTENTION = "PAN2_ATTENTION"
BACKENDS = {
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "flash": SDPBackend.FLASH_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}
DEFAULT_ORDER = ("cudnn", "flash", "efficient", "math")


def attention_order() -> tuple[str, ...]:
    """The backends in priority order: `DEFAULT_ORDER`, with `PAN2_ATTENTION`'s choice first when set."""
    first = os.environ.get(ENV_ATTENTION, "").strip().lower()
    if not first:
        return DEFAULT_ORDER
    if first not in BACKENDS:
        raise InputError(
            f"{ENV_ATTENTION}={first!r} is not an attention backend", hint=f"use one of {', '.join(BACKENDS)}"
        )
    return (first, *(name for name in DEFAULT_ORDER if name != first))


@contextmanager
def attention_backends() -> Iterator[tuple[str, ...]]:
    """Run the enclosed attention under pan2's backend priority (module docstring); yields the order."""
    order = attention_order()
    with sdpa_kernel([BACKENDS[name] for name in order], set_priority=True):
        yield order


def _accepts(name: str, params, debug: bool = False) -> bool:
    checks = {
        "cudnn": torch.backends.cuda.can_use_cudnn_attention,
        "flash": torch.backends.cuda.can_use_flash_attention,
        "efficient": torch.backends.cuda.can_use_efficient_attention,
    }
    return name == "math" or checks[name](params, debug)


def attention_backend(
    device: torch.device, dtype: torch.dtype, heads: int, head_dim: int, tokens: int = 1024
) -> str:
    """The backend the transformer's attention takes for `heads` x `head_dim` in `dtype` on `device`.

    On a GPU: the first of `attention_order()` whose own check accepts such inputs (cuDNN also needs a
    cuDNN with SDPA, sm_80 or newer; flash needs fp16/bf16 and head_dim ≤ 256). On the CPU, torch
    chooses among its CPU kernels itself: "cpu".
    """
    device = torch.device(device)
    if device.type != "cuda":
        return "cpu"
    q = torch.empty(1, heads, tokens, head_dim, device=device, dtype=dtype)
    params = torch.backends.cuda.SDPAParams(q, q, q, None, 0.0, False, False)
    enabled = {  # the global switches (torch.backends.cuda.enable_*_sdp) still apply under the priority
        "cudnn": torch.backends.cuda.cudnn_sdp_enabled(),
        "flash": torch.backends.cuda.flash_sdp_enabled(),
        "efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
        "math": torch.backends.cuda.math_sdp_enabled(),
    }
    for name in attention_order():
        if enabled[name] and _accepts(name, params):
            return name
    return "none"
