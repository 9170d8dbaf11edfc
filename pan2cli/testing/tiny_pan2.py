"""A tiny random-weight PAN 2 repository in the IFM/PAN2 release layout, written offline in a few seconds (the tests' fixture).

Layout (a Modular Diffusers repository, as IFM/PAN2 on the Hugging Face hub; vLLM-Omni and diffusers load it by
the component subfolders of its `modular_model_index.json`):

    OUT/modular_model_index.json     PAN2ModularPipeline and one loading spec per component
    OUT/transformer/                 PAN2Transformer3DModel, the release's key names, sharded safetensors + index,
                                     AdaLN linears (norm1.linear, norm_out.linear) float32, the rest bfloat16
    OUT/text_encoder/                Qwen3_5TextModel (config.json model_type qwen3_5_text, model.safetensors, bf16);
                                     `multimodal_text_encoder` writes a Qwen3_5ForConditionalGeneration (qwen3_5,
                                     a tiny vision tower) holding the same language-model values
    OUT/tokenizer/                   byte-level BPE (Qwen3.5's pre-tokenizer) with <|endoftext|>, <|im_start|>,
                                     <|im_end|> and a ChatML chat template
    OUT/vae/                         Wan2.2 VAE (AutoencoderKLWan, encoder + decoder), diffusers layout
    OUT/scheduler/                   FlowMatchEulerDiscreteScheduler config (shift 9; `scheduler_options` set or
                                     add keys, e.g. shift_terminal=0.1 or stochastic_sampling=true)

Every weight is random (seeded) and away from zero, so that every path of the model changes the output. The
command line is `scripts/make_tiny_pan2.py`; transformers and tokenizers are needed (the `test` extra).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch

from pan2cli.dit.checkpoint import save_pan2_transformer
from pan2cli.dit.model import PAN2RMSNorm, PAN2Transformer3DModel
from pan2cli.testing.random_weights import write_test_checkpoints
from pan2cli.testing.transformers_logging import quiet_transformers
from pan2cli.vae.config import WanVAEConfig

DIFFUSERS_VERSION = "0.37.0"
TEXT_HIDDEN = 32
# The release's constructor keys at a tiny size; the other keys (in 97, out 48, ratios, RoPE θ) keep their defaults.
TINY_TRANSFORMER = {
    "num_attention_heads": 2, "attention_head_dim": 16, "rope_axes_dim": (4, 6, 6),
    "num_layers": 2, "num_refiner_layers": 1, "text_embed_dim": TEXT_HIDDEN,
}  # fmt: skip
# Four layers (three linear-attention, one full-attention: Qwen3.5's pattern), so hidden_states[-3] is neither
# the last layer's output nor the one before it.
TINY_TEXT = {
    "hidden_size": TEXT_HIDDEN, "intermediate_size": 64, "num_hidden_layers": 4, "num_attention_heads": 2,
    "num_key_value_heads": 1, "head_dim": 16, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "max_position_embeddings": 4096, "initializer_range": 0.1,
}  # fmt: skip
TINY_VISION = {
    "depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "out_hidden_size": TEXT_HIDDEN,
    "num_position_embeddings": 16, "patch_size": 4,
}  # fmt: skip
TINY_VAE = WanVAEConfig(base_dim=16, decoder_base_dim=16)
SCHEDULER_CONFIG = {
    "_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": DIFFUSERS_VERSION,
    "num_train_timesteps": 1000, "shift": 9.0, "use_dynamic_shifting": False,
}  # fmt: skip

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Qwen3.5's pre-tokenizer split (transformers' Qwen3_5Tokenizer uses the same pattern): a newline is its own piece,
# so "<|im_start|>user\n" gives the same ids alone and inside the rendered template.
PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
CORPUS = (
    "system user assistant",
    "You are a helpful assistant. Generate the video with the following instructions.",
    "A red fox runs across the snow at night while the camera pans slowly to the left.",
    "The door opens and a cat walks into the city street; rain falls on the cars.",
    "Shot one\n\nShot two\n\nShot three",  # "\n\n" becomes one token, as in Qwen's vocabulary
)
# ChatML: `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then the assistant header. Qwen3.5's own
# template may add a thinking block after the header; the PAN 2 recipe keeps whatever the template renders.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def write_tokenizer(folder: Path):
    """A byte-level BPE (any text encodes) trained on `CORPUS`, with the ChatML specials and template; returns it."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512, min_frequency=1, show_progress=False, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator(CORPUS, trainer)  # deterministic: same merges in every process
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, eos_token="<|im_end|>", pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"], chat_template=CHAT_TEMPLATE,
    )  # fmt: skip
    fast.save_pretrained(str(folder))
    return fast


def tiny_text_model(vocab_size: int, seed: int):
    """A random `Qwen3_5TextModel` at `TINY_TEXT`, bfloat16 as Qwen3.5 is released; norm weights moved off their init."""
    from transformers import Qwen3_5TextConfig, Qwen3_5TextModel

    torch.manual_seed(seed)
    model = Qwen3_5TextModel(Qwen3_5TextConfig(vocab_size=vocab_size, **TINY_TEXT))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # zeros (1 + w) or ones at init: make them matter
                param.add_(0.1 * torch.randn_like(param))
    return model.to(torch.bfloat16).eval()


