"""Reading PAN 2's text encoder from its checkpoint: the Qwen3.5 config, the language model's tensors (text-only and
multimodal layouts), only the layers PAN 2 runs, and the tokenizer.

The layers kept follow the recipe's hidden state (`HIDDEN_LAYER`, vLLM-Omni's PAN 2 pipeline: see `encoder`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping

import torch

from pan2cli.checkpoints.json_files import read_json_object
from pan2cli.checkpoints.keys import check_keys, listing
from pan2cli.checkpoints.sharded import tensor_locations, weight_shapes
from pan2cli.errors import CheckpointError
from pan2cli.text.qwen3_5 import Qwen35TextConfig, Qwen35TextModel
from pan2cli.text.tokenizer import ChatTokenizer

# The conditioning is the hidden states *before* the text model's last two layers (no final norm: the DiT's
# context embedder normalises), `PAN2_TEXT_ENCODER_LAYERS_TO_SKIP = 2` in the source.
HIDDEN_LAYER = -3

TEXT_MODEL_TYPE = "qwen3_5_text"  # config.json of a Qwen3_5TextModel
MULTIMODAL_MODEL_TYPE = (
    "qwen3_5"  # config.json of a Qwen3_5ForConditionalGeneration (text_config + vision_config)
)
# Where a checkpoint keeps the language model's tensors, read from what transformers 5.24 saves:
# Qwen3_5TextModel → no prefix; Qwen3_5ForConditionalGeneration (the layout of Qwen's own Qwen3.5 releases)
# → "model.language_model."; Qwen3_5Model → "language_model.". Everything else (`model.visual.*`, `lm_head.*`,
# `mtp.*`) belongs to the vision tower or the heads and is never read.
LANGUAGE_MODEL_PREFIXES = ("", "model.language_model.", "language_model.")
_OTHER_PARTS = ("model.visual.", "visual.", "lm_head.", "mtp.")
_HINT = "text_encoder/ must hold the Qwen3.5 text model of a PAN 2 checkpoint (IFM/PAN2)"


def load_tokenizer(folder: Path) -> ChatTokenizer:
    """The tokenizer in `folder` with its chat template (`ChatTokenizer`: tokenizers + jinja2, local files only).

    Raises:
        CheckpointError: unreadable, or without a chat template.
    """
    return ChatTokenizer.from_folder(Path(folder))


def read_text_config(folder: Path) -> Qwen35TextConfig:
    """The text model's config from `folder/config.json`: the file itself, or the `text_config` of a multimodal one.

    Raises:
        CheckpointError: no config, a model type other than qwen3_5_text / qwen3_5 (named), invalid fields.
    """
    path = folder / "config.json"
    if not path.is_file():
        raise CheckpointError(f"no config.json in {folder}", hint=_HINT)
    raw = read_json_object(path)
    model_type = raw.get("model_type")
    if model_type not in (TEXT_MODEL_TYPE, MULTIMODAL_MODEL_TYPE):
        raise CheckpointError(
            f"{path} describes a {model_type!r} model, not Qwen3.5 ({TEXT_MODEL_TYPE!r} or {MULTIMODAL_MODEL_TYPE!r})",
            hint=_HINT,
        )
    if model_type == MULTIMODAL_MODEL_TYPE:
        raw = raw.get("text_config")
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: a {model_type!r} config without a text_config", hint=_HINT)
    config = Qwen35TextConfig.from_dict(raw, str(path))
    if encoder_layers(config) < 0:
        raise CheckpointError(
            f"{path}: the text model has {config.num_hidden_layers} layers; PAN 2 reads hidden_states[{HIDDEN_LAYER}]"
        )
    return config


def encoder_layers(config: Qwen35TextConfig) -> int:
    """The layers before `hidden_states[HIDDEN_LAYER]` (entry 0 is the embeddings): all but the last two."""
    return config.num_hidden_layers + 1 + HIDDEN_LAYER


def _shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {key: tuple(value.shape) for key, value in model.state_dict().items()}


def language_model_keys(shapes: Mapping[str, tuple[int, ...]], source: str) -> tuple[str, list[str]]:
    """The prefix of the language model's tensors in a checkpoint and their keys, from the headers alone.

    Raises:
        CheckpointError: no language model (no `embed_tokens.weight` under any known prefix).
    """
    prefix = next((p for p in LANGUAGE_MODEL_PREFIXES if f"{p}embed_tokens.weight" in shapes), None)
    if prefix is None:
        raise CheckpointError(
            f"{source} holds no Qwen3.5 language model (no embed_tokens.weight under any of "
            f"{', '.join(repr(p) for p in LANGUAGE_MODEL_PREFIXES)}); it has {listing(shapes)}",
            hint=_HINT,
        )
    if prefix:
        return prefix, [k for k in shapes if k.startswith(prefix)]
    return prefix, [k for k in shapes if not k.startswith(_OTHER_PARTS + LANGUAGE_MODEL_PREFIXES[1:])]


def language_model_prefix(
    shapes: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], source: str
) -> str:
    """The prefix of the language model's tensors in `shapes`, checked strictly against `expected` (its own names).

    Raises:
        CheckpointError: no language model found, or missing / unexpected / mis-shaped language-model tensors (named).
    """
    prefix, keys = language_model_keys(shapes, source)
    where = f" under {prefix!r}" if prefix else ""
    check_keys(
        {key[len(prefix) :]: shapes[key] for key in keys},
        expected,
        f"{source} does not hold the language model its config.json describes{where}",
        hint=_HINT,
    )
    return prefix


def read_text_tensors(
    folder: Path, device: torch.device | str, on_tensor: Callable[[], None] | None = None
) -> dict[str, torch.Tensor]:
    """The tensors of the layers PAN 2 runs (`encoder_layers`), read to `device` as stored, under the model's names.

    The last two layers and the final norm are never read (PAN 2 does not use them). Needs nothing but the
    headers and config.json, so it can start first, in the background; `load_text_model` checks every tensor
    of the files against the model.

    Raises:
        CheckpointError: no language model in the files, an invalid config, unreadable files.
    """
    from pan2cli.checkpoints.staged import StagedReader

    config = read_text_config(Path(folder))
    with torch.device("meta"):
        needed = Qwen35TextModel(config, encoder_layers(config)).state_dict()
    shapes, files = tensor_locations(Path(folder), ("model",))
    prefix, keys = language_model_keys(shapes, str(folder))
    keys = [key for key in keys if key[len(prefix) :] in needed]
    with StagedReader({key: files[key] for key in keys}, device) as reader:
        return {key[len(prefix) :]: tensor for key, tensor in reader.read(keys, on_tensor).items()}


def load_text_model(
    folder: Path,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    tensors: dict[str, torch.Tensor] | None = None,
) -> Qwen35TextModel:
    """PAN 2's text encoder: the Qwen3.5 text model in `folder` up to the hidden state PAN 2 reads (local files).

    Text-only and multimodal Qwen3.5 checkpoints alike: every tensor of the language model is checked against
    the config (names and shapes, strictly), the vision tower's are ignored, and only the layers PAN 2 runs
    are read (`read_text_tensors`: several threads, straight to `device`) and become the model's parameters
    as they are (no second copy where the dtype is the stored one).

    Args:
        folder: `text_encoder/` (config.json + model.safetensors or a sharded index).
        dtype: parameter dtype (bf16 on GPU in the release).
        device: where the model runs.
        tensors: the tensors if already read (`read_text_tensors`, in the background); taken over (the dict is
            emptied).

    Returns:
        A `Qwen35TextModel` of `encoder_layers` layers, in eval mode without gradients.

    Raises:
        CheckpointError: another model type (named), missing / unexpected / mis-shaped tensors (named), unreadable files.
    """
    config = read_text_config(folder)
    with torch.device("meta"):
        expected = _shapes(Qwen35TextModel(config))
        model = Qwen35TextModel(config, encoder_layers(config))
    language_model_prefix(weight_shapes(folder, ("model",)), expected, str(folder))
    state = tensors if tensors is not None else read_text_tensors(folder, device)
    try:
        missing = sorted(model.state_dict().keys() - state.keys())
        if missing:  # only pre-read tensors can lack any: the files were checked above
            raise CheckpointError(f"{folder}: tensors not read: {listing(missing)}")
        target = torch.device(device)
        model.load_state_dict(
            {key: state[key].to(target, dtype) for key in model.state_dict()}, strict=True, assign=True
        )
    finally:
        state.clear()  # the model holds what it uses
    return model.eval().requires_grad_(False)
