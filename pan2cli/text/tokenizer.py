"""`ChatTokenizer`: the Qwen3.5 tokenizer of a checkpoint and its chat template, as PAN 2 uses them.

`tokenizer.json` runs through the tokenizers library (the Rust tokenizer transformers' fast tokenizers wrap)
and the chat template through jinja2, set up as transformers' `apply_chat_template` sets it up: a sandboxed,
immutable environment with `trim_blocks` and `lstrip_blocks`, loop controls, `tojson` without HTML escaping,
`raise_exception`, `strftime_now`, the named special tokens as variables, `{% generation %}` blocks rendered as
they are. The rendered text is then encoded without added special tokens, as `apply_chat_template(...,
tokenize=True)` does. Why not transformers' `AutoTokenizer`: importing it took 5.8-7.8 s on an H200 host
(transformers 5.17 imports its model factory with it), the largest part of `pan2 generate`'s start;
`tests/pipeline/test_text_encoder.py` checks the ids against AutoTokenizer's.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

from pan2cli.checkpoints.json_files import read_json_object
from pan2cli.errors import CheckpointError

# The special tokens a template sees by name (transformers' `special_tokens_map`).
NAMED_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
_TEMPLATE_HINT = "PAN 2 renders prompts with the tokenizer's own ChatML template (chat_template.jinja or tokenizer_config.json)"


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    if isinstance(value, Mapping):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _chat_template(folder: Path, config: Mapping[str, Any]) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's `chat_template` (a string, or named ones: "default")."""
    path = folder / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next(
            (t.get("template") for t in template if isinstance(t, Mapping) and t.get("name") == "default"),
            None,
        )
    return template if isinstance(template, str) and template else None


def _environment():
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(jinja2.ext.Extension):
        """`{% generation %}…{% endgeneration %}` (transformers marks assistant tokens with it): the body as is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[GenerationBlock, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTokenizer:
    """A tokenizers `Tokenizer` and a compiled chat template (module docstring).

    Args:
        tokenizer: a `tokenizers.Tokenizer`.
        chat_template: the template's jinja2 source.
        named_tokens: the variables the template sees besides the messages (`bos_token`, `eos_token`, ...).

    Raises:
        CheckpointError: a template jinja2 cannot compile.
    """

    def __init__(self, tokenizer, chat_template: str, named_tokens: Mapping[str, str] | None = None):
        import jinja2

        self._tokenizer = tokenizer
        self.chat_template = chat_template
        self.named_tokens = dict(named_tokens or {})
        try:
            self._template = _environment().from_string(chat_template)
        except jinja2.TemplateError as exc:
            raise CheckpointError(
                f"the tokenizer's chat template does not compile: {exc}", hint=_TEMPLATE_HINT
            ) from exc

    @classmethod
    def from_folder(cls, folder: Path) -> "ChatTokenizer":
        """The tokenizer in `folder`: tokenizer.json, tokenizer_config.json and the chat template.

        Raises:
            CheckpointError: unreadable, or without a chat template.
        """
        from tokenizers import Tokenizer

        folder = Path(folder)
        config_path = folder / "tokenizer_config.json"
        config = read_json_object(config_path) if config_path.is_file() else {}
        try:
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # tokenizers raises its own Exception for a missing or malformed file
            raise CheckpointError(f"{folder} could not be read as a tokenizer: {exc}") from exc
        template = _chat_template(folder, config)
        if template is None:
            raise CheckpointError(f"the tokenizer in {folder} has no chat template", hint=_TEMPLATE_HINT)
        named = {name: text for name in NAMED_TOKENS if (text := _token_text(config.get(name))) is not None}
        return cls(tokenizer, template, named)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
        """The template rendered for `messages` (no tools, no documents), as transformers renders it.

        Raises:
            CheckpointError: the template fails on them (its `raise_exception`, or an error of jinja2's).
        """
        import jinja2

        try:
            return self._template.render(
                messages=[dict(m) for m in messages], tools=None, documents=None,
                add_generation_prompt=add_generation_prompt, **self.named_tokens,
            )  # fmt: skip
        except jinja2.TemplateError as exc:
            raise CheckpointError(
                f"the tokenizer's chat template failed: {exc}", hint=_TEMPLATE_HINT
            ) from exc

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, special tokens in it recognised, none added."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=False)
