"""The fp8 tier's GEMMs and quantising kernels at PAN 2's video-stream shapes, beside bf16, on one GPU.

At `--frames` (121 → 26,598 video tokens): each block linear (q/k/v/o 4096→4096, fc1 4096→32768, fc2
32768→4096) in bf16 (`F.linear`), in fp8 (`Fp8Linear`: `torch._scaled_mm`, row-wise scales, bias in the
epilogue) and in fp8 with cuBLASLt's fast accumulation (no periodic promotion to float32); milliseconds,
TFLOP/s and the relative RMS error against a float32 product of the same bf16 inputs (first 1024 rows, TF32
off). Then the kernels that feed the fp8 GEMMs: LayerNorm + modulation + quantisation (D = 4096) and
GELU + quantisation (F = 32768), in GB/s of bytes read and written.

    python3 scripts/bench_kernels.py fp8-gemm --frames 121 --out gemm.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from pan2cli.dit import fusions  # noqa: E402
from pan2cli.dit.fp8 import Fp8Linear, quantize_rows  # noqa: E402
from scripts.kernels.conv import _time  # noqa: E402  (median ms, CUDA events, after a warm-up)

REPEATS = 10
SHAPES = {"qkvo": (4096, 4096), "fc1": (4096, 32768), "fc2": (32768, 4096)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=121)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = False
    rows = (1 + (args.frames - 1) // 4) * 858
    gen = torch.Generator(device=device).manual_seed(0)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows, "gemms": {}}
    for name, (k, n) in SHAPES.items():
        x = torch.randn(rows, k, device=device, generator=gen).bfloat16()
        linear = torch.nn.Linear(k, n, device=device, dtype=torch.bfloat16)
        with torch.no_grad():
            linear.weight.normal_(0, k**-0.5, generator=gen)
            linear.bias.normal_(0, 0.1, generator=gen)
        want = F.linear(x[:1024].float(), linear.weight.float(), linear.bias.float())
        fp8 = Fp8Linear.from_linear(linear)
        row = {}
        for variant, fn in (
            ("bf16", lambda: F.linear(x, linear.weight, linear.bias)),
            ("fp8", lambda: fp8(x)),
        ):
            row[f"{variant}_ms"] = round(_time(fn, REPEATS), 3)
            got = fn()[:1024].float()
            row[f"{variant}_err"] = round(float((got - want).norm() / want.norm()), 5)
        activation = fp8.quantize_input(x)
        data, scale = activation.data, activation.scale.reshape(-1, 1)

        def scaled(fast: bool):
            return torch._scaled_mm(
                data, fp8.weight.t(), scale_a=scale, scale_b=fp8.weight_scale.view(1, -1), bias=fp8.bias,
                out_dtype=torch.bfloat16, use_fast_accum=fast,
            )  # fmt: skip

        for variant, fast in (("fp8_gemm_only", False), ("fp8_fast_accum", True)):
            row[f"{variant}_ms"] = round(_time(lambda: scaled(fast), REPEATS), 3)
            row[f"{variant}_err"] = round(float((scaled(fast)[:1024].float() - want).norm() / want.norm()), 5)
        for key in [k for k in row if k.endswith("_ms")]:
            row[key[:-3] + "_tflops"] = round(2 * rows * k * n / row[key] / 1e9)
        results["gemms"][name] = row
        print(name, json.dumps(row), flush=True)
    x = torch.randn(1, rows, 4096, device=device, generator=gen).bfloat16()
    mod = torch.randn(1, 1, 4096, device=device, generator=gen) * 0.1
    ms = _time(lambda: fusions.layer_norm_modulate(x, mod, mod, eps=1e-6, fused=True, quantize=True), REPEATS)
    results["layer_norm_modulate_fp8_gbps"] = round(rows * 4096 * 3 / ms / 1e6)
    ms_bf16 = _time(lambda: fusions.layer_norm_modulate(x, mod, mod, eps=1e-6, fused=True), REPEATS)
    results["layer_norm_modulate_bf16_gbps"] = round(rows * 4096 * 4 / ms_bf16 / 1e6)
    h = torch.randn(rows, 32768, device=device, generator=gen).bfloat16()
    ms = _time(lambda: quantize_rows(h, fused=True, gelu=True), REPEATS)
    results["gelu_quantize_ms"] = round(ms, 3)
    results["gelu_quantize_gbps"] = round(rows * 32768 * 3 / ms / 1e6)
    ms = _time(lambda: F.gelu(h, approximate="tanh"), REPEATS)
    results["gelu_bf16_eager_ms"] = round(ms, 3)
    print(json.dumps({k: v for k, v in results.items() if k != "gemms"}), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
