"""Implicit-GEMM convolutions whose every output has one fixed reduction order: CUTLASS, and Triton.

Two engines, chosen per layer (`cutlass_applies`, then the decoder's resolution rule), never by the problem's size:

* `cutlass`: the compiled extension's warp-specialised conv (kernels/wan22_vae_decode/conv_cutlass.cuh:
  TMA im2col loads, wgmma, one tile configuration per layer, no split-K) for every layer whose input and
  output channels are multiples of 64, on GPUs it is built for (sm_90a; sm_100a compiles);
* `triton`: the kernel below, for the 48-channel inputs (conv_in, post_quant_conv) and where the
  extension has no CUTLASS conv. Its order:

cuDNN picks its algorithm per problem shape, and on the decoder's low-resolution 1024-channel layers it
picks others for a band of rows (a rank's share under a row split) or for another number of frames (a
chunk size) than for the whole problem: the fp32 sums are then added in another order, about 0.1 % of
the bf16 outputs round the other way, and random-weight decoders amplify that to several uint8 levels
(docs/KERNEL_NOTES.md lists these layers). This kernel computes output (pixel, channel) as

    acc = Σ_{tap in (kt, kh, kw) order} Σ_{c in blocks of BLOCK_K} x[pixel + tap, c] · w[channel, tap, c]

(BLOCK_K = 64, or 16 for the 48 latent channels)

in fp32 (tensor-core MMA, `tl.dot`), adds the optional fp32 bias and rounds once to bf16. The order
depends on nothing but the layer (one tile configuration per layer, never chosen by problem size, no
split-K), so a pixel's value is the same whatever the height, frame count or position of the problem
it is computed in: one GPU, N GPUs and every chunk size agree bit for bit on these layers.

Layout: channels-last bf16. Input `(B, T_in, H_in, W_in, C_in)` with halo rows already in H_in (no
height padding) and zero padding `pad_w` on the width only; weight as cuDNN holds it channels-last,
`(C_out, C_in, KT, KH, KW)` stored as `(C_out, KT, KH, KW, C_in)`, i.e. row n of a `(C_out, K)` matrix
with k = ((kt·KH + kh)·KW + kw)·C_in + c. Output `(B, T_in − KT + 1, H_in − KH + 1, W_in + 2·pad_w − KW + 1,
C_out)`.
"""

from __future__ import annotations

import re

import torch

from pan2cli.triton_support import triton_interpreting


def cutlass_applies(c_in: int, c_out: int, cutlass_configs: tuple[str, ...]) -> bool:
    """Whether a layer runs in the CUTLASS engine: the build has it, and whole 64-channel reduction steps
    and 16-byte output rows. By channel counts only, which a row split, a chunk size or a video size never
    change: every rank and every chunk run a layer in the same engine and tile, hence the same bits."""
    return bool(cutlass_configs) and c_in % 64 == 0 and c_out % 64 == 0


# The default tile configurations, in order of preference: 256x128 tiles in clusters of two CTAs that share
# the activation tile by TMA multicast (cuDNN's choice on these layers; measured on an H200 the fastest of
# ours over a decode, docs/KERNEL_NOTES.md), then without clusters, then CUTLASS's own kernel (sm_100a).
_PREFERRED = ("256x128p-1x2", "256x128p", "128x256p")


