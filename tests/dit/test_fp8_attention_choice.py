"""Which fp8 attention runs (`pan2cli.dit.fp8_attention_choice`): "auto" and each request resolved once, the
fallback said, and the record of what the calls ran (the sidecar's `ran.fp8_attention`)."""

from __future__ import annotations

import pytest
import torch

from pan2cli.dit import cuda_fp8_attention as cuda
from pan2cli.dit.cuda_fp8_attention import Instantiation
from pan2cli.dit.fp8_attention_choice import (
    Fp8AttentionRun,
    fp8_attention_ran,
    reset_fp8_attention_record,
    resolve_fp8_attention,
    use_fp8_attention,
)
from pan2cli.errors import InputError, KernelBuildError

GPU = torch.device("cuda")


@pytest.fixture
def an_sm90_gpu(monkeypatch):
    """`cuda_fp8_attention` sees an sm_90 GPU (head dim 128) and builds its extension; `builds` counts the builds."""
    builds = []
    monkeypatch.setattr(
        cuda, "why_not_runnable", lambda device, head_dim: None if head_dim == 128 else "head dim"
    )
    monkeypatch.setattr(cuda, "extension_ops", lambda device: builds.append(device))
    return builds


def test_auto_is_the_cuda_kernel_where_it_runs_and_builds(an_sm90_gpu):
    choice = resolve_fp8_attention("auto", GPU, 128)
    assert choice.kernel == "cuda" and not choice.fallback and an_sm90_gpu == [GPU]  # built now, not per call
    assert resolve_fp8_attention("auto", GPU, 128, build=False).kernel == "cuda" and len(an_sm90_gpu) == 1


def test_auto_is_the_triton_kernel_elsewhere_and_says_why(an_sm90_gpu, monkeypatch):
    choice = resolve_fp8_attention("auto", GPU, 64)
    assert (
        choice.kernel == "triton" and "does not run here: head dim" in choice.reason and not choice.fallback
    )
    monkeypatch.setattr(cuda, "why_not_runnable", lambda device, head_dim: "it runs on sm_90 GPUs")
    assert resolve_fp8_attention("auto", GPU, 128).kernel == "triton"
    assert not an_sm90_gpu  # nothing built where it cannot run


def test_auto_falls_back_to_triton_when_the_cuda_kernel_fails_to_build(an_sm90_gpu, monkeypatch):
    def failing(device):
        raise KernelBuildError("building pan2's CUDA fp8 attention failed: fp8_attention.cu(12): error: boom")

    monkeypatch.setattr(cuda, "extension_ops", failing)
    choice = resolve_fp8_attention("auto", GPU, 128)
    assert choice.kernel == "triton" and choice.fallback and "error: boom" in choice.reason
    with pytest.raises(KernelBuildError, match="boom"):  # asked for by name: the failure is the answer
        resolve_fp8_attention("cuda", GPU, 128)


def test_a_kernel_asked_for_runs_or_is_refused(an_sm90_gpu, monkeypatch):
    assert resolve_fp8_attention("cuda", GPU, 128).kernel == "cuda"
    assert resolve_fp8_attention("triton", GPU, 128).kernel == "triton"
    with pytest.raises(InputError, match="--fp8-attention cuda: .*cannot run here: head dim"):
        resolve_fp8_attention("cuda", GPU, 64)
    with pytest.raises(InputError, match="'flash' is not an fp8 attention"):
        resolve_fp8_attention("flash", GPU, 128)
    import pan2cli.dit.cudnn_fp8_attention as cudnn

    monkeypatch.setattr(cudnn, "cudnn_frontend", lambda: None)
    assert resolve_fp8_attention("cudnn", GPU, 128).kernel == "cudnn"


def test_the_record_says_what_the_calls_ran_not_what_was_asked():
    from tests.dit.small_models import random_small_pan2

    model = random_small_pan2()
    assert fp8_attention_ran(model) is None  # no fp8 attention set, none ran
    choice = resolve_fp8_attention("triton", GPU, 64)
    use_fp8_attention(model, choice)
    runs = {id(block.attn.fp8_attention) for block in model.transformer_blocks}
    assert len(runs) == 1 and isinstance(model.transformer_blocks[0].attn.fp8_attention, Fp8AttentionRun)
    assert fp8_attention_ran(model) is None  # chosen, but nothing ran yet (a sequence-parallel split)
    run = model.transformer_blocks[0].attn.fp8_attention
    for _ in range(4):
        run.ran("triton")
    assert fp8_attention_ran(model) == {
        "kernel": "triton",
        "why": "asked for (--fp8-attention triton)",
        "calls": 4,
        "instantiations": [],
    }
    reset_fp8_attention_record(model)
    use_fp8_attention(model, resolve_fp8_attention("triton", GPU, 64))
    run = model.transformer_blocks[1].attn.fp8_attention
    short, long = Instantiation(3, True, "tma"), Instantiation(4, False, "tma")
    run.choice = type(run.choice)("cuda", "the default on sm_90 GPUs with head dim 128")
    run.ran("cuda", short)
    run.ran("cuda", short)
    run.ran("cuda", long)
    assert fp8_attention_ran(model) == {
        "kernel": "cuda",
        "why": "the default on sm_90 GPUs with head dim 128",
        "calls": 3,
        "instantiations": [
            {"stages": 3, "ping_pong": True, "producer": "tma", "key_tile": 128, "calls": 2},
            {"stages": 4, "ping_pong": False, "producer": "tma", "key_tile": 128, "calls": 1},
        ],
    }