def write_text_encoder(folder: Path, model, multimodal: bool = False) -> None:
    """Save `model` as `Qwen3_5TextModel` (config qwen3_5_text), or inside a tiny multimodal Qwen3.5 (config qwen3_5).

    The multimodal one is a `Qwen3_5ForConditionalGeneration`, whose language model is saved under
    `model.language_model.` beside `model.visual.*` and `lm_head.weight`, as Qwen releases Qwen3.5.
    """
    from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    if not multimodal:
        model.save_pretrained(str(folder))
        return
    config = Qwen3_5Config(text_config=model.config.to_dict(), vision_config=TINY_VISION)
    full = Qwen3_5ForConditionalGeneration(config).to(torch.bfloat16)
    full.model.language_model.load_state_dict(model.state_dict(), strict=True)
    full.save_pretrained(str(folder))


def tiny_transformer(seed: int) -> PAN2Transformer3DModel:
    """`PAN2Transformer3DModel` at `TINY_TRANSFORMER`, every parameter random and away from zero, in the release's dtypes.

    Matrices N(0, 1/fan_in) (signals keep their size through the blocks), biases N(0, 0.05²), RMSNorm weights
    1 + N(0, 0.1²), the text modulation tables and the type embedding N(0, 0.1²); then bfloat16, except the
    AdaLN linears (`keep_in_fp32_modules`) in float32 as in the release.
    """
    torch.manual_seed(seed)
    model = PAN2Transformer3DModel(**TINY_TRANSFORMER)
    norms = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, PAN2RMSNorm)}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name in norms:
                param.copy_(1 + 0.1 * torch.randn_like(param))
            elif param.dim() >= 2:
                param.normal_(0.0, 1 / math.sqrt(param[0].numel()))
            elif name.endswith(".bias"):
                param.normal_(0.0, 0.05)
            else:  # scale_shift_table_context, context_type_embedding
                param.normal_(0.0, 0.1)
    model.to(torch.bfloat16)
    for name in PAN2Transformer3DModel.keep_in_fp32_modules:
        for path, module in model.named_modules():
            if path == name or path.endswith(f".{name}"):
                module.float()
    return model.eval()


def write_transformer(folder: Path, model: PAN2Transformer3DModel) -> None:
    """`config.json` (with `_diffusers_version`) and the weights in at least two shards with an index."""
    total = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    save_pan2_transformer(model, folder, max_shard_bytes=total // 2 + 1)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "_diffusers_version": DIFFUSERS_VERSION}, indent=2) + "\n")


def write_vae(folder: Path, seed: int, config: WanVAEConfig = TINY_VAE) -> None:
    """A random Wan2.2 VAE (encoder + decoder; the tiny one by default), diffusers layout, float32 as released."""
    scratch = folder.parent / f".{folder.name}.tmp"
    written = write_test_checkpoints(scratch, config, seed=seed, formats=("diffusers",))["diffusers"]
    shutil.move(str(written), str(folder))
    shutil.rmtree(scratch)


def write_modular_index(root: Path, tokenizer_class: str) -> None:
    """`modular_model_index.json` as diffusers' `ModularPipeline.save_pretrained` writes it: name → [library, class, spec]."""
    components = {
        "transformer": ("diffusers", "PAN2Transformer3DModel"),
        "text_encoder": ("transformers", "Qwen3_5TextModel"),
        "tokenizer": ("transformers", tokenizer_class),
        "vae": ("diffusers", "AutoencoderKLWan"),
        "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
    }
    index: dict = {"_class_name": "PAN2ModularPipeline", "_diffusers_version": DIFFUSERS_VERSION}
    for name, (library, class_name) in components.items():
        spec = {
            "type_hint": [library, class_name],
            "pretrained_model_name_or_path": None,
            "subfolder": name,
            "variant": None,
            "revision": None,
        }
        index[name] = [library, class_name, spec]
    (root / "modular_model_index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_scheduler_config(root: Path, options: dict | None = None) -> Path:
    """`scheduler/scheduler_config.json`: `SCHEDULER_CONFIG` with `options` set over it (a value None drops the key)."""
    config = {**SCHEDULER_CONFIG, **(options or {})}
    path = root / "scheduler" / "scheduler_config.json"
    path.parent.mkdir(exist_ok=True)
    path.write_text(json.dumps({k: v for k, v in config.items() if v is not None}, indent=2) + "\n")
    return path


def write_scheduler_and_index(
    root: Path, tokenizer_class: str, scheduler_options: dict | None = None
) -> None:
    """`scheduler/scheduler_config.json` and `modular_model_index.json`, the repository's small files."""
    write_scheduler_config(root, scheduler_options)
    write_modular_index(root, tokenizer_class)


def write_tiny_pan2(
    root: str | Path,
    seed: int = 0,
    multimodal_text_encoder: bool = False,
    scheduler_options: dict | None = None,
) -> Path:
    """Write the tiny repository into `root` (created; its component folders must not exist yet); returns `root`.

    Args:
        root: the repository folder.
        seed (`int`, defaults to 0): the same seed writes the same values.
        multimodal_text_encoder (`bool`, defaults to False): write `text_encoder/` as a multimodal Qwen3.5
            checkpoint (config qwen3_5, vision tower included) instead of the text model alone.
        scheduler_options (`dict`, *optional*): keys set over `SCHEDULER_CONFIG` (a value None drops the key).
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    # Leave the caller's random state alone; transformers' progress bars and notes are not the writer's output.
    with torch.random.fork_rng(devices=[]), quiet_transformers():
        tokenizer = write_tokenizer(root / "tokenizer")
        write_text_encoder(
            root / "text_encoder", tiny_text_model(len(tokenizer), seed), multimodal_text_encoder
        )
        write_transformer(root / "transformer", tiny_transformer(seed + 1))
    write_vae(root / "vae", seed)
    write_scheduler_and_index(root, type(tokenizer).__name__, scheduler_options)
    return root