def _cluster_fits(name: str, c_out: int | None) -> bool:
    """A cluster of 1 x N tiles needs whole clusters of output-channel tiles (the kernel refuses the rest)."""
    match = re.fullmatch(r"\d+x(\d+)p?(?:-1x(\d+))?", name)
    if c_out is None or match is None or match.group(2) is None:
        return True
    tile_n, clusters_n = int(match.group(1)), int(match.group(2))
    return -(-c_out // tile_n) % clusters_n == 0


def cutlass_config(configs: tuple[str, ...], override: str | None = None, c_out: int | None = None) -> int:
    """Index (into the build's `cutlass_conv_configs`) of the tile configuration a layer with `c_out` output
    channels runs with: decided by the layer, never by the problem's size (module docstring); every
    configuration sums in the same order anyway (64-channel steps, no split-K: a GPU test compares their
    bits). `override` names one (benchmarks)."""
    if override:
        return configs.index(override)
    for name in _PREFERRED:
        if name in configs and _cluster_fits(name, c_out):
            return configs.index(name)
    return 0


def conv_cutlass(
    ops,
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    pad_w: int = 0,
    config: str | None = None,
) -> torch.Tensor:
    """`conv_channels_last`'s function in the CUTLASS engine (same arguments; `ops` the loaded extension).

    Summation order: over K = (channel, kw, kh, kt) in the collective's order, 64 channels a step, one
    tile per layer: a function of the layer alone (bit-identical for any N, D, H, W). The bias is added
    in fp32 to the fp32 sum, then one bf16 rounding (as the Triton engine does).
    """
    two_d = x.dim() == 4
    if two_d:
        x, weight = x.unsqueeze(1), weight.unsqueeze(2)
    out = _output(x, weight, pad_w)
    if bias is None:
        bias = _zeros(weight.shape[0], x.device)
    ops.conv_cutlass(
        x, weight, bias, out, pad_w, cutlass_config(ops.cutlass_conv_configs, config, weight.shape[0])
    )
    return out.squeeze(1) if two_d else out


def _output(
    x: torch.Tensor, weight: torch.Tensor, pad_w: int, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """The uninitialised `(B, T_out, H_out, W_out, C_out)` output of a 3-D conv of `x` by `weight`."""
    b, t_in, h_in, w_in, _ = x.shape
    c_out, _, kt, kh, kw = weight.shape
    shape = (b, t_in - kt + 1, h_in - kh + 1, w_in + 2 * pad_w - kw + 1, c_out)
    return torch.empty(shape, dtype=dtype, device=x.device)


_zero_bias: dict[tuple[int, torch.device], torch.Tensor] = {}


def _zeros(c_out: int, device: torch.device) -> torch.Tensor:
    """A layer without bias adds fp32 zeros: acc + 0 is acc, so the output is the plain rounded sum."""
    key = (c_out, device)
    if key not in _zero_bias:
        _zero_bias[key] = torch.zeros(c_out, dtype=torch.float32, device=device)
    return _zero_bias[key]


def block_k(c_in: int) -> int:
    """The reduction step of a layer with `c_in` input channels: 64, or 16 for thin inputs (48 latent
    channels). Fixed per layer; it never depends on the problem's size."""
    return 64 if c_in % 64 == 0 else 16


def _kernel():
    # The @triton.jit code is in conv_triton.py, imported at the first launch: defining it needs `import
    # triton`, and every decode imports this module (through layers.py), also on the CPU or where Triton
    # is not installed.
    from pan2cli.vae.kernel.conv_triton import (
        implicit_gemm_conv,  # Triton only where it runs
    )

    return implicit_gemm_conv


def applies(c_in: int) -> bool:
    """Whether a layer with `c_in` input channels can run here (whole reduction steps per tap)."""
    return c_in % 16 == 0


def _tiles(c_out: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of a layer: chosen by its width only, never by M. Measured
    on an H200 (scripts/bench_kernels.py conv): 128x256 with 8 warps and 3 stages is the fastest or within
    run-to-run noise of it on every 1024-channel layer; 4 stages and BLOCK_K 128 were slower. The thinnest
    layer (conv_out's 36 time partials) takes 64-channel tiles."""
    if c_out >= 256:
        return 128, 256, 8, 3
    if c_out <= 64:
        return CONV_OUT_TILES
    return 128, 128, 4, 4


# (BLOCK_M, BLOCK_N, num_warps, num_stages) of conv_out's time partials (36 output channels).
CONV_OUT_TILES = (128, 64, 4, 4)


def conv_channels_last(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    pad_w: int = 0,
    tiles: tuple[int, ...] | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """Convolve channels-last bf16 frames with a fixed summation order (module docstring).

    Args:
        x: `(B, T_in, H_in, W_in, C_in)` bf16, dense over (H, W, C) with batch stride T·frame stride, or
            `(N, H_in, W_in, C_in)` for a 2-D conv (frames as batch).
        weight: `(C_out, C_in, KT, KH, KW)` (or `(C_out, C_in, KH, KW)`) bf16 whose memory is channels-last.
        bias: optional `(C_out,)`, added in fp32 before the bf16 rounding.
        pad_w: zero columns on each side of the width.
        tiles: (BLOCK_M, BLOCK_N, num_warps, num_stages[, BLOCK_K]) instead of the layer's own (benchmarks
            only; the summation order does not depend on them, measured bit for bit on an H200 for BLOCK_K
            128 against 64 too; scripts/bench_kernels.py conv).
        out_dtype: bf16 (one rounding), or float32: the fp32 sums themselves (conv_out's time partials).

    Returns:
        `(B, T_out, H_out, W_out, C_out)` (or `(N, H_out, W_out, C_out)`) in `out_dtype`, contiguous.
    """
    two_d = x.dim() == 4
    if two_d:
        x, weight = x.unsqueeze(1), weight.unsqueeze(2)
    b, t_in, h_in, w_in, c_in = x.shape
    c_out, _, kt, kh, kw = weight.shape
    assert x.dtype == weight.dtype == torch.bfloat16 and applies(c_in), (x.dtype, weight.dtype, c_in)
    assert x.stride(4) == 1 and x.stride(3) == c_in and x.stride(2) == w_in * c_in, x.stride()
    assert b == 1 or x.stride(0) == t_in * x.stride(1), x.stride()
    assert x.stride(0) % c_in == 0 and x.stride(1) % c_in == 0, x.stride()
    w = weight.permute(0, 2, 3, 4, 1)
    assert w.is_contiguous(), "weight must be channels-last"
    assert out_dtype in (torch.bfloat16, torch.float32), out_dtype
    out = _output(x, weight, pad_w, out_dtype)
    _, t_out, h_out, w_out, _ = out.shape
    m = b * t_out * h_out * w_out
    tiles = tiles or _tiles(c_out)
    if m:
        grid = (triton_cdiv(m, tiles[0]) * triton_cdiv(c_out, tiles[1]),)
        _kernel()[grid](
            x,
            w,
            bias.float().contiguous() if bias is not None else x,
            out,
            m,
            t_out,
            h_out,
            w_out,
            w_in,
            x.stride(0) // c_in,  # in pixels: strides are whole multiples of C_IN (asserted above)
            x.stride(1) // c_in,
            x.stride(2) // c_in,
            **_meta(
                weight_shape=w.shape, pad_w=pad_w, bias=bias, tiles=tiles, out_fp32=out_dtype == torch.float32
            ),
        )
    return out.squeeze(1) if two_d else out


def _meta(weight_shape, pad_w: int, bias, tiles, out_fp32: bool = False) -> dict:
    """The kernel's compile-time arguments: layer shape, tiles, launch shape."""
    c_out, kt, kh, kw, c_in = weight_shape
    block_m, block_n, warps, stages = tiles[:4]
    return {
        "C_OUT": c_out,
        "C_IN": c_in,
        "KT": kt,
        "KH": kh,
        "KW": kw,
        "PAD_W": pad_w,
        "HAS_BIAS": bias is not None,
        "OUT_FP32": out_fp32,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": tiles[4] if len(tiles) > 4 else block_k(c_in),
        "GROUP_M": 8,
        "INTERPRET": triton_interpreting(),
        "num_warps": warps,
        "num_stages": stages,
    }


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)
