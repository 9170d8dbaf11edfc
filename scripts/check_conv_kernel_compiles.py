"""Compile the fixed-order Triton conv for each layer class of the decoder for sm_90 and sm_100 without a GPU.

Usage: python scripts/check_conv_kernel_compiles.py

Triton compiles ahead of time for a target it is told (its bundled ptxas), so this checks on a machine
without a GPU that every configuration the decoder launches builds for Hopper (wgmma) and Blackwell
(tcgen05). Nothing is run. Run it in a process of its own (Triton's CPU interpreter, once used,
leaves patched functions behind that break compiling); tests/vae/kernel/test_conv_kernel.py does so for three.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "0"  # real kernels, whatever the caller's environment says

from pan2cli.vae.kernel import conv

SIGNATURE = {  # sizes and strides (in pixels) are plain i32 arguments: never specialised on
    "x_ptr": "*bf16",
    "w_ptr": "*bf16",
    "bias_ptr": "*fp32",
    "out_ptr": "*bf16",
    "M": "i32",
    "T_OUT": "i32",
    "H_OUT": "i32",
    "W_OUT": "i32",
    "W_IN": "i32",
    "sx_b": "i32",
    "sx_t": "i32",
    "sx_h": "i32",
}
LAYERS = {  # name: (C_in, (KT, KH, KW), pad_w, bias, C_out), what WanKernelDecoder launches
    "conv_in": (48, (3, 3, 3), 1, False, 1024),
    "conv_in, first chunk": (48, (1, 3, 3), 1, False, 1024),
    "post_quant_conv": (48, (1, 1, 1), 0, True, 48),
    "3x3x3 1024": (1024, (3, 3, 3), 1, False, 1024),
    "3x3x3 1024, first chunk": (1024, (1, 3, 3), 1, False, 1024),
    "time conv": (1024, (3, 1, 1), 0, True, 2048),
    "phase conv 2x2": (1024, (1, 2, 2), 1, False, 4096),
    "conv_out time partials": (256, (1, 3, 3), 1, False, 36),
}
FP32_OUT = {"conv_out time partials"}  # layers whose output is the fp32 sums themselves


def compile_layer(name: str, arch: int):
    """The compiled kernel (`triton.compiler.CompiledKernel`) of layer `name` for sm_`arch`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    c_in, (kt, kh, kw), pad_w, bias, c_out = LAYERS[name]
    tiles = conv._tiles(c_out)
    out_fp32 = name in FP32_OUT
    constexprs = conv._meta((c_out, kt, kh, kw, c_in), pad_w, True if bias else None, tiles, out_fp32)
    options = {"num_warps": constexprs.pop("num_warps"), "num_stages": constexprs.pop("num_stages")}
    signature = {
        **SIGNATURE,
        "out_ptr": "*fp32" if out_fp32 else "*bf16",
        **dict.fromkeys(constexprs, "constexpr"),
    }
    source = ASTSource(fn=conv._kernel(), signature=signature, constexprs=constexprs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def tensor_core_instruction(compiled) -> str:
    ptx = compiled.asm["ptx"]
    return next((op for op in ("wgmma", "tcgen05", "mma.sync") if op in ptx), "none")


def main() -> None:
    for arch in (90, 100):
        for name in LAYERS:
            compiled = compile_layer(name, arch)
            print(f"sm_{arch} {name}: compiled ({tensor_core_instruction(compiled)})")


if __name__ == "__main__":
    main()
