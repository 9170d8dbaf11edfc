"""Row-split multi-GPU Wan2.2 VAE decode against one GPU, same code path, in one job: time, speed-up, memory, equality.

Usage: python scripts/bench_decode_multigpu.py [--gpus 2] [--latent-shape 1,48,31,44,78]
       [--chunk-latent-frames 4] [--repeats 3] [--out results.json]
       [--trace]  (where the split's bf16 rounding first departs from one GPU's: every stage's rows checksummed)
       (smoke test of the script without GPUs: --device cpu --decoder-base-dim 16 --latent-shape 1,48,3,5,3)

Launches itself under torch.distributed.run with `--gpus` processes (NCCL; NCCL_* settings such as
NCCL_NVLS_ENABLE=0 pass through). Every rank builds the full-size decoder with random weights (γ and
biases perturbed, `pan2cli.testing.random_weights`) in bf16 and the same random latents. The 1-GPU baseline
is `pan2cli.vae.decoder.decode_latents` on rank 0 alone with the row split switched off
(`split_rows=False`; the other ranks wait); the N-GPU run is the same function on every
rank with the split on (uint8 rows all-gathered per chunk). Both collect the uint8 frames on the host,
as the CLI does before writing. Timing: median decode seconds over `--repeats` runs after one warm-up
(`DecodeStats.seconds`, CUDA-synchronised). Memory: `max_memory_allocated` / `max_memory_reserved`
during the decode, weights included (1.11 GB bf16), per rank. Equality: N-GPU frames against the
1-GPU frames, max |diff| in uint8 levels and the fraction of values that differ. Prints a markdown
table last; rank 0 writes `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist

from pan2cli import distributed
from pan2cli.distributed.protocol import under_torchrun
from pan2cli.testing.random_weights import random_decoder
from pan2cli.vae.config import WanVAEConfig
from pan2cli.vae.decoder import decode_latents
from pan2cli.vae.kernel.choice import select_decode_path
from pan2cli.vae.kernel.decoder import WanKernelDecoder
from pan2cli.vae.model import WanVAEDecoder

GIB = 2**30


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=2, help="GPUs of the split decode (≥ 2).  [default: 2]")
    parser.add_argument(
        "--latent-shape",
        default="1,48,31,44,78",
        help="B,C,T,H,W of the latents.  [default: 5 s at 704x1248]",
    )
    parser.add_argument(
        "--chunk-latent-frames",
        type=int,
        default=4,
        help="Latent frames per pass after the first.  [default: 4]",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="Timed runs after the warm-up (median reported).  [default: 3]"
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the weights and latents.  [default: 0]")
    parser.add_argument("--out", default=None, help="Also write the results as JSON here.")
    parser.add_argument(
        "--dtype",
        choices=("bf16", "fp32"),
        default="bf16",
        help="bf16, or IEEE fp32 (reference path only) to separate the split's exactness from bf16 rounding order.  [default: bf16]",
    )
    parser.add_argument(
        "--decode-kernel",
        choices=("auto", "off", "require"),
        default="auto",
        help="Decode path, the same for 1 and N GPUs: the compiled kernel (auto/require) or the reference (off).  [default: auto]",
    )
    parser.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default="cuda",
        help="cpu: gloo processes, to test the script.  [default: cuda]",
    )
    parser.add_argument(
        "--trace",
        action="store_true",
        help="No timing: one decode each way with every stage output checksummed per row; prints where the split first departs from one GPU.",
    )
    parser.add_argument(
        "--decoder-base-dim",
        type=int,
        default=256,
        help="Decoder width unit (256 is the real model).  [default: 256]",
    )
    args = parser.parse_args(argv)
    args.latent_shape = tuple(int(v) for v in args.latent_shape.split(","))
    if len(args.latent_shape) != 5 or args.latent_shape[0] != 1:
        parser.error("--latent-shape must be 1,48,T,H,W (one video)")
    if args.gpus < 2 or args.repeats < 1 or args.chunk_latent_frames < 1:
        parser.error("--gpus must be ≥ 2, --repeats and --chunk-latent-frames ≥ 1")
    return args


def launch(args: argparse.Namespace, argv: list[str]) -> int:
    """Check the machine, then run this script in `--gpus` processes under torchrun."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.device == "cuda" and visible < args.gpus:
        print(f"error: --gpus {args.gpus} needs {args.gpus} CUDA GPUs; {visible} visible", file=sys.stderr)
        return 2
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(args.gpus),
        __file__,
        *argv,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "4")}
    return subprocess.run(cmd, env=env).returncode


class FrameCollector:
    """A writer that keeps the uint8 frames on the host (the CLI's writers take the same chunks)."""

    def __init__(self):
        self.chunks: list[torch.Tensor] = []

    def write(self, frames: torch.Tensor) -> None:
        self.chunks.append(frames.clone())

    def video(self) -> torch.Tensor:
        return torch.cat(self.chunks)


