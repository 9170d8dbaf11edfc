"""A tiny random PAN 2 checkpoint folder (MMDiT, text model + tokenizer, VAE with encoder), built locally without downloads."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from pan2cli.dit.checkpoint import save_pan2_transformer
from pan2cli.dit.config import PAN2TransformerConfig
from pan2cli.dit.model import PAN2Transformer3DModel
from pan2cli.vae.config import WanVAEConfig
from pan2cli.vae.random_weights import write_test_checkpoints

TEXT_DIM = 16
TINY_DIT = PAN2TransformerConfig(hidden_size=32, num_attention_heads=2, num_layers=2, text_dim=TEXT_DIM, freq_dim=16, rope_axes_dim=(4, 6, 6))
TINY_VAE = WanVAEConfig(base_dim=16, decoder_base_dim=16)
WORDS = "a an the cat dog fox red blue runs jumps over snow street city at night door opens slowly".split()


def _write_text_model(root: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2Model

    vocab = {token: i for i, token in enumerate(["[PAD]", "[UNK]", "[EOS]", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]", eos_token="[EOS]")
    fast.save_pretrained(root / "tokenizer")
    config = Qwen2Config(
        vocab_size=len(vocab), hidden_size=TEXT_DIM, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2Model(config).save_pretrained(root / "text_encoder")


def write_tiny_pan2(root: Path, seed: int = 0) -> Path:
    """Write `root/{transformer,text_encoder,tokenizer,vae}` with random weights; returns `root`."""
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    save_pan2_transformer(PAN2Transformer3DModel(TINY_DIT), root / "transformer")
    _write_text_model(root)
    vae = write_test_checkpoints(root / "_vae", TINY_VAE, seed=seed, formats=("diffusers",))["diffusers"]
    shutil.move(str(vae), root / "vae")
    shutil.rmtree(root / "_vae")
    return root
