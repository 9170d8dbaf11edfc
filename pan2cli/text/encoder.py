"""The PAN 2 text recipe: Qwen3.5's chat template with a system message, the tokens after the user header, `hidden_states[-3]`.

Source for every constant: vLLM-Omni's PAN 2 pipeline (`encode_prompt` in
vllm-project/vllm-omni:vllm_omni/diffusion/models/pan2/pipeline_pan2.py @f1ef55bd, identical in IFM's fork
MBZUAI-IFM/vllm-omni-pan2). The prompt is encoded as it is given, surrounding whitespace included, as there.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

from pan2cli.errors import CheckpointError, InputError
from pan2cli.text.checkpoint import load_text_model, load_tokenizer

SYSTEM_MESSAGE = "You are a helpful assistant. Generate the video with the following instructions."
# Tokens kept after the user header (the prompt, `<|im_end|>` and the assistant header): `PAN2_MAX_SEQUENCE_LENGTH`.
MAX_PROMPT_TOKENS = 1536
# The features start right after this header of the ChatML template.
USER_HEADER = "<|im_start|>user\n"


class EncodedPrompt(NamedTuple):
    """What `PAN2TextEncoder.encode` returns.

    features: `[1, L, hidden]` in the model's dtype, L ≤ `max_length` (no padding, so the DiT needs no mask).
    tokens_cut: tokens dropped from the end because the prompt passed `max_length` (0 mostly).
    """

    features: torch.Tensor
    tokens_cut: int


class PAN2TextEncoder:
    """Turn a prompt into PAN 2's text conditioning with the Qwen3.5 text model and its tokenizer.

    The prompt is rendered with the tokenizer's own chat template: a system message (`SYSTEM_MESSAGE`), the
    prompt as the user message (an empty prompt as " ", as in training), `add_generation_prompt=True` and no
    other template option. The model runs on the tokens up to `max_length` past the `<|im_start|>user\\n`
    header; the features are `hidden_states[-3]` from the first token after that header.

    Args:
        tokenizer: the checkpoint's tokenizer with its ChatML chat template (`load_tokenizer`).
        model: the text model up to the hidden state PAN 2 reads (`load_text_model`): token ids `[1, L]` →
            `hidden_states[-3]` `[1, L, hidden]`.
        max_length (`int`, defaults to 1536): tokens kept after the user header; longer prompts lose their tail.

    Raises:
        CheckpointError: the template has no user header the tokenizer can find.
    """

    def __init__(self, tokenizer, model, max_length: int = MAX_PROMPT_TOKENS):
        if max_length < 1:
            raise ValueError(f"max_length must be ≥ 1, got {max_length}")
        self.tokenizer = tokenizer
        self.model = model
        self.max_length = max_length
        self.header_ids = tokenizer.encode(USER_HEADER)

    @classmethod
    def load(
        cls,
        text_encoder: Path,
        tokenizer: Path,
        *,
        dtype: torch.dtype,
        device: torch.device | str,
        max_length: int = MAX_PROMPT_TOKENS,
    ) -> "PAN2TextEncoder":
        """Read the tokenizer (`load_tokenizer`) and the text model (`load_text_model`) from local folders.

        Raises:
            CheckpointError: a folder that is not what PAN 2 needs (named).
        """
        tok = load_tokenizer(Path(tokenizer))
        return cls(tok, load_text_model(Path(text_encoder), dtype=dtype, device=device), max_length)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    def token_ids(self, prompt: str) -> tuple[list[int], int]:
        """The rendered template's token ids and the index of the first token after the user header.

        Raises:
            CheckpointError: the header is not in the rendered ids (the template is not ChatML).
            InputError: the prompt starts with line breaks that merge with the header (the release fails there too).
        """
        messages = [{"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": prompt or " "}]
        rendered = self.tokenizer.render(messages, add_generation_prompt=True)
        ids = self.tokenizer.encode(rendered)
        n = len(self.header_ids)
        start = next(
            (i + n for i in range(len(ids) - n + 1) if n and ids[i : i + n] == self.header_ids), None
        )
        if start is None:
            if USER_HEADER in rendered:
                raise InputError(
                    f"the prompt {prompt[:40]!r} starts with line breaks that the tokenizer joins to the chat template's "
                    f"{USER_HEADER!r} header, so the prompt's tokens cannot be told apart",
                    hint="remove the line breaks at the start of the prompt",
                )
            raise CheckpointError(
                f"the tokenizer's chat template does not render the {USER_HEADER!r} header",
                hint="PAN 2 needs the ChatML template of the Qwen3.5 tokenizer (tokenizer/ of IFM/PAN2)",
            )
        return ids, start

    @torch.inference_mode()
    def encode(self, prompt: str) -> EncodedPrompt:
        """The conditioning of one prompt (the negative prompt goes the same way).

        Returns:
            `EncodedPrompt(features [1, L, hidden], tokens_cut)`: L counts the prompt's tokens, `<|im_end|>` and
            whatever the template puts after it (the assistant header), at most `max_length`.
        """
        ids, start = self.token_ids(prompt)
        kept = ids[: start + self.max_length]
        # One sequence, no padding: a causal mask is the whole story.
        features = self.model(torch.tensor([kept], device=self.device))
        return EncodedPrompt(features[:, start:], len(ids) - len(kept))

    def release(self) -> None:
        """Drop the model's weights (and the GPU memory they held)."""
        self.model = None
