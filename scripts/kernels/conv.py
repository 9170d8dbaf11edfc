"""Our fixed-order convs (CUTLASS and Triton) against cuDNN on every conv layer of the decoder (one GPU).

Usage: python3 scripts/bench_kernels.py conv [--repeats 20] [--engines cudnn,cutlass] [--triton-tiles]
       [--layers up2,up3] [--kernel-names] [--configs 128x256p,256x128p] [--ncu]

For each layer shape (channels-last bf16, as the kernel decode path calls them, at a 704x1248 decode's
sizes): cuDNN through ATen, the CUTLASS conv with each tile configuration of the build, and the Triton
kernel (its own tiles; `--triton-tiles` adds a sweep); milliseconds per call (CUDA events, median of
`--repeats` after a warm-up), TFLOP/s, and max |diff| against cuDNN (bf16). The last table weights
each layer by its share of a decode's FLOPs (docs: wan22_vae.md section 8.1). `--kernel-names` adds the
CUDA kernels each call launches (cuDNN's names give its tile, cluster and warp-group shapes).

`--ncu` times nothing: it runs each chosen layer (default up1's 3x3x3 conv and up3's conv1, the largest)
once in cuDNN and once in each CUTLASS configuration between cudaProfilerStart/Stop, after a warm-up, so
that Nsight Compute profiles one launch of each (ncu locks the clocks to base: its durations compare the
kernels' work at equal clocks, docs/KERNEL_NOTES.md):

    ncu --profile-from-start off --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section WarpStateStats --section Occupancy --section LaunchStats \
        python3 scripts/bench_kernels.py conv --ncu --configs 128x256p,256x128p-1x2
"""

from __future__ import annotations

import argparse
import statistics
from functools import partial

import torch
import torch.nn.functional as F

from pan2cli.vae.kernel.conv import conv_channels_last, conv_cutlass

# (name, input shape, C_out, kernel, pad_w, TFLOP of this layer class in a 5 s 704x1248 decode)
LAYERS = [
    ("mid/up0 3x3x3, chunk of 4", (1, 6, 46, 78, 1024), 1024, (3, 3, 3), 1, 24.097 + 36.145),
    ("up1 3x3x3, chunk of 8", (1, 10, 90, 156, 1024), 1024, (3, 3, 3), 1, 284.500),
    ("up0 time conv (3,1,1)", (1, 6, 44, 78, 1024), 2048, (3, 1, 1), 0, 1.296),
    ("up1 time conv (3,1,1)", (1, 3, 88, 156, 1024), 2048, (3, 1, 1), 0, 10.364),
    ("up0 phase conv 2x2, 8 frames", (8, 46, 78, 1024), 4096, (2, 2), 1, 15.806 * 4 / 9),
    ("up1 phase conv 2x2, 2 frames", (2, 90, 156, 1024), 4096, (2, 2), 1, 125.408 * 4 / 9),
    ("up2 conv1 1024->512, tail 2", (1, 4, 178, 312, 1024), 512, (3, 3, 3), 1, 665.359 * 2 / 11),
    ("up2 512->512, tail 2", (1, 4, 178, 312, 512), 512, (3, 3, 3), 1, 665.359 * 9 / 11),
    ("up2 phase conv 2x2, 2 frames", (2, 178, 312, 512), 2048, (2, 2), 1, 125.408 * 4 / 9),
    ("up3 conv1 512->256, tail 2", (1, 4, 354, 624, 512), 256, (3, 3, 3), 1, 665.359 * 2 / 11),
    ("up3 256->256, tail 2", (1, 4, 354, 624, 256), 256, (3, 3, 3), 1, 665.359 * 9 / 11),
]
# (BLOCK_M, BLOCK_N, warps, stages[, BLOCK_K]); None: the layer's own (`pan2cli.vae.kernel.conv._tiles`)
TILES = [
    None,
    (128, 256, 8, 3),
    (128, 256, 8, 4),
    (256, 128, 8, 3),
    (256, 128, 8, 4),
    (128, 256, 8, 2, 128),
    (256, 128, 8, 2, 128),
    (128, 128, 4, 4),
]
NCU_LAYERS = "up1 3x3x3,up3 conv1"  # the two largest layer classes of a decode


def _cudnn(x: torch.Tensor, w: torch.Tensor, pad_w: int) -> torch.Tensor:
    """The same conv through ATen/cuDNN on channels-last views, channels-last out."""
    if w.dim() == 5:
        return F.conv3d(x.permute(0, 4, 1, 2, 3), w, padding=(0, 0, pad_w)).permute(0, 2, 3, 4, 1)
    return F.conv2d(x.permute(0, 3, 1, 2), w, padding=(0, pad_w)).permute(0, 2, 3, 1)


def _operands(shape, c_out: int, kernel) -> tuple[torch.Tensor, torch.Tensor]:
    """Random channels-last bf16 input and filter of one layer (unit-variance outputs)."""
    x = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    c_in = shape[-1]
    fmt = torch.channels_last_3d if len(kernel) == 3 else torch.channels_last
    w = (torch.randn(c_out, c_in, *kernel, device="cuda") / (c_in * 9) ** 0.5).to(torch.bfloat16)
    return x, w.contiguous(memory_format=fmt)


