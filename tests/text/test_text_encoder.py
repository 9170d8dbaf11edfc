"""The PAN 2 text recipe and its checkpoint reading (pan2cli/text/encoder.py, checkpoint.py) on the tiny Qwen3.5 text
model of `pan2cli.testing.tiny_pan2`."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from pan2cli.errors import CheckpointError, InputError
from pan2cli.testing.tiny_pan2 import tiny_text_model, write_text_encoder, write_tokenizer
from pan2cli.text import encoder as text
from pan2cli.text.checkpoint import HIDDEN_LAYER, load_text_model, load_tokenizer
from pan2cli.text.encoder import PAN2TextEncoder

PROMPT = "A red fox runs across the snow at night."


@pytest.fixture(scope="module")
def tiny_text(tmp_path_factory):
    """`tokenizer/` and a text-only `text_encoder/`, plus the model object they were written from."""
    root = tmp_path_factory.mktemp("text")
    tokenizer = write_tokenizer(root / "tokenizer")
    model = tiny_text_model(len(tokenizer), seed=0)
    write_text_encoder(root / "text_encoder", model)
    return root, model


@pytest.fixture(scope="module")
def encoder(tiny_text):
    root, _ = tiny_text
    return PAN2TextEncoder.load(root / "text_encoder", root / "tokenizer", dtype=torch.float32, device="cpu")


def _reference_features(root, prompt: str, system: str = text.SYSTEM_MESSAGE) -> torch.Tensor:
    """hidden_states[-3] at the tokens after the user header, computed from transformers' own classes."""
    from transformers import AutoTokenizer, Qwen3_5TextModel

    tok = AutoTokenizer.from_pretrained(str(root / "tokenizer"), local_files_only=True)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    head = rendered[: rendered.index("<|im_start|>user\n") + len("<|im_start|>user\n")]
    ids = tok(rendered, add_special_tokens=False)["input_ids"]
    start = len(tok(head, add_special_tokens=False)["input_ids"])
    assert tok.decode(ids[start:]) == rendered[len(head) :]  # the crop is exactly the text after the header
    model = Qwen3_5TextModel.from_pretrained(
        str(root / "text_encoder"), dtype=torch.float32, local_files_only=True
    )
    with torch.no_grad():
        hidden = model(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
    assert not torch.equal(hidden[-3], hidden[-1]) and not torch.equal(hidden[-3], hidden[-2])
    return hidden[-3][:, start:]


def test_constants_are_the_release_recipe():
    assert HIDDEN_LAYER == -3 and text.MAX_PROMPT_TOKENS == 1536
    assert (
        text.SYSTEM_MESSAGE
        == "You are a helpful assistant. Generate the video with the following instructions."
    )
    assert PAN2TextEncoder.__init__.__defaults__ == (1536,)


def test_features_are_hidden_states_minus_3_after_the_user_header(tiny_text, encoder):
    root, _ = tiny_text
    features, cut = encoder.encode(PROMPT)
    expected = _reference_features(root, PROMPT)
    assert cut == 0 and features.shape == expected.shape and features.shape[-1] == encoder.hidden_size == 32
    torch.testing.assert_close(features, expected, rtol=1e-4, atol=1e-5)  # float32, two implementations
    ids, start = encoder.token_ids(PROMPT)
    assert encoder.tokenizer.decode(ids[start:]) == PROMPT + "<|im_end|>\n<|im_start|>assistant\n"


def test_system_message_is_in_the_model_input(tiny_text, encoder, monkeypatch):
    root, _ = tiny_text
    ids, start = encoder.token_ids(PROMPT)
    assert text.SYSTEM_MESSAGE in encoder.tokenizer.decode(ids[:start])
    before = encoder.encode(PROMPT).features
    monkeypatch.setattr(text, "SYSTEM_MESSAGE", "You are a terse assistant.")
    after = encoder.encode(PROMPT).features
    assert after.shape == before.shape and not torch.allclose(after, before)
    expected = _reference_features(root, PROMPT, system="You are a terse assistant.")
    torch.testing.assert_close(after, expected, rtol=1e-4, atol=1e-5)


def test_empty_prompt_is_encoded_as_a_space(encoder):
    assert encoder.token_ids("") == encoder.token_ids(" ")
    assert torch.equal(encoder.encode("").features, encoder.encode(" ").features)
    ids, start = encoder.token_ids("")
    assert encoder.tokenizer.decode(ids[start:]).startswith(" <|im_end|>")


def test_surrounding_whitespace_reaches_the_encoder(tiny_text, encoder, tmp_path):
    """The release encodes the prompt as given. " a cat\n" is other tokens and other features than
    "a cat", through the settings (`settings_with`) and a prompt file's records (JSON and plain text) alike;
    whitespace alone still counts as no prompt."""
    from pan2cli.config import settings_with
    from pan2cli.pipeline.jobs import GenerationJob
    from pan2cli.pipeline.prompts import read_prompt_file
    from pan2cli.presets import load_preset

    ids, start = encoder.token_ids(" a cat\n")
    plain_ids, plain_start = encoder.token_ids("a cat")
    assert encoder.tokenizer.decode(ids[start:]).startswith(" a cat\n<|im_end|>")
    assert ids[start:] != plain_ids[plain_start:]
    assert not torch.equal(
        encoder.encode(" a cat\n").features[:, :3], encoder.encode("a cat").features[:, :3]
    )

    preset = load_preset("pan2-5s")
    assert settings_with(preset, {"prompt": " a cat\n"}).prompt == " a cat\n"
    (tmp_path / "p.json").write_text(json.dumps([" a cat\n", {"prompt": "\ta dog "}]))
    (tmp_path / "p.txt").write_text("  a cat  \n# a comment\n   \n")
    records = [r.prompt for name in ("p.json", "p.txt") for r in read_prompt_file(tmp_path / name)[0]]
    assert records == [" a cat\n", "\ta dog ", "  a cat  "]
    with pytest.raises(InputError, match="the prompt is empty"):
        GenerationJob(settings_with(preset, {"prompt": " \n\t"}))


def test_long_prompt_keeps_1536_tokens_and_counts_the_cut(encoder):
    prompt = " ".join(["snow"] * 1700)
    ids, start = encoder.token_ids(prompt)
    after = len(ids) - start
    assert after > 1536
    features, cut = encoder.encode(prompt)
    assert features.shape[1] == 1536 and cut == after - 1536
    # The model is causal: the kept tokens see what they would see in the whole sequence.
    whole = PAN2TextEncoder(encoder.tokenizer, encoder.model, max_length=after).encode(prompt)
    assert whole.tokens_cut == 0 and whole.features.shape[1] == after
    torch.testing.assert_close(features, whole.features[:, :1536])


def test_max_length_through_the_api(encoder):
    short = PAN2TextEncoder(encoder.tokenizer, encoder.model, max_length=4)
    ids, start = short.token_ids(PROMPT)
    features, cut = short.encode(PROMPT)
    assert features.shape[1] == 4 and cut == len(ids) - start - 4
    torch.testing.assert_close(features, encoder.encode(PROMPT).features[:, :4])


def test_tokenizer_without_chat_template_is_a_checkpoint_error(tiny_text, tmp_path):
    root, _ = tiny_text
    folder = shutil.copytree(root / "tokenizer", tmp_path / "tokenizer")
    (folder / "chat_template.jinja").unlink()
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="has no chat template") as err:
        load_tokenizer(folder)
    assert err.value.exit_code == 2


