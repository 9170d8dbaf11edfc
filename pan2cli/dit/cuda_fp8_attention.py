"""pan2's CUDA fp8 attention for Hopper (`kernels/experimental/fp8_attention.cu`): a prototype, opt-in.

The third candidate for the fp8 tier's joint attention, beside cuDNN's (`cudnn_fp8_attention.py`) and our
Triton kernel (`fp8_attention_kernel.py`), with the Triton kernel's inputs (Q, K `[B, S, H, 128]`, V
transposed `[B, H, 128, S_pad]`, per-head V descale) and output (bf16), written as FlashAttention-3 is:
warp-specialised (a producer warpgroup copies K/V tiles, two consumer warpgroups take turns at the wgmma
MMAs so that one's softmax overlaps the other's MMAs), P handed from the S accumulators to the P·V MMA in
registers, each tile's P·V summed in float32 (the kernel's header says how). Two producers: cp.async by the
whole producer warpgroup (V in key order, K's rows permuted as they are copied), or TMA by one thread (V's
keys permuted instead, by `values_fp8(..., key_order="wgmma")`: `v_key_order(tma)` says which V to make).

Status: compiled for sm_90a and its fragment index math checked against CuTe's layouts on the CPU
(tests/dit/test_fp8_attention_cuda.py); NOT yet run on a GPU, so never chosen by default. It is built into
the decode extension's experimental build and runs with

    PAN2_KERNEL_EXPERIMENTAL=1 PAN2_FP8_ATTENTION=cuda pan2 generate ... --precision fp8

`scripts/bench_kernels.py fp8-attention` times it beside cuDNN's and the Triton kernel when the
experimental build is on.
"""

from __future__ import annotations

import math

import torch

from pan2cli.errors import KernelBuildError

HEAD_DIM = 128
STAGES = (3, 4, 5)  # K/V stages in shared memory the kernel is instantiated for (32 KiB each)
DEFAULT_STAGES, DEFAULT_PING_PONG, DEFAULT_TMA = 4, True, False


def v_key_order(tma: bool) -> str:
    """The `key_order` of `values_fp8` that the kernel's producer needs for its V."""
    return "wgmma" if tma else "natural"


def prototype_ops(device: torch.device):
    """The experimental build's ops for `device` (building it on first use), or a `KernelBuildError`."""
    from pan2cli.vae.kernel.build import experimental_flags, load_kernel

    if not experimental_flags():
        raise KernelBuildError(
            "pan2's CUDA fp8 attention is a prototype in the experimental kernel build",
            hint="set PAN2_KERNEL_EXPERIMENTAL=1 as well, or leave PAN2_FP8_ATTENTION unset",
        )
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        raise KernelBuildError("pan2's CUDA fp8 attention runs on sm_90 GPUs (H100, H200) only")
    ops = load_kernel(device)
    if not hasattr(ops, "fp8_attention"):
        raise KernelBuildError("the experimental kernel build has no fp8_attention (an older cached build?)")
    return ops


def cuda_fp8_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v_t: torch.Tensor,
    qk_descale: torch.Tensor,
    v_descale: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    stages: int = DEFAULT_STAGES,
    ping_pong: bool = DEFAULT_PING_PONG,
    tma: bool = DEFAULT_TMA,
) -> torch.Tensor:
    """softmax(Q·Kᵀ/√128)·V from e4m3 inputs and their descales, no mask → `out` (bf16 `[B, S, H, 128]`).

    Args: as `fp8_attention_kernel.fp8_attention` (head dim 128 only; with `tma`, v_t's keys in the wgmma
    order, `v_key_order(True)`), plus `stages` (K/V tiles in shared memory, 3-5), `ping_pong` (the consumer
    warpgroups take turns at the MMAs) and `tma` (the producer's copies).
    """
    from pan2cli.dit.fp8 import P_SHIFT

    assert q.shape[-1] == HEAD_DIM, f"head dim must be {HEAD_DIM}, got {q.shape[-1]}"
    assert stages in STAGES, f"stages must be one of {STAGES}"
    if out is None:
        out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    prototype_ops(q.device).fp8_attention(
        q, k, v_t, qk_descale, v_descale, out, math.log2(math.e) / math.sqrt(HEAD_DIM), float(P_SHIFT),
        stages, ping_pong, tma,
    )  # fmt: skip
    return out