def _time(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _kernel_names(fn) -> str:
    """The CUDA kernels one call of `fn` launches (torch.profiler), names shortened to 160 characters."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages() if (getattr(e, "device_time_total", 0) or 0) > 0]
    return "; ".join(name[:160] for name in names)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--triton-tiles", action="store_true", help="also sweep the Triton kernel's tiles")
    parser.add_argument(
        "--engines", default="cudnn,cutlass,triton", help="comma-separated subset of cudnn, cutlass, triton"
    )
    parser.add_argument("--layers", default="", help="comma-separated name prefixes (default: every layer)")
    parser.add_argument(
        "--kernel-names", action="store_true", help="print the CUDA kernels each engine launches per layer"
    )
    parser.add_argument(
        "--configs", default="", help="CUTLASS tile configurations (default: every one built)"
    )
    parser.add_argument(
        "--ncu",
        action="store_true",
        help=f"no timing: one launch of each layer per engine for Nsight Compute (default --layers {NCU_LAYERS!r})",
    )
    args = parser.parse_args()
    if args.ncu:
        ncu_launches(args.layers or NCU_LAYERS, args.configs)
        return
    layer_tables(args.repeats, args.engines, args.layers, args.triton_tiles, args.kernel_names, args.configs)


def ncu_launches(layers: str, configs: str = "") -> None:
    """Each chosen layer once in cuDNN, then once in each CUTLASS configuration (default: every one built),
    between cudaProfilerStart and cudaProfilerStop, each after a warm-up call outside that window."""
    from pan2cli.vae.kernel.build import load_kernel

    ops = load_kernel()
    configs = [c for c in configs.split(",") if c] or ops.cutlass_conv_configs
    wanted = [p for p in layers.split(",") if p]
    for name, shape, c_out, kernel, pad_w, _ in LAYERS:
        if not any(name.startswith(p) for p in wanted):
            continue
        x, w = _operands(shape, c_out, kernel)
        runs = [partial(_cudnn, x, w, pad_w)] + [
            partial(conv_cutlass, ops, x, w, None, pad_w, c) for c in configs
        ]
        for run in runs:
            run()
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        for run in runs:
            run()
            torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"{name}: one launch each of cuDNN, CUTLASS {', '.join(configs)}", flush=True)


def layer_tables(
    repeats: int,
    engines: str,
    layers: str = "",
    triton_tiles: bool = False,
    kernel_names: bool = False,
    configs: str = "",
) -> None:
    """Print the per-layer table and the decode-weighted summary (also `bench_decode.py --conv-layers`)."""
    engine_names = engines.split(",")
    from pan2cli.vae.kernel.build import load_kernel

    ops = load_kernel()
    print(f"CUTLASS tile configurations of this build: {', '.join(ops.cutlass_conv_configs) or 'none'}")
    configs = [c for c in configs.split(",") if c] or ops.cutlass_conv_configs
    print("| layer | engine | ms | TFLOP/s | max abs diff vs cuDNN |")
    print("| --- | --- | ---: | ---: | ---: |")
    wanted = [p for p in layers.split(",") if p]
    best: dict[str, dict[str, tuple[float, float]]] = {}  # engine -> layer -> (TFLOP/s, decode TFLOP)
    for name, shape, c_out, kernel, pad_w, decode_tflop in LAYERS:
        if wanted and not any(name.startswith(p) for p in wanted):
            continue
        x, w = _operands(shape, c_out, kernel)
        c_in = shape[-1]
        cudnn = partial(_cudnn, x, w, pad_w)
        expected = cudnn()
        flop = 2.0 * expected.numel() * c_in * torch.tensor(kernel).prod().item()
        ms = _time(cudnn, repeats)
        print(f"| {name} | cuDNN | {ms:.3f} | {flop / ms / 1e9:.0f} | 0 |", flush=True)
        if kernel_names:
            print(f"  cuDNN kernels: {_kernel_names(cudnn)}", flush=True)
        best.setdefault("cuDNN", {})[name] = (flop / ms / 1e9, decode_tflop)
        if "cutlass" in engine_names and c_in % 64 == 0 and c_out % 64 == 0:
            for config in configs:
                run = partial(conv_cutlass, ops, x, w, None, pad_w, config)
                diff = (run().float() - expected.float()).abs().max().item()
                ms = _time(run, repeats)
                tflops = flop / ms / 1e9
                print(f"| {name} | CUTLASS {config} | {ms:.3f} | {tflops:.0f} | {diff:.3g} |", flush=True)
                if kernel_names:
                    print(f"  CUTLASS {config} kernels: {_kernel_names(run)}", flush=True)
                best.setdefault(f"CUTLASS {config}", {})[name] = (tflops, decode_tflop)
        if "triton" not in engine_names:
            continue
        own = conv_channels_last(x, w, pad_w=pad_w)
        for tiles in TILES if triton_tiles else TILES[:1]:
            run = partial(conv_channels_last, x, w, pad_w=pad_w, tiles=tiles)
            got = run()
            diff = (got.float() - expected.float()).abs().max().item()
            same = "" if tiles is None else (", = own tiles" if torch.equal(got, own) else ", ≠ own tiles")
            ms = _time(run, repeats)
            label = f"Triton {tiles or 'own tiles'}"
            print(f"| {name} | {label} | {ms:.3f} | {flop / ms / 1e9:.0f} | {diff:.3g}{same} |", flush=True)
            if tiles is None:
                best.setdefault("Triton", {})[name] = (flop / ms / 1e9, decode_tflop)
    # A decode's conv time if every layer class ran at the rate measured here (layers an engine cannot
    # run are left out of its row, and of cuDNN's row beside it).
    print("\n| engine | layers | decode TFLOP | seconds at these rates | TFLOP/s averaged over the decode |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for engine, rows in best.items():
        tflop = sum(t for _, t in rows.values())
        seconds = sum(t / (r / 1e3) for r, t in rows.values())
        print(f"| {engine} | {len(rows)} | {tflop:.1f} | {seconds:.3f} | {tflop / seconds * 1e3:.0f} |")


if __name__ == "__main__":
    main()
