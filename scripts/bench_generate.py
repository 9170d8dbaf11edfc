"""Benchmark `VideoGenerator` end to end on one GPU with random weights (no downloads): switches on, then off.

Builds, in a temporary folder: a mid-sized random MMDiT (default hidden 3072, 16 blocks, 24 heads x 128),
a tiny random Qwen2 text encoder + WordLevel tokenizer, and the full-size random Wan2.2 VAE
(`pan2cli.vae.random_weights`, bf16 on disk). Then runs 704x1248, 121 frames, 4 steps, guidance 2.5
twice — `vae_decode_kernel="auto"`, `dit_fused_kernels=True`, `vae_decode_kernel_parallel=True`, then
"off"/False/False — and prints each run's per-stage seconds and peak GPU memory (the first run also
pays the decode kernel's build, shown as the decoder load time).

Usage: python scripts/bench_generate.py [--hidden 3072 --layers 16 --heads 24 --steps 4 --frames 121 --size 704x1248]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

from pan2cli.dit.checkpoint import save_pan2_transformer
from pan2cli.dit.config import PAN2TransformerConfig
from pan2cli.dit.model import PAN2Transformer3DModel
from pan2cli.pipeline import PAN2PipelineConfig, VideoGenerator
from pan2cli.vae.config import WanVAEConfig
from pan2cli.vae.random_weights import write_test_checkpoints


def build_checkpoint(root: Path, hidden: int, layers: int, heads: int, text_dim: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2Model

    start = time.perf_counter()
    head_dim = hidden // heads
    t_dim = head_dim - 2 * (head_dim * 3 // 8)  # Wan's split: 44/42/42 of 128
    dit = PAN2TransformerConfig(hidden_size=hidden, num_attention_heads=heads, num_layers=layers, text_dim=text_dim,
                                rope_axes_dim=(t_dim, head_dim * 3 // 8, head_dim * 3 // 8))
    with torch.device("cuda"):  # random init on the GPU (seconds, not minutes), saved in bf16
        model = PAN2Transformer3DModel(dit).to(torch.bfloat16)
    print(f"DiT: {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters", flush=True)
    save_pan2_transformer(model, root / "transformer")
    del model
    torch.cuda.empty_cache()
    words = "a skater drops into a bowl at dusk the camera follows".split()
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[EOS]", *dict.fromkeys(words)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]").save_pretrained(root / "tokenizer")
    Qwen2Model(Qwen2Config(vocab_size=len(vocab), hidden_size=text_dim, intermediate_size=2 * text_dim, num_hidden_layers=2,
                           num_attention_heads=8, num_key_value_heads=2)).save_pretrained(root / "text_encoder")
    vae = write_test_checkpoints(root / "_vae", WanVAEConfig(), dtype=torch.bfloat16, formats=("diffusers",))["diffusers"]
    vae.rename(root / "vae")
    print(f"checkpoint built in {time.perf_counter() - start:.1f} s", flush=True)


def run(root: Path, switches: bool, args) -> dict:
    config = PAN2PipelineConfig(
        device="cuda", dtype="bf16", vae_decode_kernel="auto" if switches else "off",
        vae_decode_kernel_parallel=switches, dit_fused_kernels=switches,
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
    parser.add_argument("--hidden", type=int, default=3072)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--text-dim", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--frames", type=int, default=121)
    parser.add_argument("--size", default="704x1248")
    args = parser.parse_args()
    args.height, args.width = (int(v) for v in args.size.split("x"))
    if not torch.cuda.is_available():
        sys.exit("bench_generate.py needs a CUDA GPU")
    print(f"{torch.cuda.get_device_name()} | torch {torch.__version__} | {args.size}, {args.frames} frames, {args.steps} steps, "
          f"DiT hidden {args.hidden} x {args.layers} blocks, {args.heads} heads", flush=True)
    with tempfile.TemporaryDirectory(prefix="pan2-bench-") as folder:
        root = Path(folder)
        build_checkpoint(root, args.hidden, args.layers, args.heads, args.text_dim)
        for switches in (True, False):
            print(json.dumps(run(root, switches, args)), flush=True)


if __name__ == "__main__":
    main()
