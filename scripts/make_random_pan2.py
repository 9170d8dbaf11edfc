"""Write a full-size random-weight PAN 2 repository in the IFM/PAN2 layout (for end-to-end timing on a GPU machine).

Usage: PYTHONPATH=. python scripts/make_random_pan2.py OUT [--device cuda]

The same layout and files as the tiny repository (`pan2cli.testing.tiny_pan2`), at the release's sizes: the 29.2 B transformer at
the default config (bf16, AdaLN linears float32: 67.3 GB in 5 GB shards), a Qwen3.5-9B-shaped text model
(transformers' `Qwen3_5TextConfig()` defaults: hidden 4096, 32 layers; bf16, ~18 GB), the full Wan2.2 VAE
(float32) and the tiny repo's tokenizer (its ids fit any vocabulary). Weights are drawn on `--device` (fast
on a GPU) and written as they are drawn; about 88 GB of disk. Random weights make noise videos: this is for
seconds and memory, not pictures.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pan2cli.dit.checkpoint import keeps_fp32, save_pan2_transformer  # noqa: E402
from pan2cli.dit.model import PAN2Transformer3DModel  # noqa: E402
from pan2cli.dit.quantize import Fp8Policy, quantize_block  # noqa: E402
from pan2cli.testing.tiny_pan2 import write_scheduler_and_index, write_tokenizer, write_vae  # noqa: E402
from pan2cli.testing.transformers_logging import quiet_transformers  # noqa: E402
from pan2cli.vae.config import WanVAEConfig  # noqa: E402

SHARD_BYTES = 5 * 10**9


def _randomise(model: torch.nn.Module, device: torch.device, seed: int) -> None:
    """Matrices N(0, 1/fan_in), vectors 0.02-scale noise (around 1 for norm weights), drawn on `device`."""
    generator = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, param[0].numel() ** -0.5, generator=generator)
            else:
                centre = 1.0 if "norm" in name and "linear" not in name else 0.0
                param.normal_(centre, 0.02, generator=generator)


def random_transformer(
    device: torch.device, seed: int = 0, precision: str = "bf16", policy=None, **config
) -> PAN2Transformer3DModel:
    """The transformer (release config unless `config` changes it) with random weights on `device`: bf16, AdaLN float32.

    Each top-level part and each block draws from its own generator (seed + its index), and is made on the
    device one at a time, so that `precision="fp8"` (`pan2cli.dit.quantize`, with `policy`) quantises a block
    as soon as it exists: the bf16 model is never whole on the device, and the fp8 model's weights are the
    bf16 model's of the same seed, quantised.
    """
    with torch.device("meta"):
        model = PAN2Transformer3DModel(**config)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for name, param in model.named_parameters():
        param.data = torch.empty_like(
            param, dtype=torch.float32 if keeps_fp32(name) else dtype, device="meta"
        )
    others = [module for name, module in model.named_children() if name != "transformer_blocks"]
    for index, part in enumerate(others):
        part.to_empty(device=device)
        _randomise(part, device, seed + index)
    policy = policy or Fp8Policy()
    for index, block in enumerate(model.transformer_blocks):
        block.to_empty(device=device)
        _randomise(block, device, seed + len(others) + index)
        if precision == "fp8" and index not in policy.bf16_blocks:
            quantize_block(block, policy)
    embedding = torch.empty(model.context_type_embedding.shape, dtype=dtype, device=device)
    embedding.normal_(
        0.0,
        0.02,
        generator=torch.Generator(device).manual_seed(seed + len(others) + len(model.transformer_blocks)),
    )
    model.context_type_embedding = torch.nn.Parameter(embedding, requires_grad=False)
    model.precision = precision
    return model.eval().requires_grad_(False)


def random_text_model(vocab_size: int, device: torch.device, seed: int = 1, **overrides):
    """A Qwen3.5-9B-shaped `Qwen3_5TextModel` (transformers' defaults) with random bf16 weights on `device`."""
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    config = Qwen3_5TextConfig(**{"vocab_size": max(vocab_size, Qwen3_5TextConfig().vocab_size), **overrides})
    with torch.device("meta"):
        model = Qwen3_5TextModel(config)
    model = model.to(torch.bfloat16).to_empty(device=device)
    _randomise(model, device, seed)
    return model.eval()


def write_random_pan2(
    root: Path, device: torch.device, transformer_dir: Path | None = None
) -> dict[str, float]:
    """Write every component into `root` (the transformer into `transformer_dir`, linked from `root`); returns the seconds each took."""
    root.mkdir(parents=True, exist_ok=True)
    seconds: dict[str, float] = {}
    start = time.perf_counter()
    with quiet_transformers():
        tokenizer = write_tokenizer(root / "tokenizer")
        text_model = random_text_model(len(tokenizer), device)
        text_model.save_pretrained(str(root / "text_encoder"), max_shard_size="5GB")
    del text_model
    seconds["text_encoder"] = time.perf_counter() - start
    start = time.perf_counter()
    model = random_transformer(device)
    save_pan2_transformer(model, transformer_dir or root / "transformer", max_shard_bytes=SHARD_BYTES)
    if transformer_dir is not None:
        (root / "transformer").symlink_to(transformer_dir.resolve(), target_is_directory=True)
    del model
    seconds["transformer"] = time.perf_counter() - start
    start = time.perf_counter()
    write_vae(root / "vae", seed=0, config=WanVAEConfig())
    seconds["vae"] = time.perf_counter() - start
    write_scheduler_and_index(root, type(tokenizer).__name__)
    return seconds


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option(
    "--device",
    default="cuda" if torch.cuda.is_available() else "cpu",
    show_default=True,
    help="Where the weights are drawn.",
)
@click.option(
    "--transformer-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
    help="Write the transformer's 67 GB there (another disk, or a tmpfs) and link OUT/transformer to it.",
)  # fmt: skip
def main(out: Path, device: str, transformer_dir: Path | None) -> None:
    """Write a full-size random-weight PAN 2 repository in the IFM/PAN2 layout to OUT (~88 GB)."""
    seconds = write_random_pan2(out, torch.device(device), transformer_dir)
    click.echo(json.dumps({"out": str(out), "seconds": {k: round(v, 1) for k, v in seconds.items()}}))


if __name__ == "__main__":
    main()
