"""The transformer's attention backend (pan2cli.dit.attention): an explicit priority with fallback, named."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pan2cli.dit.attention import (
    DEFAULT_ORDER,
    ENV_ATTENTION,
    attention_backend,
    attention_backends,
    attention_order,
)
from pan2cli.errors import InputError


def test_order_is_cudnn_first_unless_the_environment_names_one(monkeypatch):
    monkeypatch.delenv(ENV_ATTENTION, raising=False)
    assert attention_order() == DEFAULT_ORDER == ("cudnn", "flash", "efficient", "math")
    monkeypatch.setenv(ENV_ATTENTION, "Flash")
    assert attention_order() == ("flash", "cudnn", "efficient", "math")
    monkeypatch.setenv(ENV_ATTENTION, "flash-attn-4")
    with pytest.raises(InputError, match="PAN2_ATTENTION='flash-attn-4' is not an attention backend"):
        attention_order()


def test_the_priority_is_torchs_during_the_block_and_restored_after(monkeypatch):
    """torch keeps the priority in its global context (`sdpa_kernel(..., set_priority=True)`): pan2's order
    inside the block, the caller's again after it."""
    monkeypatch.setenv(ENV_ATTENTION, "efficient")
    before = torch._C._get_sdp_priority_order()
    with attention_backends() as order:
        inside = torch._C._get_sdp_priority_order()
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(1, 2, 5, 8, generator=gen, dtype=torch.float64) for _ in range(3))
        out = F.scaled_dot_product_attention(q, k, v)
    assert order == ("efficient", "cudnn", "flash", "math")
    names = {int(torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION): "efficient", int(torch.nn.attention.SDPBackend.CUDNN_ATTENTION): "cudnn",
             int(torch.nn.attention.SDPBackend.FLASH_ATTENTION): "flash", int(torch.nn.attention.SDPBackend.MATH): "math"}  # fmt: skip
    assert [names[b] for b in inside if b in names][:4] == list(order)
    assert torch._C._get_sdp_priority_order() == before
    reference = torch.softmax(q @ k.transpose(-1, -2) / 8**0.5, dim=-1) @ v  # float64: the same to rounding
    assert torch.allclose(out, reference, rtol=0, atol=1e-12)


def test_cpu_reports_torchs_own_choice():
    assert attention_backend(torch.device("cpu"), torch.float32, heads=32, head_dim=128) == "cpu"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_bf16_release_heads_take_cudnn_or_flash(monkeypatch):
    """PAN 2's 32 x 128 heads in bf16: cuDNN where torch's cuDNN has SDPA (H100/H200), else flash; with
    PAN2_ATTENTION=flash, flash. fp32 cannot take flash: it falls through."""
    monkeypatch.delenv(ENV_ATTENTION, raising=False)
    assert attention_backend(torch.device("cuda"), torch.bfloat16, 32, 128) in ("cudnn", "flash")
    monkeypatch.setenv(ENV_ATTENTION, "flash")
    assert attention_backend(torch.device("cuda"), torch.bfloat16, 32, 128) == "flash"
    assert attention_backend(torch.device("cuda"), torch.float32, 32, 128) != "flash"
