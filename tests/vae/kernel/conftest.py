"""Fixtures of the decode kernel's GPU tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def kernel_ops():
    """The compiled extension's ops for this GPU (built or loaded from the cache); skips without one."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from pan2cli.vae.kernel.build import current_arch, load_kernel

    if current_arch() is None:
        pytest.skip("no supported GPU for the compiled kernel")
    return load_kernel()
