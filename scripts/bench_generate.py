"""Benchmark `VideoGenerator` end to end on one GPU with random weights (no downloads): switches on, then off.

Builds, in a temporary folder, a repository in the IFM/PAN2 layout (scripts/make_random_pan2.py's writers):
the PAN 2 transformer with fewer blocks (default 16 of 44, heads 32 x 128 as released), a Qwen3.5 text model
of width 4096 with 4 layers, the tiny repo's tokenizer and the full-size random Wan2.2 VAE. Then runs
704x1248, 121 frames, 4 steps, guidance 2.5 twice — `decode_kernel="auto"`, `dit_fused_kernels=True`,
`decode_kernel_parallel=True`, then "off"/False/False — and prints each run's per-stage seconds and peak
GPU memory (the first run also pays the decode kernel's build, shown as the decoder load time). For the
full-size model, time `pan2 generate` on `scripts/make_random_pan2.py`'s repository (docs/BENCHMARKS.md).

Usage: PYTHONPATH=. python scripts/bench_generate.py [--layers 16 --text-layers 4 --steps 4 --frames 121 --size 704x1248]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pan2cli.config import RuntimeConfig  # noqa: E402
from pan2cli.dit.checkpoint import save_pan2_transformer  # noqa: E402
from pan2cli.pipeline import VideoGenerator  # noqa: E402
from pan2cli.testing.tiny_pan2 import write_scheduler_and_index, write_tokenizer, write_vae  # noqa: E402
from pan2cli.testing.transformers_logging import quiet_transformers  # noqa: E402
from pan2cli.vae.config import WanVAEConfig  # noqa: E402
from scripts.make_random_pan2 import random_text_model, random_transformer  # noqa: E402


def build_checkpoint(root: Path, layers: int, text_layers: int) -> None:
    device = torch.device("cuda")
    with quiet_transformers():
        tokenizer = write_tokenizer(root / "tokenizer")
        random_text_model(len(tokenizer), device, num_hidden_layers=text_layers).save_pretrained(
            str(root / "text_encoder")
        )
    save_pan2_transformer(
        random_transformer(device, num_layers=layers), root / "transformer", max_shard_bytes=5 * 10**9
    )
    write_vae(root / "vae", seed=0, config=WanVAEConfig())
    write_scheduler_and_index(root, type(tokenizer).__name__)


def run(root: Path, switches: bool, args) -> dict:
    config = RuntimeConfig(
        device="cuda", dtype="bf16", decode_kernel="auto" if switches else "off",
        decode_kernel_parallel=switches, dit_fused_kernels=switches,
    )  # fmt: skip
    notes = []
    generator = VideoGenerator.from_pretrained(root, config=config, info=notes.append)
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result = generator.generate(
        "a skater drops into a bowl at dusk", preset="pan2-5s", steps=args.steps, frames=args.frames,
        height=args.height, width=args.width, guidance=2.5,
    )  # fmt: skip
    total = time.perf_counter() - start
    return {
        "switches": "on" if switches else "off",
        "frames": list(result.frames.shape),
        "seconds": {k: round(v, 2) for k, v in result.seconds.items()},
        "total_s": round(total, 2),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        "notes": notes,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16, help="transformer blocks (the release has 44)")
    parser.add_argument("--text-layers", type=int, default=4, help="text model layers (Qwen3.5-9B has 32)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--frames", type=int, default=121)
    parser.add_argument("--size", default="704x1248")
    args = parser.parse_args()
    args.height, args.width = (int(v) for v in args.size.split("x"))
    if not torch.cuda.is_available():
        sys.exit("bench_generate.py needs a CUDA GPU")
    print(
        f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.size}, {args.frames} frames, {args.steps} steps, "
        f"transformer {args.layers} blocks, text model {args.text_layers} layers",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="pan2-bench-") as folder:
        root = Path(folder)
        build_checkpoint(root, args.layers, args.text_layers)
        for switches in (True, False):
            print(json.dumps(run(root, switches, args)), flush=True)


if __name__ == "__main__":
    main()
