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
copies with 128-key tiles, and TMA with 224-key tiles), as "cuda_fp8_s<stages>_<pingpong|free>_<cp.async|tma>"
(with "_k224" for the wide tiles), and each length's row names the one its table
picks for this GPU ("cuda_fp8_table_pick"); V is quantised for it in both key orders ("values_fp8_ms",
"values_fp8_wgmma_ms": the TMA producer's order should cost the same) and smoothed for the wide tiles
("values_fp8_smoothed_ms"). Elsewhere the results say why not.
The last lines are a markdown table per length: every kernel's milliseconds and error, the pick marked.

    python3 scripts/bench_kernels.py fp8-attention --frames 121 481 --configs default

`--suite` runs the outlier suite instead (`pan2cli.testing.attention_inputs`: synthetic pre-norm Q/K/V shaped
like a trained DiT's, through the real `qk_norm_rope`) at the first `--frames` length (default 121: 26,898
tokens, 32 heads of 128): the error of cuDNN bf16, cuDNN fp8 (per-tensor), our Triton fp8 and our CUDA fp8
(when it loads; the instantiation its table picks) against float64 over the first `--check-rows` query
rows of every head, each fp8 attention on Q/K quantised before (one fixed scale) and after (rotated and
K-smoothed, the tier's default), and the time of the Q/K quantisation both ways. One markdown table, in
well under a minute after the kernels compile. `--suite --emulate` runs the suite on the CPU instead, in
the fp8 tier's PyTorch emulation at a reduced size (`--emulate-grid`, 4 heads), with the variants the
default was chosen against (each transformation alone, per-token Q/K scales, V per channel).

    python3 scripts/bench_kernels.py fp8-attention --suite --out suite.json
    python3 scripts/bench_kernels.py fp8-attention --suite --emulate          # CPU, about a minute
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

from pan2cli.dit.cuda_fp8_attention import (  # noqa: E402
    Instantiation,
    choose_instantiation,
    cuda_fp8_attention,
    values_for,
)
from pan2cli.dit.fp8 import E4M3_MAX, FP8  # noqa: E402
from pan2cli.dit.fp8_attention_kernel import CONFIGS, fp8_attention, padded_keys  # noqa: E402
from pan2cli.dit.fp8_values_kernel import transposed_values, values_fp8  # noqa: E402
from pan2cli.testing.attention_inputs import CASES, exact_attention, make_inputs, relative_rms  # noqa: E402
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
        "stages,pingpong(0|1),producer(cp.async|tma)[,key_tile(128|224)];...",
    )  # fmt: skip
    parser.add_argument(
        "--compare-kernel",
        type=Path,
        help="another version of fp8_attention_kernel.py to time beside the tree's",
    )
    parser.add_argument("--suite", action="store_true", help="the outlier suite's errors (module docstring)")
    parser.add_argument(
        "--emulate", action="store_true", help="with --suite: the CPU emulation, reduced size"
    )
    parser.add_argument(
        "--emulate-grid",
        default="4,32,32",
        help="with --emulate: latent frames, rows, columns (default 4,32,32)",
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
    return [Instantiation(int(c[0]), bool(int(c[1])), c[2], *map(int, c[3:])) for c in configs], "built"


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
        f"\nV quantised: {row['values_fp8_ms']} ms in key order, {row['values_fp8_wgmma_ms']} ms in the wgmma order,"
        f" {row['values_fp8_smoothed_ms']} ms in the wgmma order less its mean"
    )


def suite_table(rows: list[dict], columns: dict[str, str]) -> str:
    """The suite's markdown table: a row per case, a column per attention (errors to 4 digits)."""
    lines = ["| case | " + " | ".join(columns.values()) + " |", "| --- |" + " ---: |" * len(columns)]
    for row in rows:
        cells = [
            f"{row[key]:.4f}" if isinstance(row.get(key), float) else str(row.get(key, "—"))
            for key in columns
        ]
        lines.append(f"| {CASES[row['case']]} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_suite_on_gpu(args: argparse.Namespace) -> dict:
    """Every case of the outlier suite at the real shape through each attention (module docstring)."""
    from pan2cli.dit.fusions import qk_norm_rope

    device = torch.device("cuda")
    frames = args.frames[0]
    grid = (1 + (frames - 1) // 4, 22, 39)  # 704x1248: 44x78 latents in patches of 2
    _, cuda_status = cuda_candidates("table", device)
    try:
        from pan2cli.dit.cudnn_fp8_attention import cudnn_fp8_attention, cudnn_frontend

        cudnn_status = None if args.skip_cudnn_fp8 else cudnn_frontend().backend_version_string()
    except Exception as error:  # reported, not fatal
        cudnn_status = f"unavailable: {error}"
    results = {"gpu": torch.cuda.get_device_name(), "frames": frames, "cudnn_fp8": cudnn_status,
               "cuda_fp8": cuda_status, "cases": []}  # fmt: skip
    print(json.dumps(results), flush=True)
    for case in CASES:
        inputs = make_inputs(case, grid=grid, text_tokens=args.text, heads=HEADS, device=device, seed=frames)
        rows = args.check_rows
        want = exact_attention(inputs, rows=rows)
        row = {"case": case, "tokens": inputs.tokens}
        q, k = qk_norm_rope(**inputs.qk_streams(), eps=inputs.eps, fused=True)  # bf16, as the bf16 tier
        v = inputs.joint_values()
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        row["cudnn_bf16"] = relative_rms(out.transpose(1, 2)[:, :rows], want)
        v_streams = [inputs.v_video, inputs.v_text]
        v_t, v_descale, _ = transposed_values(v_streams, HEADS)
        for label, scales in (("before", inputs.fp8_scales(hadamard=False, smooth_k=False)),
                              ("after", inputs.fp8_scales())):  # fmt: skip
            q8, k8 = inputs.quantized_qk(scales, fused=True)
            if case == "random":  # the cost of the transformations: the Q/K quantisation alone

                def quantize(inputs=inputs, scales=scales):
                    return inputs.quantized_qk(scales, fused=True)

                row[f"quantize_qk_{label}_ms"] = round(_time(quantize, args.repeats), 4)
            out = fp8_attention(q8, k8, v_t, scales.qk_descale, v_descale)
            row[f"triton_fp8_{label}"] = relative_rms(out[:, :rows], want)
            if cudnn_status and not cudnn_status.startswith("unavailable"):
                v8 = torch.empty(1, inputs.tokens, HEADS, HEAD_DIM, dtype=FP8, device=device)
                v8_descale = torch.empty(HEADS, device=device)
                values_fp8(v_streams, HEADS, v8, v8_descale, transposed=False, per_tensor=True)
                o8, o_descale = cudnn_fp8_attention(q8, k8, v8, scales.qk_descale, v8_descale)
                row[f"cudnn_fp8_{label}"] = relative_rms(o8[:, :rows].float() * o_descale, want)
            if cuda_status == "built":
                try:
                    pick = choose_instantiation(torch.cuda.get_device_name(device), inputs.tokens)
                    v_cuda, v_cuda_descale, v_mean = values_for(pick, v_streams, HEADS)
                    out = cuda_fp8_attention(
                        q8, k8, v_cuda, scales.qk_descale, v_cuda_descale, instantiation=pick, v_mean=v_mean
                    )
                    row[f"cuda_fp8_{label}"] = relative_rms(out[:, :rows], want)
                except Exception as error:  # its failure is a result; the others still run
                    row[f"cuda_fp8_{label}"] = f"failed: {str(error).splitlines()[0][:120]}"
        results["cases"].append(row)
        print(json.dumps(row), flush=True)
        del inputs, q, k, v, v_t, out
        torch.cuda.empty_cache()
    columns = {"cudnn_bf16": "cuDNN bf16"}
    for name, title in (("cudnn_fp8", "cuDNN fp8"), ("triton_fp8", "Triton fp8"), ("cuda_fp8", "CUDA fp8")):
        columns |= {f"{name}_before": f"{title}, before", f"{name}_after": f"{title}, after"}
    random_row = results["cases"][0]
    print(f"\n{results['gpu']}, {frames} frames ({random_row['tokens']:,} tokens), {HEADS} heads of {HEAD_DIM}; "
          f"error = relative RMS of O against float64 over {args.check_rows} query rows of every head; before: "
          f"Q/K with one fixed scale; after: rotated and K-smoothed (the default)\n")  # fmt: skip
    print(suite_table(results["cases"], columns))
    print(f"\nQ/K quantisation (qk_norm_rope, e4m3 out): {random_row['quantize_qk_before_ms']} ms before, "
          f"{random_row['quantize_qk_after_ms']} ms after (K's mean pass and the rotation)")  # fmt: skip
    return results


def run_suite_emulated(args: argparse.Namespace) -> dict:
    """The outlier suite in the fp8 tier's CPU emulation at a reduced size, with the variants tried."""
    from pan2cli.dit.fp8 import hadamard_matrix, quantize_with_scales, row_scales
    from pan2cli.dit.fp8_attention import attention_reference, quantize_values_reference
    from pan2cli.testing.attention_inputs import emulated_fp8_attention, normed_qk

    grid = tuple(int(v) for v in args.emulate_grid.split(","))
    heads = 4
    results = {"device": "cpu (emulation)", "grid": grid, "cases": []}

    def per_token(x):  # one e4m3 scale per row instead of the fixed one
        scale = row_scales(x)
        return quantize_with_scales(x, scale).float() * scale[..., None]

    for case in CASES:
        inputs = make_inputs(case, grid=grid, text_tokens=64, heads=heads, seed=1)
        want = exact_attention(inputs)
        row = {"case": case, "tokens": inputs.tokens}
        q, k = normed_qk(inputs, torch.float32)
        q, k = q.bfloat16().float(), k.bfloat16().float()  # the bf16 tier's Q/K, attention in float32
        v = inputs.joint_values()
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.float().transpose(1, 2))
        row["bf16"] = relative_rms(out.transpose(1, 2).bfloat16(), want)
        for name, hadamard, smooth_k in (("before", False, False), ("hadamard", True, False),
                                         ("smooth_k", False, True), ("after", True, True)):  # fmt: skip
            out = emulated_fp8_attention(inputs, inputs.fp8_scales(hadamard=hadamard, smooth_k=smooth_k))
            row[name] = relative_rms(out.bfloat16(), want)
        q, k = normed_qk(inputs, torch.float32)
        k = k - k.mean(dim=1, keepdim=True)
        rotation = hadamard_matrix(HEAD_DIM) / math.sqrt(HEAD_DIM)
        v8, v_descale = quantize_values_reference(v)
        out = attention_reference(per_token(q @ rotation), per_token(k @ rotation), v8, 1.0, v_descale)
        row["after_per_token_qk"] = relative_rms(out.bfloat16(), want)
        channel_descale = v.float().abs().amax(dim=(0, 1)) / E4M3_MAX  # [H, D]
        v_channels = (v.float() / channel_descale).clamp(-E4M3_MAX, E4M3_MAX).to(
            FP8
        ).float() * channel_descale
        scales = inputs.fp8_scales()
        q8, k8 = inputs.quantized_qk(scales, fused=False)
        out = attention_reference(q8, k8, v_channels, scales.q_descale * scales.k_descale, torch.ones(heads))
        row["after_v_per_channel"] = relative_rms(out.bfloat16(), want)
        results["cases"].append(row)
        print(json.dumps(row), flush=True)
    columns = {
        "bf16": "bf16", "before": "fp8, one fixed scale", "hadamard": "+ rotation", "smooth_k": "+ K smoothing",
        "after": "+ both (default)", "after_per_token_qk": "+ both, per-token Q/K scales",
        "after_v_per_channel": "+ both, V per channel",
    }  # fmt: skip
    tokens = results["cases"][0]["tokens"]
    print(f"\nCPU emulation, {tokens:,} tokens, {heads} heads of {HEAD_DIM}; error = relative RMS of O against "
          f"float64 attention of the same bf16 inputs\n")  # fmt: skip
    print(suite_table(results["cases"], columns))
    return results


def main() -> None:
    args = parse_args()
    if args.suite:
        results = run_suite_emulated(args) if args.emulate else run_suite_on_gpu(args)
        if args.out:
            args.out.write_text(json.dumps(results, indent=2) + "\n")
        return
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
        v_mean = torch.empty(1, HEADS * HEAD_DIM, device=device)  # the wide tiles' V: less its mean too
        row["values_fp8_smoothed_ms"] = _time(
            lambda: values_fp8(
                [v_flat], HEADS, v_t_wgmma, torch.empty_like(v_descale), key_order="wgmma", mean=v_mean
            ),
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
            try:
                v_in, v_in_descale, v_mean = values_for(instantiation, [v_flat], HEADS)
                got = cuda_fp8_attention(
                    q8, k8, v_in, qk_descale, v_in_descale, instantiation=instantiation, v_mean=v_mean
                )
                row[name + "_err"] = rel_rms(got[:, : args.check_rows], want)
                out = torch.empty_like(got)
                row[name + "_ms"] = _time(
                    lambda: cuda_fp8_attention(
                        q8,
                        k8,
                        v_in,
                        qk_descale,
                        v_in_descale,
                        out,
                        instantiation=instantiation,
                        v_mean=v_mean,
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
