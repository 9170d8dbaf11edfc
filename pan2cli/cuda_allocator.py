"""The CUDA caching allocator's one setting pan2 runs with: cached blocks over 1 GiB are never split.

Measured on an H100 80GB (docs/BENCHMARKS.md, "The memory plan under a GPU memory cap"): at 481 frames the DiT's
largest activation is one 6.34 GiB tensor (the feed-forward's hidden states of 103,818 tokens). With PyTorch's
defaults the allocator carves smaller tensors out of that freed block, so the next step's 6.34 GiB finds no
block whole: every 481-frame plan that streams blocks ran out of memory with 5.6-9.6 GiB reserved but free,
fresh processes included. With large blocks kept whole (`max_split_size_mb:1024`) fp8 under a 24 GiB cap ran
(peak 20.8 GiB, the plan's 22.6), and the 121-frame step did not change (2.755 against 2.757 s).
`expandable_segments:True` also cures it, but there the streamed blocks' copies stalled (+25 % a step).

`pan2 generate` and `VideoGenerator` on a GPU set it; `pan2 decode` keeps PyTorch's defaults (its benchmarks were
measured so). A user's own PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) is left as it is.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

SETTINGS = "max_split_size_mb:1024"
USER_VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def configure_cuda_allocator(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Keep large cached CUDA blocks whole unless the user configured the allocator.

    Returns the settings applied, or None where the user's own are in force. Through the environment, which
    the allocator reads when torch loads (`pan2 generate` sets it before importing torch; torchrun's ranks
    inherit it); where torch is already imported (the Python API), also through torch's runtime setter, which
    applies from the next allocation on. `environ` other than None (a test's dict) only sets that mapping.
    """
    runtime = environ is None
    environ = os.environ if environ is None else environ
    if any(environ.get(name) for name in USER_VARIABLES):
        return None
    environ["PYTORCH_CUDA_ALLOC_CONF"] = SETTINGS
    torch = sys.modules.get("torch")
    if runtime and torch is not None:
        # private, but the runtime route torch offers: the accelerator-wide setter where torch has it (2.13 deprecates
        # the CUDA one), else the CUDA one
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        setter = setter or getattr(torch.cuda.memory, "_set_allocator_settings", None)
        try:
            if setter is not None:
                setter(SETTINGS)
        except (AttributeError, RuntimeError):
            pass  # a CPU-only build of torch may have no CUDA allocator to configure
    return SETTINGS
