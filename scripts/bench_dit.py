"""Time the real PAN 2 transformer (29.2 B parameters, random weights) on one GPU: a forward and a CFG step per length.

The model is built on the meta device and materialised on the GPU in bf16 with the AdaLN linears in float32,
as released (67.3 GB), weights drawn at random (fast, on the GPU). Per video length at 704x1248 (121 frames =
26,598 video tokens, 241 = 52,338, 481 = 103,818) with ~300 text tokens: one CFG step (two forwards, prompt
and negative prompt, as `pan2 generate` runs them), timed with CUDA events after a warm-up step; FLOPs per
forward from the model's shapes (linears, attention, refiner, patch embed and projection) and the achieved
TFLOP/s; peak memory; the 50-step estimate. `--variants` compares, in the same run, the fused Triton ops,
the PyTorch reference ops, SDPA pinned to one backend, pan2's attention priority (`pan2cli.dit.attention`,
"pan2"), and the blocks under `torch.compile` ("compiled", run last: the blocks stay compiled).
`--profile` adds the CUDA time of one step by kind of kernel (attention, GEMMs, the fused norms, the rest).
The fp8 tier (`pan2cli.dit.quantize`): "fp8" (as `pan2 generate --precision fp8` runs it: fp8 linears and the
default fp8 attention, `--fp8-attention auto`: our CUDA kernel on sm_90 GPUs, our Triton kernel elsewhere),
"fp8-cuda", "fp8-triton", "fp8-cudnn" (that fp8 attention, as `--fp8-attention` asks for it; cuDNN's needs
nvidia-cudnn-frontend), "fp8-sdpa" (fp8 linears, bf16 attention); each row's "fp8_attention" is what the timed
steps ran (kernel, calls, the CUDA kernel's instantiation). With bf16 variants in the
same run the bf16 model is quantised in place after them (list them first); with fp8 variants only, the
model is made in fp8 block by block, so the bf16 model never occupies the GPU (as `pan2 generate
--precision fp8` loads it), which is what `--memory-gib 80` measures.

`--table` runs the memory plan's acceptance table in one process (`run_table`): per precision (`--precisions`)
the model is made once, then for each length and each cap (`--caps`, largest first) the plan `pan2 generate
--max-gpu-memory CAP` would make (`pan2cli.pipeline.memory_plan`) is applied (blocks moved between the GPU and
page-locked host memory, the process capped with `torch.cuda.set_per_process_memory_fraction`) and the CFG step
timed as `pan2 generate` runs it (both passes through each streamed block): the median of `--steps` steps after
a warm-up, the peak GPU memory against the plan's prediction, the bytes streamed per step and the rate that
hides them, the host memory page-locked. One markdown table at the end; each row as JSON as it comes.

Under torchrun (`python -m torch.distributed.run --nproc-per-node 2 scripts/bench_dit.py ...`) every rank
holds the model on its GPU and the step is `pan2cli.pipeline.sampling.denoise`'s with `split=True`
(CFG-parallel, and sequence parallel within each half of four or more ranks); rank 0 reports.

    python scripts/bench_dit.py --frames 121 241 --variants fused pan2 compiled --profile --out dit.json
    python scripts/bench_dit.py --frames 121 241 481 --variants pan2 fp8 --profile --out dit.json
    python scripts/bench_dit.py --table --frames 121 --precisions bf16 fp8 --caps 80 48 32 24 16 --steps 3
    python scripts/bench_dit.py --device cpu --small        # dry run of the set-up on a tiny config
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from pan2cli.cuda_allocator import configure_cuda_allocator  # noqa: E402

configure_cuda_allocator()  # as `pan2` runs: before torch loads (the table's streamed 481-frame rows need it)

import torch  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from pan2cli.dit import set_fused_kernels  # noqa: E402
from pan2cli.dit.attention import attention_backends  # noqa: E402
from pan2cli.dit.checkpoint import release_defaults  # noqa: E402
from pan2cli.dit.fp8_attention_choice import fp8_attention_ran, reset_fp8_attention_record  # noqa: E402
from pan2cli.pipeline.sampling import denoise, guidance_passes  # noqa: E402
from scripts.make_random_pan2 import random_transformer  # noqa: E402

FP8_VARIANTS = ("fp8", "fp8-cuda", "fp8-triton", "fp8-cudnn", "fp8-sdpa")
SMALL = dict(
    num_attention_heads=2,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=1,
    text_embed_dim=32,
    rope_axes_dim=(4, 6, 6),
)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--frames", type=int, nargs="+", default=[121], help="video frames, 1 + 4k (default 121)"
    )
    parser.add_argument("--height", type=int, default=704)
    parser.add_argument("--width", type=int, default=1248)
    parser.add_argument("--text", type=int, default=300, help="text tokens (default 300)")
    parser.add_argument("--steps", type=int, default=2, help="timed CFG steps per length (default 2)")
    parser.add_argument(
        "--variants", nargs="+", default=["fused"],
        choices=["fused", "unfused", "fused-cudnn", "fused-flash", "pan2", "compiled", *FP8_VARIANTS],
        help="DiT ops to time: fused Triton ops or the PyTorch reference; -cudnn / -flash pin SDPA's backend (default: torch's pick); "
        "pan2: fused, under pan2's attention priority; compiled: pan2 with the blocks under torch.compile (put it last); "
        "fp8 (the default fp8 attention), fp8-cuda, fp8-triton, fp8-cudnn (that one), fp8-sdpa (bf16 attention): "
        "the fp8 tier (after the bf16 variants)",
    )  # fmt: skip
    parser.add_argument("--profile", action="store_true", help="CUDA time of one step by kind of kernel")
    parser.add_argument(
        "--offload", action="store_true",
        help="stream the blocks from pinned host memory (pan2cli.pipeline.offload), as `pan2 generate --offload`",
    )  # fmt: skip
    parser.add_argument(
        "--memory-gib", type=float,
        help="cap this process's GPU memory (torch.cuda.set_per_process_memory_fraction), e.g. 79.6 for an 80 GB card",
    )  # fmt: skip
    parser.add_argument(
        "--sequence-only", action="store_true",
        help="under torchrun: both CFG passes sequence-parallel over all ranks, not CFG-parallel (SP measured alone)",
    )  # fmt: skip
    parser.add_argument(
        "--table", action="store_true",
        help="the memory plan's table: every --precisions x --frames x --caps, as `pan2 generate --max-gpu-memory` plans it",
    )  # fmt: skip
    parser.add_argument("--precisions", nargs="+", default=["bf16", "fp8"], choices=["bf16", "fp8"])
    parser.add_argument(
        "--caps", type=float, nargs="+", default=[80, 48, 32, 24, 16], help="--table's GPU memory caps, GiB"
    )
    parser.add_argument(
        "--warm-up", choices=["each", "first"], default="each",
        help="--table's untimed step: before each row, or only before the first cap of each length (the compiles "
        "and the streams' buffers then exist; saves a long step a row at 241 and 481 frames)",
    )  # fmt: skip
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--small", action="store_true", help="a tiny config (dry run)")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    return parser.parse_args()


def forward_flops(config: dict, video_tokens: int, text_tokens: int) -> float:
    """Multiply-adds x 2 of one forward from the shapes (elementwise work and the tiny AdaLN GEMVs left out)."""
    d = config["num_attention_heads"] * config["attention_head_dim"]
    s, l = video_tokens, text_tokens
    blocks = config["num_layers"] * (
        2 * s * (4 * d * d + 2 * d * int(d * config["mlp_ratio"]))
        + 2 * l * (4 * d * d + 2 * d * int(d * config["context_mlp_ratio"]))
        + 4 * (s + l) ** 2 * d  # QK^T and PV over the joint tokens
    )
    inner = int(d * config["refiner_mlp_ratio"])
    refiner = config["num_refiner_layers"] * (2 * l * (4 * d * d + 3 * d * inner) + 4 * l * l * d)
    edges = 2 * s * d * (config["in_channels"] * 4 + config["out_channels"] * 4) + 2 * l * d * (
        config["text_embed_dim"] + d
    )
    return float(blocks + refiner + edges)


_KERNEL_KINDS = (  # (kind, substrings of CUDA kernel names), first match wins
    ("attention", ("flash", "fmha", "cudnn", "attention", "sdpa")),
    (
        "fused ops (Triton)",
        (
            "qk_norm_rope",
            "layer_norm_modulate",
            "gated_residual",
            "quantize",
            "amax",
            "_k_sums",
            "_channel_stats",
            "_value_sums",
            "_shift_kernel",
        ),
    ),
    ("GEMMs", ("gemm", "xmma", "cutlass", "nvjet", "wgmma", "cublas")),
    ("host-to-device copies", ("memcpy htod",)),
)


def profile_step(step, sync) -> tuple[dict[str, float], list]:
    """CUDA milliseconds of one `step()` by kind of kernel (`_KERNEL_KINDS`, else "rest"), and the top kernels."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync()
    kinds: dict[str, float] = {}
    kernels = []
    for event in prof.key_averages():
        name = event.key.lower()
        ms = getattr(event, "device_time_total", getattr(event, "cuda_time_total", 0.0)) / 1e3
        kind = next((k for k, needles in _KERNEL_KINDS if any(n in name for n in needles)), "rest")
        kinds[kind] = kinds.get(kind, 0.0) + ms
        kernels.append((round(ms, 1), event.count, event.key[:90]))
    top = sorted(kernels, reverse=True)[:15]
    return {k: round(v, 1) for k, v in sorted(kinds.items())}, top


