"""cuDNN's fp8 attention through cudnn-frontend's Python package (optional: `pip install nvidia-cudnn-frontend`).

The third fp8 attention beside pan2's CUDA and Triton kernels, run only when asked for (`--fp8-attention cudnn`,
`pan2cli.dit.fp8_attention_choice`) and timed beside them by `scripts/bench_kernels.py fp8-attention`. cuDNN's fp8 SDPA takes one descale per
tensor for Q, K and V (the V of `values_fp8(..., per_tensor=True)`) and scales P by 448 before its e4m3
cast. On Hopper it writes the output in e4m3 too (cuDNN 9.19 makes a bf16 output on Blackwell only): each
output row is a convex combination of V's rows, so |O| ≤ max|V| and O takes V's descale with no measured
amax and no overflow; `to_out` consumes it as it is. One graph is built per shape and device and kept.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from pan2cli.errors import KernelBuildError


def cudnn_frontend():
    """The `cudnn` module of cudnn-frontend, or a `KernelBuildError` saying how to get it."""
    try:
        import cudnn
    except ImportError as error:
        raise KernelBuildError(
            f"cuDNN's fp8 attention needs cudnn-frontend's Python package ({error})",
            hint="pip install nvidia-cudnn-frontend, or leave --fp8-attention at auto (pan2's own kernels)",
        ) from None
    return cudnn


_UIDS = dict(
    q=1, k=2, v=3, o=4, descale_q=5, descale_k=6, descale_v=7, descale_s=8, scale_s=9, scale_o=10, amax_o=11
)


@lru_cache(maxsize=8)
def _graph(batch: int, heads: int, tokens: int, head_dim: int, device_index: int):
    cudnn = cudnn_frontend()
    handle = cudnn.create_handle()
    graph = cudnn.pygraph(
        io_data_type=cudnn.data_type.FP8_E4M3,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=handle,
    )
    dims = (batch, heads, tokens, head_dim)
    strides = (tokens * heads * head_dim, head_dim, heads * head_dim, 1)  # [B, S, H, D] memory
    q, k, v = (
        graph.tensor(uid=_UIDS[n], dim=dims, stride=strides, data_type=cudnn.data_type.FP8_E4M3)
        for n in "qkv"
    )
    scalars = {
        name: graph.tensor(
            uid=_UIDS[name], dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.FLOAT
        )
        for name in ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    }
    o, _stats, _amax_s, amax_o = graph.sdpa_fp8(
        q=q,
        k=k,
        v=v,
        **scalars,
        generate_stats=False,
        attn_scale=1 / math.sqrt(head_dim),
        use_causal_mask=False,
    )
    o.set_uid(_UIDS["o"]).set_output(True).set_dim(dims).set_stride(strides)
    o.set_data_type(cudnn.data_type.FP8_E4M3)
    amax_o.set_uid(_UIDS["amax_o"]).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1))
    amax_o.set_data_type(cudnn.data_type.FLOAT)
    graph.validate()
    graph.build_operation_graph()
    # Heuristic A's first plan was the fastest of the three that build on an H200 (13.4 ms against 16.3 and
    # 16.6 at 121 frames, timing every plan once), so no autotuning.
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    device = torch.device("cuda", device_index)
    constants = {
        "descale_k": torch.ones(1, dtype=torch.float32, device=device),
        "descale_s": torch.full((1,), 1 / 448.0, dtype=torch.float32, device=device),
        "scale_s": torch.full((1,), 448.0, dtype=torch.float32, device=device),
        "amax_o": torch.empty(1, dtype=torch.float32, device=device),
    }
    workspace = torch.empty(graph.get_workspace_size(), dtype=torch.uint8, device=device)
    return cudnn, handle, graph, workspace, constants


def cudnn_fp8_attention(
    q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, qk_descale: torch.Tensor, v_descale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(Q·Kᵀ/√D)·V on `[B, S, H, D]` e4m3 inputs (cuDNN, per-tensor descales) → (O, O's descale).

    Args:
        q8, k8, v8: `[B, S, H, D]` float8_e4m3fn contiguous.
        qk_descale: `[1]` float32, Q's descale times K's.
        v_descale: `[H]` float32, all equal (one scale for the tensor); element 0 is used.

    Returns:
        O `[B, S, H, D]` float8_e4m3fn and its descale `[1]` float32 (V's: real O = O · descale).
    """
    batch, tokens, heads, head_dim = q8.shape
    cudnn, handle, graph, workspace, constants = _graph(batch, heads, tokens, head_dim, q8.device.index or 0)
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q8.device).cuda_stream)
    out = torch.empty(q8.shape, dtype=torch.float8_e4m3fn, device=q8.device)
    descale = v_descale[:1]
    pack = {
        _UIDS["q"]: q8, _UIDS["k"]: k8, _UIDS["v"]: v8, _UIDS["o"]: out,
        _UIDS["descale_q"]: qk_descale, _UIDS["descale_v"]: descale, _UIDS["scale_o"]: 1.0 / descale,
        **{_UIDS[name]: tensor for name, tensor in constants.items()},
    }  # fmt: skip
    graph.execute(pack, workspace, handle=handle)
    return out, descale