def build_decoder(seed: int, device: torch.device, base_dim: int, fp32: bool = False) -> WanVAEDecoder:
    """The decoder (full size by default) in bf16 (fp32 on CPU or with `fp32`) with random weights, built on the meta device and loaded in place."""
    dtype = torch.bfloat16 if device.type == "cuda" and not fp32 else torch.float32
    return random_decoder(WanVAEConfig(decoder_base_dim=base_dim), seed=seed, dtype=dtype, device=device)


def timed_runs(
    decoder, z, args, keep_frames: bool, split_rows: bool = True
) -> tuple[list[float], dict, torch.Tensor | None]:
    """One warm-up and `--repeats` decodes; returns the seconds, the last run's peak memory, the frames (if kept)."""
    seconds, frames = [], None
    for i in range(1 + args.repeats):
        writer = FrameCollector() if keep_frames else None
        stats = decode_latents(
            decoder, z, writer, chunk_latent_frames=args.chunk_latent_frames, split_rows=split_rows
        )
        if i > 0:
            seconds.append(stats.seconds)
        if writer is not None and i == 0:
            frames = writer.video()
        memory = {"allocated": stats.peak_allocated, "reserved": stats.peak_reserved}
    return seconds, memory, frames


class StageTrace:
    """Per-row checksums of every stage output of a decode, in call order (bitwise: a checksum of the bits).

    Kernel path: the outputs of each conv (`_norm_conv`), resampler, attention and the head. Reference
    path: every causal conv, residual block and resampler (forward hooks). Rows are the frame's rows, so a
    split's bands, put together in rank order, compare row for row with one GPU's whole frames.
    """

    def __init__(self, decoder):
        self.records: list[tuple[str, torch.Tensor]] = []
        self.enabled = False
        if isinstance(decoder, WanKernelDecoder):
            for method in ("_norm_conv", "_upsample", "_attention", "_head"):
                self._wrap(decoder, method)
        else:
            from pan2cli.vae.model import WanCausalConv3d, WanResample, WanResidualBlock

            for name, module in decoder.named_modules():
                if isinstance(module, (WanCausalConv3d, WanResample, WanResidualBlock)):
                    module.register_forward_hook(
                        lambda m, args, out, name=name: self._record(name, out, row_dim=3)
                    )

    def _wrap(self, decoder, method: str) -> None:
        original = getattr(decoder, method)

        def traced(*args, **kwargs):
            out = original(*args, **kwargs)
            name = args[0] if args and isinstance(args[0], str) else method.strip("_")
            self._record(name, out.z if hasattr(out, "z") else out, row_dim=2)
            return out

        setattr(decoder, method, traced)

    def _record(self, name: str, out: torch.Tensor, row_dim: int) -> None:
        if not self.enabled:
            return
        bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[out.element_size()]
        rows = out.contiguous().view(bits).movedim(row_dim, 0).reshape(out.shape[row_dim], -1).to(torch.int64)
        weights = torch.arange(rows.shape[1], device=rows.device) % 8191 + 1  # catches swapped values too
        self.records.append((name, torch.stack([rows.sum(1), (rows * weights).sum(1)], dim=1).cpu()))


def compare_traces(one: list, bands: list[list]) -> None:
    """Print where the split's stage outputs (bands in rank order) first differ from one GPU's."""
    if any(len(b) != len(one) for b in bands):
        print(f"the traces have different lengths: 1 GPU {len(one)}, ranks {[len(b) for b in bands]}")
    differing = []
    for i, (name, whole) in enumerate(one):
        joined = torch.cat([b[i][1] for b in bands])
        names = {b[i][0] for b in bands}
        if names != {name} or joined.shape != whole.shape:
            print(
                f"stage {i}: {name} vs {sorted(names)}, rows {tuple(whole.shape)} vs {tuple(joined.shape)}: traces out of step"
            )
            return
        rows = (joined != whole).any(dim=1).nonzero().flatten().tolist()
        if rows:
            differing.append((i, name, rows, whole.shape[0]))
    print(f"{len(differing)} of {len(one)} stage outputs differ from one GPU's")
    for i, name, rows, total in differing[:12]:
        print(f"  stage {i:5d} {name}: {len(rows)} of {total} rows differ, first {rows[:8]}")


def trace_run(args: argparse.Namespace, decoder, z, rank: int) -> None:
    """One decode on rank 0 alone, one split decode, every stage checksummed; rank 0 compares."""
    trace = StageTrace(decoder)
    one = []
    if rank == 0:
        trace.enabled = True
        decode_latents(decoder, z, None, chunk_latent_frames=args.chunk_latent_frames, split_rows=False)
        one, trace.records = trace.records, []
    dist.barrier()
    trace.enabled = True
    decode_latents(decoder, z, None, chunk_latent_frames=args.chunk_latent_frames)
    trace.enabled = False
    bands = [None] * distributed.world_size()
    dist.all_gather_object(bands, trace.records)
    if rank == 0:
        compare_traces(one, bands)


