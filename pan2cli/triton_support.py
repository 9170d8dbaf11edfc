"""Whether Triton is here and whether it interprets: one answer for every Triton kernel of the project
(the DiT fusions and the VAE's fixed-order convolutions)."""

from __future__ import annotations

import importlib.util

# Looked up once at import (cheap: no import of triton) so that compiled code sees a constant.
_TRITON_AVAILABLE = importlib.util.find_spec("triton") is not None


def triton_available() -> bool:
    """Whether Triton can be imported (CUDA builds of torch ship it; CPU builds usually do not)."""
    return _TRITON_AVAILABLE


def triton_interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter: `TRITON_INTERPRET` read as Triton reads it."""
    if not _TRITON_AVAILABLE:
        return False
    import triton

    return bool(triton.knobs.runtime.interpret)
