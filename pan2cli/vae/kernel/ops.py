"""The compiled extension's ops as `torch.ops.pan2.*`, registered through `torch.library`."""

from __future__ import annotations

from types import ModuleType, SimpleNamespace

import torch

# The ops' schemas: every op writes into tensors the caller allocated and returns nothing. No argument
# has a default (torch 2.11 drops defaulted arguments before bumping the version counters of mutated
# ones, then indexes past the end). Shapes (channels-last bf16, fp32 vectors) are checked in binding.cpp.
_OP_SCHEMAS = {
    # out = SiLU?(RMS(x + bias + residual) * gamma) over C, or the plain sum without `normalize`.
    # x, residual, sum_out, out: [B, T, H, W, C] bf16, dense over (H, W, C) (frames may be strided);
    # gamma, bias: [C] fp32 (gamma already times sqrt(C)); history: [B, 2, H, W, C] bf16, receives the
    # last two frames of out. fp32 statistics; the sum is rounded to bf16 once before the norm.
    "rms_norm_silu": "rms_norm_silu(Tensor x, Tensor gamma, Tensor? bias, Tensor? residual, Tensor(a!)? sum_out, "
    "Tensor(b!) out, bool silu, Tensor(c!)? history, bool normalize) -> ()",
    # out [B, T, 2h, 2w, C] bf16 = interleaved phases [B*T, h+1, w+1, 4C] + bias [C] fp32 + DupUp3D(shortcut);
    # shortcut: the block input [B, T_in, h, w, C_in] bf16; fp32 sum, one bf16 rounding.
    "phase_interleave": "phase_interleave(Tensor phases, Tensor bias, Tensor? shortcut, Tensor(a!) out, "
    "int factor_t, int frame_offset) -> ()",
    # out [N, 2H, 2W, 3] uint8 = round((clamp(unpatchify(y + bias [12] fp32)) + 1) * 127.5), where conv_out's
    # y(f) = current[..., 24:] + previous[..., 12:24] + before[..., :12] in fp32: its time partials ([N, H, W, 36]
    # fp32, partial k = time tap k) of frames f, f - 1 and f - 2 (None: zeros, before the decode's first frame).
    "head_to_uint8": "head_to_uint8(Tensor current, Tensor? previous, Tensor? before, Tensor bias, Tensor(a!) out) -> ()",
    # out [N, D-KT+1, H-KH+1, W+2*pad_w-KW+1, K] bf16 = conv(x [N, D, H, W, C] bf16, weight [K, C, KT, KH, KW]
    # bf16 channels-last) + bias [K] fp32: fp32 accumulation in a fixed order, one bf16 rounding.
    # `config` indexes the build's tile configurations (`cutlass_conv_configs`).
    "conv_cutlass": "conv_cutlass(Tensor x, Tensor weight, Tensor bias, Tensor(a!) out, int pad_w, int config) -> ()",
}
_library: list[torch.library.Library] = []  # the `pan2` op namespace, defined once per process


def register_ops(module: ModuleType) -> SimpleNamespace:
    """Expose the extension's ops as `torch.ops.pan2.*`, with shape-only fakes for `torch.compile`.

    Registered through `torch.library.Library` (schema, CUDA kernel, fake), not `torch.library.custom_op`:
    a custom op's first call imports torch's whole compiler stack (torch._dynamo, sympy: about 3 s of a
    decode's start) to wrap its kernel, and these ops run inside every decode. The fakes are no-ops (the
    ops return nothing); `torch.compile` sees the writes through the `(a!)` annotations.
    """
    if not _library:
        library = torch.library.Library("pan2", "DEF")
        for name, schema in _OP_SCHEMAS.items():
            library.define(schema)
            # Looked up at call time: a rebuilt extension (tests) replaces the module behind the ops.
            # CPU too, so tests can stand in a module without a GPU: the real binding refuses CPU tensors.
            for key in ("CUDA", "CPU"):
                library.impl(name, _calling_the_extension(name), key)
            torch.library.register_fake(f"pan2::{name}", lambda *args, **kwargs: None, lib=library)
        _library.append(library)
    _extension.append(module)
    ops = {name: getattr(torch.ops.pan2, name) for name in _OP_SCHEMAS}
    # The conv tile configurations compiled in (none: a build without the CUTLASS headers, or a stand-in).
    configs = getattr(module, "cutlass_conv_configs", None)
    return SimpleNamespace(**ops, cutlass_conv_configs=tuple(configs()) if configs else ())


def _calling_the_extension(name: str):
    def op(*args) -> None:
        getattr(_ops(), name)(*args)

    return op


_extension: list[ModuleType] = []


def _ops() -> ModuleType:
    return _extension[-1]