def test_template_without_user_header_is_a_checkpoint_error(tiny_text, encoder, tmp_path):
    root, _ = tiny_text
    folder = shutil.copytree(root / "tokenizer", tmp_path / "tokenizer")
    (folder / "chat_template.jinja").write_text(
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    )
    plain = PAN2TextEncoder(load_tokenizer(folder), encoder.model)
    with pytest.raises(CheckpointError, match="header"):
        plain.encode(PROMPT)


def test_prompt_starting_with_line_breaks_is_bad_input(encoder):
    # The tokenizer joins "\n" + "\n" into one token (as Qwen's does): the header cannot be found, as in the release.
    with pytest.raises(InputError, match="line breaks") as err:
        encoder.encode("\nA red fox.")
    assert type(err.value) is InputError
    assert encoder.encode("A red fox.\n\nA cat.").tokens_cut == 0


def _multimodal_folder(tmp_path, model, layout: str):
    """`text_encoder/` as Qwen3_5ForConditionalGeneration (Qwen's release layout) or Qwen3_5Model saves it."""
    folder = tmp_path / "text_encoder"
    if layout == "ForConditionalGeneration":
        write_text_encoder(folder, model, multimodal=True)
    else:
        from transformers import Qwen3_5Config, Qwen3_5Model

        from pan2cli.testing.tiny_pan2 import TINY_VISION

        full = Qwen3_5Model(Qwen3_5Config(text_config=model.config.to_dict(), vision_config=TINY_VISION)).to(
            torch.bfloat16
        )
        full.language_model.load_state_dict(model.state_dict(), strict=True)
        full.save_pretrained(str(folder))
    return folder