def weights_gib(model: torch.nn.Module) -> float:
    """GiB of the model's parameters and buffers (the fp8 weights are buffers)."""
    tensors = [*model.parameters(), *model.buffers()]
    return round(sum(t.numel() * t.element_size() for t in tensors) / 2**30, 2)


def use_variant_precision(model, variant: str, device: torch.device, kept_scales: dict) -> None:
    """Quantise the model to fp8 the first time an fp8 variant comes; set its attention for this variant, as
    `pan2 generate --fp8-attention` chooses it (once, building our CUDA kernel where it is chosen).

    The fp8 attention's scales are the ones made at quantisation (`kept_scales`, by block), never made again:
    made from weights that stream, they would be made in host memory.
    """
    from pan2cli.dit.fp8_attention_choice import resolve_fp8_attention, use_fp8_attention
    from pan2cli.dit.quantize import quantize_transformer

    if variant not in FP8_VARIANTS:
        return
    if model.precision != "fp8":
        quantize_transformer(model)
        torch.cuda.empty_cache()
    for index, block in enumerate(model.transformer_blocks):
        attn = block.attn
        if attn.fp8_scales is not None:
            kept_scales[index] = attn.fp8_scales
        attn.fp8_scales = None if variant == "fp8-sdpa" else kept_scales[index]
    if variant != "fp8-sdpa":
        requested = "auto" if variant == "fp8" else variant.removeprefix("fp8-")
        head_dim = model.config.attention_head_dim
        use_fp8_attention(model, resolve_fp8_attention(requested, device, head_dim))