def worker(args: argparse.Namespace) -> None:
    with distributed.process_group(args.device) as device:
        rank, world = distributed.rank(), distributed.world_size()
        start = time.perf_counter()
        decoder = build_decoder(args.seed, device, args.decoder_base_dim, fp32=args.dtype == "fp32")
        decoder, note = select_decode_path(decoder, args.decode_kernel)
        path = "compiled kernel" if isinstance(decoder, WanKernelDecoder) else "reference decoder"
        if not distributed.agree_all(path == "compiled kernel") and path == "compiled kernel":
            raise SystemExit("not every rank could load the compiled kernel")
        z = torch.randn(args.latent_shape, generator=torch.Generator().manual_seed(args.seed + 1))
        load_s = time.perf_counter() - start
        if rank == 0:
            print(
                f"built the decoder ({path}) in {load_s:.1f} s on {world} ranks; latents {list(args.latent_shape)}",
                flush=True,
            )
            if note:
                print(note, flush=True)

        if args.trace:
            trace_run(args, decoder, z, rank)
            return

        # 1. One GPU: rank 0 alone, row split off (same function, no collectives); the others wait.
        base = None
        if rank == 0:
            base = timed_runs(decoder, z, args, keep_frames=True, split_rows=False)
            print(f"1 GPU: {', '.join(f'{s:.3f}' for s in base[0])} s", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
        dist.barrier()

        # 2. N GPUs: every rank decodes its rows; rank 0 collects the gathered frames.
        split = timed_runs(decoder, z, args, keep_frames=rank == 0)
        per_rank = [None] * world
        dist.all_gather_object(per_rank, {"rank": rank, "seconds": split[0], "memory": split[1]})
        if rank != 0:
            return
        print(f"{world} GPUs: {', '.join(f'{s:.3f}' for s in split[0])} s (rank 0)", flush=True)
        report(args, world, base, per_rank, frame_equality(base[2], split[2]))


def frame_equality(one: torch.Tensor, split: torch.Tensor) -> dict:
    """uint8 frames (F, H, W, 3) of the split decode against one GPU's: max |diff|, the fraction of values
    that differ, and which frames differ (where a difference enters tells which chunk or stage to look at)."""
    diff = (one.int() - split.int()).abs()
    per_frame = (diff > 0).flatten(1).double().mean(1)
    differing = [i for i, fraction in enumerate(per_frame.tolist()) if fraction > 0]
    return {
        "max_abs_diff": int(diff.max()),
        "fraction_differing": float((diff > 0).double().mean()),
        "frames_differing": differing,
        "fraction_differing_per_frame": [round(v, 6) for v in per_frame.tolist()],
    }


def _gib(n: int | None) -> str:
    return "n/a" if n is None else f"{n / GIB:.2f}"


def report(args, world: int, base, per_rank: list[dict], equality: dict) -> None:
    base_s = statistics.median(base[0])
    split_s = statistics.median(per_rank[0]["seconds"])  # every rank ends together at the last all-gather
    results = {
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "latent_shape": list(args.latent_shape),
        "chunk_latent_frames": args.chunk_latent_frames,
        "repeats": args.repeats,
        "one_gpu": {"seconds": base[0], "median_s": base_s, "memory": base[1]},
        "n_gpus": {"gpus": world, "median_s": split_s, "per_rank": per_rank},
        "speedup": base_s / split_s,
        "equality_uint8": equality,
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    peak = max(r["memory"]["allocated"] or 0 for r in per_rank)
    print()
    print("| GPUs | median decode s | speed-up | peak allocated GiB | peak reserved GiB |")
    print("| --- | --- | --- | --- | --- |")
    print(f"| 1 | {base_s:.3f} | 1.00x | {_gib(base[1]['allocated'])} | {_gib(base[1]['reserved'])} |")
    allocated = " / ".join(_gib(r["memory"]["allocated"]) for r in per_rank)
    reserved = " / ".join(_gib(r["memory"]["reserved"]) for r in per_rank)
    print(f"| {world} | {split_s:.3f} | {base_s / split_s:.2f}x | {allocated} (per rank) | {reserved} |")
    print()
    print(
        f"uint8 frames, {world} GPUs vs 1: max |diff| {equality['max_abs_diff']}, "
        f"{100 * equality['fraction_differing']:.4f} % of values differ; "
        f"peak per rank {'≤' if peak <= (base[1]['allocated'] or 0) else '>'} 1-GPU peak"
    )
    frames = equality["frames_differing"]
    if frames:
        print(
            f"frames that differ: {len(frames)} of {len(equality['fraction_differing_per_frame'])}, {_ranges(frames)}"
        )


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 7, 9, 10] -> "0-2, 7, 9-10"."""
    spans = [[indices[0], indices[0]]]
    for i in indices[1:]:
        if i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(f"{a}-{b}" if b != a else f"{a}" for a, b in spans)


def main() -> int:
    argv = sys.argv[1:]
    args = parse_args(argv)
    if not under_torchrun():
        return launch(args, argv)
    worker(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
