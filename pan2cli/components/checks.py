"""The cheap checks of a PAN 2 checkpoint's components, run before any weight is read or downloaded.

They read small files only (config JSONs, safetensors indexes, tokenizer files) and safetensors headers,
through a `FileView`, so that the same checks run on a local folder (files on disk, headers memory-mapped)
and on a hub repo before its weights are downloaded (its file list; headers by HTTP range requests).
Every failure is a `CheckpointError` (exit 2) naming the file, key or folder that does not match.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from pan2cli.checkpoints.json_files import read_json_object
from pan2cli.checkpoints.sharded import LOCAL_FILES, FileView, weight_files, weight_shapes
from pan2cli.errors import CheckpointError
from pan2cli.scheduler import SchedulerConfig, scheduler_config_from

CONFIG = "config.json"
SCHEDULER_CONFIG = "scheduler_config.json"
# Weight file stems (`<stem>.safetensors`, or shards listed by `<stem>.safetensors.index.json`), first match wins.
WEIGHT_STEMS = {
    "transformer": ("diffusion_pytorch_model", "model"),
    "text_encoder": ("model",),
    "vae": ("diffusion_pytorch_model",),
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class CheckedComponents:
    """What the checks read: the transformer's constructor arguments and the scheduler's config."""

    transformer_arguments: dict[str, Any] = field(default_factory=dict)
    scheduler: SchedulerConfig = SchedulerConfig()


def check_components(folders: Mapping[str, Path], files: FileView = LOCAL_FILES) -> CheckedComponents:
    """Check every component's small files and the transformer's and VAE's tensor names and shapes.

    Args:
        folders: component name → its folder (`transformer`, `text_encoder`, `tokenizer`, `vae`; `scheduler` optional).
        files: how the files are seen (`LOCAL_FILES`, or a hub repo's view).

    Raises:
        CheckpointError: the first component that does not match, naming the file, keys or values.
    """
    arguments = check_transformer(folders["transformer"], files)
    from pan2cli.dit.checkpoint import release_defaults

    check_text_encoder(
        folders["text_encoder"], files, arguments.get("text_embed_dim", release_defaults()["text_embed_dim"])
    )
    check_tokenizer(folders["tokenizer"], files)
    check_vae(folders["vae"], files)
    scheduler = read_scheduler(folders["scheduler"], files) if "scheduler" in folders else SchedulerConfig()
    return CheckedComponents(arguments, scheduler)


def _config(folder: Path, files: FileView, name: str, what: str) -> Path:
    path = folder / name
    if not files.exists(path):
        raise CheckpointError(f"{files.label(folder)} has no {name} ({what})")
    return path


def check_transformer(folder: Path, files: FileView = LOCAL_FILES) -> dict[str, Any]:
    """`config.json` is a PAN 2 transformer's with known keys, and the weights hold exactly its tensors.

    Returns:
        The constructor arguments from `config.json`.
    """
    from pan2cli.dit.checkpoint import WEIGHT_STEMS as DIT_STEMS
    from pan2cli.dit.checkpoint import check_tensor_shapes
    from pan2cli.dit.config import config_arguments

    config = _config(folder, files, CONFIG, "the PAN2Transformer3DModel config")
    arguments = config_arguments(read_json_object(config), source=files.label(config))
    check_tensor_shapes(weight_shapes(folder, DIT_STEMS, files), arguments, files.label(folder))
    return arguments


def _text_hidden_size(config: Mapping[str, Any]) -> int | None:
    """`hidden_size` of a text-only (`qwen3_5_text`) or multimodal (`qwen3_5`, under `text_config`) config."""
    for candidate in (config.get("text_config"), config):
        if isinstance(candidate, Mapping) and isinstance(candidate.get("hidden_size"), int):
            return candidate["hidden_size"]
    return None


def check_text_encoder(folder: Path, files: FileView, text_embed_dim: int) -> None:
    """A transformers `config.json` whose hidden size is the transformer's `text_embed_dim`, and its weights."""
    config = _config(folder, files, CONFIG, "the Qwen3.5 text encoder's transformers config")
    weight_files(folder, WEIGHT_STEMS["text_encoder"], files)
    hidden = _text_hidden_size(read_json_object(config))
    if hidden is not None and hidden != text_embed_dim:
        raise CheckpointError(
            f"{files.label(config)} has hidden_size {hidden}, but the transformer's text_embed_dim is {text_embed_dim}",
            hint="text_encoder/ and transformer/ come from different checkpoints",
        )


def check_tokenizer(folder: Path, files: FileView) -> None:
    """Tokenizer files, with a chat template (`chat_template.jinja`/`.json`, or `chat_template` in tokenizer_config.json)."""
    if not any(files.exists(folder / name) for name in _TOKENIZER_FILES):
        raise CheckpointError(f"{files.label(folder)} has no {' or '.join(_TOKENIZER_FILES)}")
    if files.exists(folder / "chat_template.jinja") or files.exists(folder / "chat_template.json"):
        return
    tokenizer_config = folder / "tokenizer_config.json"
    if files.exists(tokenizer_config) and read_json_object(tokenizer_config).get("chat_template"):
        return
    raise CheckpointError(
        f"{files.label(folder)} has no chat template (chat_template.jinja, or chat_template in tokenizer_config.json)",
        hint="PAN 2 encodes prompts with the tokenizer's own chat template; use the tokenizer/ of IFM/PAN2",
    )


def check_vae(folder: Path, files: FileView) -> None:
    """An AutoencoderKLWan `config.json` and `diffusion_pytorch_model.safetensors` holding its decoder (and encoder)."""
    import torch

    from pan2cli.vae.checkpoint import DIFFUSERS_WEIGHTS, check_decoder_keys, check_encoder_keys
    from pan2cli.vae.config import WanVAEConfig
    from pan2cli.vae.encoder import WanVAEEncoder
    from pan2cli.vae.model import WanVAEDecoder

    config_path = _config(folder, files, CONFIG, "the AutoencoderKLWan config")
    config = WanVAEConfig.from_diffusers_config(
        read_json_object(config_path), source=files.label(config_path)
    )
    weights = _config(folder, files, DIFFUSERS_WEIGHTS, "the Wan2.2 VAE weights")
    shapes = files.tensor_shapes([weights])[0]
    with torch.device("meta"):
        decoder, encoder = WanVAEDecoder(config), WanVAEEncoder(config)
    check_decoder_keys(
        shapes, {k: tuple(v.shape) for k, v in decoder.state_dict().items()}, files.label(weights)
    )
    # The encoder (image-to-video) is checked when the file has one; `load_vae_encoder` says so when it has none.
    encoder_shapes = {k: v for k, v in shapes.items() if k.startswith(("encoder.", "quant_conv."))}
    if encoder_shapes:
        check_encoder_keys(
            encoder_shapes, {k: tuple(v.shape) for k, v in encoder.state_dict().items()}, files.label(weights)
        )


def read_scheduler(folder: Path, files: FileView) -> SchedulerConfig:
    """The `scheduler_config.json` in `folder` (defaults when there is none), its options checked (`scheduler_config_from`)."""
    path = folder / SCHEDULER_CONFIG
    if not files.exists(path):
        return SchedulerConfig()
    return scheduler_config_from(read_json_object(path), files.label(path))
