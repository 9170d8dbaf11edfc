"""The joint attention of PAN 2 in fp8 beside cuDNN's bf16 SDPA, at the DiT's shapes, in one run on one GPU.

Per video length (704x1248: 121 frames = 26,598 video tokens, 241 = 52,338, 481 = 103,818; plus `--text`
text tokens), B = 1, 32 heads of 128: cuDNN bf16 SDPA (what the bf16 tier runs), our Triton fp8 kernel in
each launch configuration (`--configs`), and cuDNN's fp8 SDPA through cudnn-frontend when it is installed.
Median milliseconds over `--repeats` after a warm-up (CUDA events), TFLOP/s (4·S²·D·H per call), and the
error of each against float32 attention on the same inputs (relative RMS over the first `--check-rows`
query rows of every head; TF32 off). Inputs are unit-RMS Q/K rows (as after PAN 2's RMSNorm) and N(0, 1)
values; fp8 inputs are quantised as the tier quantises them (Q/K by the RMSNorm bound, V per head).

    python3 scripts/bench_kernels.py fp8-attention --frames 121 241 481 --out attention.json

`--compare-kernel FILE` times another version of `pan2cli/dit/fp8_attention_kernel.py` beside the tree's, on the
same inputs (`git show REV:pan2cli/dit/fp8_attention_kernel.py > /tmp/old_kernel.py`), as "compared_*".

On an sm_90 GPU, pan2's CUDA fp8 attention (`pan2cli/dit/cuda_fp8_attention.py`, the tier's default there)
runs too, in each of its instantiations (`--cuda-configs`: K/V stages x ping-pong on/off x cp.async or TMA
copies), as "cuda_fp8_s<stages>_<pingpong|free>_<cp.async|tma>", and each length's row names the one its table
picks for this GPU ("cuda_fp8_table_pick"); V is quantised for it in both key orders ("values_fp8_ms",
"values_fp8_wgmma_ms": the TMA producer's order should cost the same). Elsewhere the results say why not.
The last lines are a markdown table per length: every kernel's milliseconds and error, the pick marked.

    python3 scripts/bench_kernels.py fp8-attention --frames 121 481 --configs default
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root

from pan2cli.dit.cuda_fp8_attention import Instantiation, choose_instantiation, cuda_fp8_attention  # noqa: E402
from pan2cli.dit.fp8 import E4M3_MAX, FP8  # noqa: E402
from pan2cli.dit.fp8_attention_kernel import CONFIGS, fp8_attention, padded_keys  # noqa: E402
from pan2cli.dit.fp8_values_kernel import values_fp8  # noqa: E402
from scripts.kernels.conv import _time  # noqa: E402  (median ms, CUDA events, after a warm-up)

HEADS, HEAD_DIM = 32, 128
VIDEO_TOKENS = {121: 26598, 241: 52338, 481: 103818}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, nargs="+", default=[121, 241, 481])
    parser.add_argument("--text", type=int, default=300, help="text tokens (default 300)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--check-rows", type=int, default=512, help="query rows checked against float32")
    parser.add_argument(
        "--configs", default="all", help="Triton configs: 'all', 'default', or BM,BN,warps,stages;... "
    )
    parser.add_argument("--skip-cudnn-fp8", action="store_true")
    parser.add_argument(
        "--cuda-configs", default="all",
        help="the CUDA kernel's instantiations: 'all', 'table' (the table's pick), 'none', or "
        "stages,pingpong(0|1),producer(cp.async|tma);...",
    )  # fmt: skip
    parser.add_argument(
        "--compare-kernel",
        type=Path,
        help="another version of fp8_attention_kernel.py to time beside the tree's",
    )
    parser.add_argument("--out", type=Path)
    return parser.parse_args()


def reference_rows(q, k, v, rows: int) -> torch.Tensor:
    """float32 attention (TF32 off) for the first `rows` queries: `[1, rows, H, D]`."""
    torch.backends.cuda.matmul.allow_tf32 = False
    out = []
    for h in range(q.shape[2]):
        s = q[0, :rows, h].float() @ k[0, :, h].float().t() / math.sqrt(q.shape[-1])
        out.append(torch.softmax(s, dim=-1) @ v[0, :, h].float())
    return torch.stack(out, dim=1)[None]


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).norm() / want.norm())


def cuda_candidates(spec: str, device: torch.device) -> tuple[list[Instantiation] | None, str]:
    """The CUDA kernel's instantiations to time (None: the table's pick of each length), and a word on its
    availability."""
    from pan2cli.dit import cuda_fp8_attention as cuda

    if spec == "none":
        return [], "not asked for"
    try:
        cuda.extension_ops(device)
    except Exception as error:  # not here (another GPU, a failed build): said in the results
        return [], f"unavailable: {error}"
    if spec == "all":
        return list(cuda.INSTANTIATIONS), "built"
    if spec == "table":
        return None, "built"
    configs = [c.split(",") for c in spec.split(";")]
    return [Instantiation(int(s), bool(int(p)), t) for s, p, t in configs], "built"


def load_kernel_file(path: Path):
    """A version of `fp8_attention_kernel.py` from a file, as its own module (Triton compiles it apart)."""
    spec = importlib.util.spec_from_file_location("compared_fp8_attention_kernel", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def print_table(row: dict) -> None:
    """One length's kernels as a markdown table: milliseconds, TFLOP/s, error against float32; the CUDA
    kernel's instantiation that the table picks is marked."""
    pick = (
        "cuda_fp8_" + row["cuda_fp8_table_pick"].replace("-", "_") if "cuda_fp8_table_pick" in row else None
    )
    print(f"\n{row['frames']} frames ({row['tokens']} tokens)\n")
    print("| kernel | ms | TFLOP/s | error vs float32 |")
    print("| --- | ---: | ---: | ---: |")
    for key in row:
        if key.endswith("_ms") and not key.startswith("values_fp8"):
            name = key[:-3]
            mark = " (the table's pick)" if name == pick else ""
            print(
                f"| {name}{mark} | {row[key]} | {row.get(name + '_tflops', '')} | {row.get(name + '_err', '')} |"
            )
    print(
        f"\nV quantised: {row['values_fp8_ms']} ms in key order, {row['values_fp8_wgmma_ms']} ms in the wgmma order"
    )


