"""The text encoder: a transformers model + tokenizer (PAN 2 uses Qwen3.5) turning prompts into DiT conditioning."""

from __future__ import annotations

from pathlib import Path

import torch

from pan2cli.errors import CheckpointError


class PAN2TextEncoder:
    """Tokenise a prompt and return the hidden states of one layer of the text model.

    Args:
        tokenizer: a transformers tokenizer.
        model: a transformers model returning `hidden_states` with `output_hidden_states=True`.
        hidden_layer: index into `hidden_states` (-1 the last layer's output).
        max_length: tokens kept per prompt.
    """

    def __init__(self, tokenizer, model, hidden_layer: int = -1, max_length: int = 512):
        self.tokenizer = tokenizer
        self.model = model
        self.hidden_layer = hidden_layer
        self.max_length = max_length

    @classmethod
    def load(cls, text_encoder: Path, tokenizer: Path, *, dtype: torch.dtype, device: torch.device, hidden_layer: int = -1, max_length: int = 512) -> "PAN2TextEncoder":
        """Read both with transformers' Auto classes from local folders (no download here).

        Raises:
            CheckpointError: transformers cannot read a folder (named).
        """
        from transformers import AutoModel, AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # pan2's own progress is on stderr; no second bar per load
        try:
            tok = AutoTokenizer.from_pretrained(str(tokenizer), local_files_only=True)
        except Exception as exc:  # transformers raises OSError, ValueError, KeyError...
            raise CheckpointError(f"{tokenizer} could not be read as a tokenizer: {exc}") from exc
        try:
            model = AutoModel.from_pretrained(str(text_encoder), dtype=dtype, local_files_only=True)
        except Exception as exc:
            raise CheckpointError(f"{text_encoder} could not be read as a transformers model: {exc}") from exc
        return cls(tok, model.to(device).eval().requires_grad_(False), hidden_layer, max_length)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def hidden_size(self) -> int:
        config = self.model.config
        config = getattr(config, "text_config", None) or config  # multimodal configs nest the text model
        return int(config.hidden_size)

    @torch.inference_mode()
    def encode(self, prompt: str) -> torch.Tensor:
        """`[1, L, hidden]` states of the prompt's tokens (no padding, so the DiT needs no mask).

        An empty prompt (the default negative prompt) becomes one end-of-text token: the model needs
        at least one token.
        """
        ids = self.tokenizer(prompt, truncation=True, max_length=self.max_length, add_special_tokens=True)["input_ids"]
        if not ids:
            fallback = self.tokenizer.eos_token_id if self.tokenizer.eos_token_id is not None else self.tokenizer.pad_token_id
            ids = [fallback if fallback is not None else 0]
        input_ids = torch.tensor([ids], device=self.device)
        out = self.model(input_ids=input_ids, attention_mask=torch.ones_like(input_ids), output_hidden_states=True)
        return out.hidden_states[self.hidden_layer]

    def release(self) -> None:
        """Drop the model's weights (and the GPU memory they held)."""
        self.model = None