def run_table(args, device: torch.device) -> list[dict]:
    """The memory plan's acceptance table (module docstring): a row per precision, length and cap."""
    from pan2cli.dit.checkpoint import expected_shapes
    from pan2cli.errors import InputError
    from pan2cli.pipeline.memory_plan import LayeredSizes, RunShape, plan_memory
    from pan2cli.pipeline.offload import enable_block_offload
    from pan2cli.pipeline.planning import transformer_sizes

    config = {**release_defaults(), **(SMALL if args.small else {})}
    cuda = device.type == "cuda"  # on the CPU (a dry run with --small) nothing is capped or measured
    total = torch.cuda.get_device_properties(device).total_memory if cuda else 0
    index = (device.index if device.index is not None else torch.cuda.current_device()) if cuda else 0

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(device)

    def cap_at(gib: float | None) -> None:
        if cuda:
            torch.cuda.set_per_process_memory_fraction(
                1.0 if gib is None else min(1.0, gib * 2**30 / total), index
            )
            torch.cuda.empty_cache()

    hidden_size = config["num_attention_heads"] * config["attention_head_dim"]
    height, width = (64, 96) if args.small else (args.height, args.width)
    rows = []
    for precision in args.precisions:
        start = time.perf_counter()
        model = random_transformer(device, precision=precision, **(SMALL if args.small else {}))
        set_fused_kernels(model, cuda)
        sync()
        made = {"precision": precision, "materialise_s": round(time.perf_counter() - start, 1)}
        print(json.dumps(made), flush=True)
        sizes = transformer_sizes(expected_shapes(config), torch.bfloat16, precision)
        streamer = None
        resident_step: dict[int, float] = {}
        for frames in args.frames:
            latent = (1 + (frames - 1) // 4, height // 16, width // 16)
            video_tokens = latent[0] * (latent[1] // 2) * (latent[2] // 2)
            generator = torch.Generator(device=device).manual_seed(1)
            dtype = next(model.x_embedder.parameters()).dtype
            hidden = torch.randn(1, 97, *latent, generator=generator, device=device).to(dtype)
            text = config["text_embed_dim"]
            cond = torch.randn(1, args.text, text, generator=generator, device=device).to(dtype)
            uncond = torch.randn(1, 12, text, generator=generator, device=device).to(dtype)
            timestep = torch.tensor([900.0], device=device)
            shape = RunShape(precision, video_tokens, height * width, frames, hidden_size=hidden_size)
            for position, cap in enumerate(
                sorted(args.caps, reverse=True)
            ):  # largest first: blocks go to host memory, rarely back
                row = {"frames": frames, "precision": precision, "cap_gib": cap}
                cap_at(None)
                # what `pan2 generate` would see free before loading anything: free now and what this process holds
                if cuda:
                    free = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device)
                else:
                    free = int(max(args.caps) * 2**30)
                try:
                    plan = plan_memory(
                        shape=shape, transformer=sizes, text_encoder=LayeredSizes((), 0), free_bytes=free,
                        cap_bytes=int(cap * 2**30), host=None, decoder_kernel=True, chunk_latent_frames=4,
                        stream_all=args.offload,
                    )  # fmt: skip
                except InputError as error:
                    row["plan"] = f"no plan: {error}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    continue
                begin = time.perf_counter()
                streamed = plan.transformer.streamed
                if streamer is None and streamed:
                    streamer = enable_block_offload(model, device, streamed=streamed)
                elif streamer is not None:
                    streamer = model.block_streamer = streamer.replan(streamed)
                if streamer is not None:
                    streamer.compact_resident()  # as `pan2 generate` after its load
                sync()
                replan_s = time.perf_counter() - begin
                cap_at(cap)
                try:
                    warm_up = args.warm_up == "each" or position == 0
                    times = time_steps(
                        model, hidden, timestep, cond, uncond, args.steps, sync, cuda, device, warm_up
                    )
                except torch.OutOfMemoryError as error:  # the plan's prediction was short: say so, go on
                    row["plan"] = f"{plan.line()} OUT OF MEMORY: {str(error).splitlines()[0]}"
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    continue
                step = statistics.median(times)
                if not streamed:
                    resident_step.setdefault(frames, step)
                base = resident_step.get(frames)
                row.update(
                    resident=plan.transformer.resident, streamed=len(streamed), cfg_step_s=round(step, 3),
                    cfg_step_s_all=[round(t, 3) for t in times],
                    vs_resident=round(step / base - 1, 4) if base else None,
                    peak_gib=round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
                    predicted_peak_gib=round(plan.transformer.stage_bytes / 2**30, 2),
                    streamed_gb_per_step=round(plan.bytes_per_step / 1e9, 2),
                    gb_per_s_to_hide=round(plan.bytes_per_step / 1e9 / step, 1),
                    host_pinned_gib=round((streamer.host_bytes if streamer else 0) / 2**30, 2),
                    replan_s=round(replan_s, 1), plan=plan.line(), warmed_up=warm_up,
                )  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
        del model, streamer
        gc.collect()  # the page-locked arenas go with the model (`pan2cli.pipeline.pinned`)
        cap_at(None)
    print(markdown_table(rows, args.steps), flush=True)
    return rows


def time_steps(
    model, hidden, timestep, cond, uncond, steps: int, sync, cuda: bool, device, warm_up: bool = True
) -> list[float]:
    """Seconds of `steps` CFG steps as `pan2 generate` runs them, after a warm-up; the peak counted from there."""
    with torch.inference_mode(), attention_backends():
        if warm_up:
            guidance_passes(model, hidden, timestep, cond, uncond)
        sync()
        if cuda:
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(steps):
            begin = time.perf_counter()
            guidance_passes(model, hidden, timestep, cond, uncond)
            sync()
            times.append(time.perf_counter() - begin)
            print(f"  step {len(times)}/{steps}: {times[-1]:.3f} s", file=sys.stderr, flush=True)  # progress
    return times


def markdown_table(rows: list[dict], steps: int) -> str:
    """The acceptance table of `run_table`'s rows."""
    lines = [
        f"| frames | precision | cap GiB | blocks resident / streamed | CFG step s (median of {steps}) | vs resident "
        "| peak GiB (plan) | GB streamed per step | GB/s to hide it | host GiB page-locked |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "cfg_step_s" not in r:
            lines.append(f"| {r['frames']} | {r['precision']} | {r['cap_gib']:g} | {r['plan']} | | | | | | |")
            continue
        vs = f"{100 * r['vs_resident']:+.1f} %" if r["vs_resident"] is not None else "—"
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "—"
        lines.append(
            f"| {r['frames']} | {r['precision']} | {r['cap_gib']:g} | {r['resident']} / {r['streamed']} "
            f"| {r['cfg_step_s']:.3f} | {vs} | {peak} ({r['predicted_peak_gib']:.2f}) "
            f"| {r['streamed_gb_per_step']:.1f} | {r['gb_per_s_to_hide']:.1f} | {r['host_pinned_gib']:.1f} |"
        )
    return "\n".join(lines)


def main() -> None:
    args = parse_args()
    if args.table:
        rows = run_table(args, torch.device(args.device))
        if args.out:
            args.out.write_text(json.dumps(rows, indent=2) + "\n")
        return
    distributed_run = "LOCAL_RANK" in os.environ
    if distributed_run:  # torchrun: one GPU per rank, the step split as `pan2 generate --gpus N` splits it
        import torch.distributed as dist

        local = int(os.environ["LOCAL_RANK"])
        if args.device == "cuda":
            torch.cuda.set_device(local)
            args.device = f"cuda:{local}"
        dist.init_process_group("nccl" if args.device.startswith("cuda") else "gloo")
    device = torch.device(args.device)
    config = {**release_defaults(), **(SMALL if args.small else {})}
    fp8_variants = [v for v in args.variants if v in FP8_VARIANTS]
    if fp8_variants and args.variants[-len(fp8_variants) :] != fp8_variants:
        raise SystemExit("list the fp8 variants after the bf16 ones: the model is quantised in place")
    if args.offload and fp8_variants and len(fp8_variants) != len(args.variants):
        raise SystemExit(
            "with --offload, run the fp8 variants in a run of their own: a streamed model is not re-quantised"
        )
    start = time.perf_counter()
    precision = "fp8" if len(fp8_variants) == len(args.variants) else "bf16"
    model = random_transformer(device, precision=precision, **(SMALL if args.small else {}))
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    sync()
    if args.offload:  # the blocks go to pinned host memory; only two at a time come back during a forward
        from pan2cli.pipeline.offload import enable_block_offload

        enable_block_offload(model, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if args.memory_gib and device.type == "cuda":  # emulate a smaller card
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = min(1.0, args.memory_gib * 2**30 / total)
        torch.cuda.set_per_process_memory_fraction(fraction, device.index or torch.cuda.current_device())
    results = {
        "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "weights_gib": weights_gib(model),
        "materialise_s": round(time.perf_counter() - start, 1),
        "offload": args.offload,
        "memory_cap_gib": args.memory_gib,
        "runs": [],
    }
    results["ranks"] = int(os.environ.get("WORLD_SIZE", "1"))
    main_rank = int(os.environ.get("RANK", "0")) == 0
    if main_rank:
        print(json.dumps({k: v for k, v in results.items() if k != "runs"}), flush=True)
    dtype = next(model.x_embedder.parameters()).dtype
    kept_scales: dict = {}  # the fp8 attention's scales by block (`use_variant_precision`)
    # Variants outside, lengths inside: the bf16 variants run every length before the model is quantised.
    for variant, frames in ((v, f) for v in args.variants for f in args.frames):
        height, width = (64, 96) if args.small else (args.height, args.width)
        shape = (1, 97, 1 + (frames - 1) // 4, height // 16, width // 16)
        video_tokens = shape[2] * shape[3] // 2 * shape[4] // 2
        generator = torch.Generator(device=device).manual_seed(1)
        hidden = torch.randn(shape, generator=generator, device=device).to(dtype)
        cond = torch.randn(1, args.text, config["text_embed_dim"], generator=generator, device=device).to(
            dtype
        )
        uncond = torch.randn(1, 12, config["text_embed_dim"], generator=generator, device=device).to(
            dtype
        )  # " " through the template
        timestep = torch.tensor([900.0], device=device)
        use_variant_precision(model, variant, device, kept_scales)
        set_fused_kernels(model, variant != "unfused" and device.type == "cuda")
        backend = {
            "fused-cudnn": SDPBackend.CUDNN_ATTENTION,
            "fused-flash": SDPBackend.FLASH_ATTENTION,
        }.get(variant)
        if variant == "compiled":
            for block in model.transformer_blocks:
                block.compile()  # one graph per block; the 44 blocks share the compiled code
        pan2_order = variant in ("pan2", "compiled", *FP8_VARIANTS)
        attention = attention_backends() if pan2_order else contextlib.nullcontext()

        if distributed_run:  # one step of the pipeline's loop, split over the ranks

            def step():
                latents, condition = hidden[:, :48].float(), hidden[:, 48:]
                denoise(model, latents, condition, cond, uncond, [0.9, 0.8], 2.5, 1000, split=True,
                        cfg_parallel=not args.sequence_only)  # fmt: skip

        else:

            def step():  # both passes; through each block at once where blocks stream (`guidance_passes`)
                guidance_passes(model, hidden, timestep, cond, uncond)

        with (
            torch.inference_mode(),
            attention,
            sdpa_kernel([backend]) if backend is not None else contextlib.nullcontext(),
        ):
            step()  # warm-up: Triton compiles, cuBLAS picks its kernels
            sync()
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            reset_fp8_attention_record(model)  # what the timed steps run
            times = []
            for _ in range(args.steps):
                begin = time.perf_counter()
                step()
                sync()
                times.append(time.perf_counter() - begin)
            kinds, top = profile_step(step, sync) if args.profile and device.type == "cuda" else (None, None)
        seconds = min(times)
        if kinds and "host-to-device copies" in kinds:  # how much of the copying the compute hid
            compute = sum(v for k, v in kinds.items() if k != "host-to-device copies")
            copies = kinds["host-to-device copies"]
            kinds["copy_hidden_fraction"] = round(
                max(0.0, min(1.0, (compute + copies - 1e3 * seconds) / copies)), 3
            )
        flops = forward_flops(config, video_tokens, args.text) + forward_flops(config, video_tokens, 12)
        row = {
            "frames": frames, "variant": variant, "video_tokens": video_tokens, "text_tokens": args.text,
            "cfg_step_s": round(seconds, 3), "cfg_step_s_median": round(statistics.median(times), 3),
            "cfg_step_s_all": [round(t, 3) for t in times],
            "tflops_per_step": round(flops / 1e12, 1), "tflop_per_s": round(flops / seconds / 1e12, 1),
            "fifty_steps_min": round(50 * seconds / 60, 1),
            "peak_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if device.type == "cuda" else None,
            "ranks": results["ranks"], "precision": model.precision, "weights_gib": weights_gib(model),
            "fp8_attention": fp8_attention_ran(model) if model.precision == "fp8" else None,
            "profile_ms": kinds, "top_kernels_ms_calls": top,
        }  # fmt: skip
        results["runs"].append(row)
        if main_rank:
            print(json.dumps(row), flush=True)
    if args.out and main_rank:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    if distributed_run:
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