def main() -> None:
    args = parse_args()
    compared = load_kernel_file(args.compare_kernel) if args.compare_kernel else None
    device = torch.device("cuda")
    configs = (
        CONFIGS if args.configs == "all" else
        [CONFIGS[0]] if args.configs == "default" else
        [tuple(int(v) for v in c.split(",")) for c in args.configs.split(";")]
    )  # fmt: skip
    try:
        from pan2cli.dit.cudnn_fp8_attention import cudnn_fp8_attention, cudnn_frontend

        cudnn = None if args.skip_cudnn_fp8 else cudnn_frontend()
        cudnn_version = cudnn.backend_version_string() if cudnn else None
    except Exception as error:  # reported, not fatal: the Triton kernel is measured anyway
        cudnn, cudnn_version = None, f"unavailable: {error}"
    results = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cudnn_frontend": cudnn_version,
    }
    cuda_configs, results["cuda_fp8"] = cuda_candidates(args.cuda_configs, device)
    results["runs"] = []
    print(json.dumps(results), flush=True)
    for frames in args.frames:
        n = VIDEO_TOKENS.get(frames) or (1 + (frames - 1) // 4) * 858
        s = n + args.text
        flops = 4 * s * s * HEAD_DIM * HEADS
        gen = torch.Generator(device=device).manual_seed(frames)
        q = F.rms_norm(torch.randn(1, s, HEADS, HEAD_DIM, device=device, generator=gen), (HEAD_DIM,))
        k = F.rms_norm(torch.randn(1, s, HEADS, HEAD_DIM, device=device, generator=gen), (HEAD_DIM,))
        v = torch.randn(1, s, HEADS, HEAD_DIM, device=device, generator=gen)
        q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
        want = reference_rows(q, k, v, args.check_rows)
        row = {"frames": frames, "tokens": s}

        def bf16():
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))

        row["cudnn_bf16_ms"] = _time(bf16, args.repeats)
        row["cudnn_bf16_err"] = rel_rms(bf16().transpose(1, 2)[:, : args.check_rows], want)
        bound = math.sqrt(HEAD_DIM)  # unit RMSNorm weights: every element ≤ √D
        q8 = (q.float() * (E4M3_MAX / bound)).to(FP8)
        k8 = (k.float() * (E4M3_MAX / bound)).to(FP8)
        qk_descale = torch.tensor([(bound / E4M3_MAX) ** 2], device=device)
        v_flat = v.reshape(1, s, HEADS * HEAD_DIM)
        v_t = torch.empty(1, HEADS, HEAD_DIM, padded_keys(s), dtype=FP8, device=device)
        v_descale = torch.empty(HEADS, device=device)
        row["values_fp8_ms"] = _time(lambda: values_fp8([v_flat], HEADS, v_t, v_descale), args.repeats)
        v_t_wgmma = torch.empty_like(v_t)  # the TMA producer's V: each 32-key block permuted
        row["values_fp8_wgmma_ms"] = _time(
            lambda: values_fp8([v_flat], HEADS, v_t_wgmma, torch.empty_like(v_descale), key_order="wgmma"),
            args.repeats,
        )
        kernels = [("triton_fp8_", fp8_attention)]
        if compared is not None:
            kernels.append(("compared_triton_fp8_", compared.fp8_attention))
        for (prefix, attend), config in ((k, c) for c in configs for k in kernels):
            name = prefix + "x".join(map(str, config))
            try:
                row[name + "_ms"] = _time(
                    lambda: attend(q8, k8, v_t, qk_descale, v_descale, config=config), args.repeats
                )
                got = attend(q8, k8, v_t, qk_descale, v_descale, config=config)
                row[name + "_err"] = rel_rms(got[:, : args.check_rows], want)
            except Exception as error:  # a configuration that does not fit (shared memory) is reported
                row[name + "_error"] = str(error).splitlines()[0][:200]
        pick = choose_instantiation(torch.cuda.get_device_name(device), s)
        if results["cuda_fp8"] == "built":
            row["cuda_fp8_table_pick"] = pick.name
        for instantiation in cuda_configs if cuda_configs is not None else [pick]:
            name = f"cuda_fp8_{instantiation.name.replace('-', '_')}"
            v_in = v_t_wgmma if instantiation.tma else v_t
            try:
                got = cuda_fp8_attention(q8, k8, v_in, qk_descale, v_descale, instantiation=instantiation)
                row[name + "_err"] = rel_rms(got[:, : args.check_rows], want)
                out = torch.empty_like(got)
                row[name + "_ms"] = _time(
                    lambda: cuda_fp8_attention(
                        q8, k8, v_in, qk_descale, v_descale, out, instantiation=instantiation
                    ),
                    args.repeats,
                )
            except Exception as error:  # its failure is a result, the others still run
                row[name + "_error"] = str(error).splitlines()[0][:300]
        if cudnn is not None:
            try:
                v8 = torch.empty(1, s, HEADS, HEAD_DIM, dtype=FP8, device=device)
                v_descale_t = torch.empty(HEADS, device=device)
                values_fp8([v_flat], HEADS, v8, v_descale_t, transposed=False, per_tensor=True)
                row["cudnn_fp8_ms"] = _time(
                    lambda: cudnn_fp8_attention(q8, k8, v8, qk_descale, v_descale_t), args.repeats
                )
                o8, o_descale = cudnn_fp8_attention(q8, k8, v8, qk_descale, v_descale_t)
                row["cudnn_fp8_err"] = rel_rms(o8[:, : args.check_rows].float() * o_descale, want)
            except Exception as error:
                row["cudnn_fp8_error"] = str(error).splitlines()[0][:300]
        for key in list(row):
            if key.endswith("_ms"):
                row[key[:-3] + "_tflops"] = round(flops / row[key] / 1e9)
                row[key] = round(row[key], 3)
            elif key.endswith("_err"):
                row[key] = round(row[key], 5)
        results["runs"].append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    for row in results["runs"]:
        print_table(row)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
