"""pan2's chat tokenizer (pan2cli/text/tokenizer.py) against transformers' AutoTokenizer on the tiny tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest

from pan2cli.errors import CheckpointError
from pan2cli.testing.tiny_pan2 import write_tokenizer
from pan2cli.text.encoder import SYSTEM_MESSAGE
from pan2cli.text.tokenizer import ChatTokenizer

PROMPTS = [
    "A red fox runs across the snow at night.",
    " a cat\n",
    "\ta dog ",
    "Ünïcödé e\u0301 ça marche — 東京の夜 🦊",
    "two lines\n\nand <|im_end|> inside",
    " ".join(["snow"] * 300),
]
# A template of our own that uses what transformers' environment offers: loop controls, namespaces, tojson,
# raise_exception, named special tokens, a generation block, trim_blocks / lstrip_blocks.
RICH_TEMPLATE = """{{ bos_token or '' }}
{%- set ns = namespace(users=0) %}
{%- for m in messages[::-1] %}
    {%- if m.role == 'user' %}{% set ns.users = ns.users + 1 %}{% endif %}
{%- endfor %}
{%- for m in messages %}
    {%- if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}
    {%- if loop.index0 > 5 %}{% break %}{% endif %}
<|im_start|>{{ m.role }}
{% if m.role == 'assistant' %}{% generation %}{{ m.content | trim }}{% endgeneration %}{% else %}{{ m.content }}{% endif %}<|im_end|>
{% endfor %}
{%- if tools %}{{ tools | tojson }}{% endif %}
{{- {'users': ns.users, 'text': 'é<&>'} | tojson }}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from transformers import AutoTokenizer

    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer"
    write_tokenizer(path)
    return (
        path,
        ChatTokenizer.from_folder(path),
        AutoTokenizer.from_pretrained(str(path), local_files_only=True),
    )


def _messages(prompt):
    return [{"role": "system", "content": SYSTEM_MESSAGE}, {"role": "user", "content": prompt}]


@pytest.mark.parametrize("prompt", PROMPTS, ids=range(len(PROMPTS)))
def test_rendered_text_and_ids_are_transformers(pair, prompt):
    _, ours, theirs = pair
    rendered = theirs.apply_chat_template(_messages(prompt), add_generation_prompt=True, tokenize=False)
    ids = theirs.apply_chat_template(_messages(prompt), add_generation_prompt=True, tokenize=True)
    ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    assert ours.render(_messages(prompt)) == rendered
    assert ours.encode(rendered) == ids and len(ids) > 10
    assert ours.decode(ids) == theirs.decode(ids)
    assert len(ours) == len(theirs)


@pytest.mark.parametrize("generation_prompt", [True, False])
def test_a_template_using_the_environment_renders_as_transformers(pair, generation_prompt):
    _, ours, theirs = pair
    messages = [
        *_messages("hi"),
        {"role": "assistant", "content": "  hello  "},
        {"role": "user", "content": "x"},
    ]
    expected = theirs.apply_chat_template(
        messages, chat_template=RICH_TEMPLATE, add_generation_prompt=generation_prompt, tokenize=False
    )
    got = ChatTokenizer(ours._tokenizer, RICH_TEMPLATE, ours.named_tokens).render(messages, generation_prompt)
    assert got == expected and '"users": 2' in got and "é<&>" in got


def test_template_errors_are_checkpoint_errors(pair):
    _, ours, _ = pair
    template = ChatTokenizer(ours._tokenizer, RICH_TEMPLATE)
    with pytest.raises(CheckpointError, match="bad role tool"):
        template.render([{"role": "tool", "content": "x"}])
    with pytest.raises(CheckpointError, match="does not compile"):
        ChatTokenizer(ours._tokenizer, "{% for m in messages %}")


def test_template_from_tokenizer_config_and_named_tokens(pair, tmp_path):
    path, ours, _ = pair
    folder = shutil.copytree(path, tmp_path / "tokenizer")
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    named = [
        {"name": "tool_use", "template": "no"},
        {"name": "default", "template": "{{ eos_token }}|{{ bos_token }}"},
    ]
    config.update(chat_template=named, eos_token={"content": "<|im_end|>", "special": True}, bos_token=None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    loaded = ChatTokenizer.from_folder(folder)
    assert loaded.render([]) == "<|im_end|>|" and loaded.named_tokens["eos_token"] == "<|im_end|>"
    assert "bos_token" not in loaded.named_tokens


def test_missing_tokenizer_json_is_a_checkpoint_error(pair, tmp_path):
    path, _, _ = pair
    folder = shutil.copytree(path, tmp_path / "tokenizer")
    (folder / "tokenizer.json").unlink()
    with pytest.raises(CheckpointError, match="could not be read as a tokenizer") as err:
        ChatTokenizer.from_folder(folder)
    assert err.value.exit_code == 2