def _keys(folder):
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as handle:
        return list(handle.keys())


@pytest.mark.parametrize(
    ("layout", "prefix"),
    [("ForConditionalGeneration", "model.language_model."), ("Model", "language_model.")],
)
def test_multimodal_text_encoder_loads_the_language_model_only(
    tiny_text, encoder, tmp_path, monkeypatch, layout, prefix
):
    from pan2cli.text.qwen3_5 import Qwen35TextModel

    root, model = tiny_text
    folder = _multimodal_folder(tmp_path, model, layout)
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3_5"
    keys = _keys(folder)
    assert any(k.startswith(prefix + "layers.") for k in keys) and any(".visual." in f".{k}" for k in keys)

    from pan2cli.checkpoints.staged import StagedReader

    read = []
    real = StagedReader.read
    monkeypatch.setattr(
        StagedReader, "read", lambda self, keys, *a: (read.extend(keys), real(self, keys, *a))[1]
    )
    loaded = load_text_model(folder, dtype=torch.float32)
    assert isinstance(loaded, Qwen35TextModel)
    # What is read: the embeddings and the layers before hidden_states[-3]; no vision tower, no last layers.
    layers = model.config.num_hidden_layers - 2
    assert {k[len(prefix) :].split(".")[0] for k in read} == {"embed_tokens", "layers"}
    assert {int(k[len(prefix) :].split(".")[1]) for k in read if ".layers." in f".{k}"} == set(range(layers))
    assert not any("visual" in name for name, _ in loaded.named_parameters())
    assert loaded.state_dict().keys() == encoder.model.state_dict().keys()
    same = PAN2TextEncoder(encoder.tokenizer, loaded)
    assert torch.equal(same.encode(PROMPT).features, encoder.encode(PROMPT).features)


@pytest.mark.parametrize("change", ["missing", "unexpected", "shape"])
def test_multimodal_language_model_keys_are_checked_strictly(tiny_text, tmp_path, change):
    from safetensors.torch import load_file, save_file

    _, model = tiny_text
    folder = _multimodal_folder(tmp_path, model, "ForConditionalGeneration")
    state = load_file(str(folder / "model.safetensors"))
    key = "model.language_model.layers.1.mlp.up_proj.weight"
    if change == "missing":
        del state[key]
    elif change == "unexpected":
        state["model.language_model.layers.1.mlp.extra.weight"] = torch.zeros(2)
    else:
        state[key] = state[key][:-1].clone()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"layers\.1\.mlp\.(up_proj|extra)\.weight") as err:
        load_text_model(folder, dtype=torch.float32)
    assert {"missing": "missing keys", "unexpected": "unexpected keys", "shape": "wrong shapes"}[
        change
    ] in str(err.value)


def test_unknown_model_type_is_a_checkpoint_error_naming_it(tiny_text, tmp_path):
    root, _ = tiny_text
    folder = shutil.copytree(root / "text_encoder", tmp_path / "text_encoder")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    with pytest.raises(CheckpointError, match="'qwen2'") as err:
        load_text_model(folder, dtype=torch.float32)
    assert err.value.exit_code == 2
