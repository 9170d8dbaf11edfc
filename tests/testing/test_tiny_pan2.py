"""The tiny repository in the IFM/PAN2 release layout: `pan2cli.testing.tiny_pan2` and its command line,
scripts/make_tiny_pan2.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from pan2cli.dit.checkpoint import load_pan2_transformer
from tests.subprocess_env import python_env

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "make_tiny_pan2.py"
COMPONENTS = {
    "transformer": ("diffusers", "PAN2Transformer3DModel"),
    "text_encoder": ("transformers", "Qwen3_5TextModel"),
    "vae": ("diffusers", "AutoencoderKLWan"),
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
}


def _run(*args):
    env = python_env()
    return subprocess.run(
        [sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, env=env, cwd=REPO
    )


def test_help():
    res = _run("--help")
    assert res.returncode == 0 and "--seed" in res.stdout and "--multimodal-text-encoder" in res.stdout


def test_command_writes_the_release_layout(tmp_path):
    out = tmp_path / "PAN2"
    options = ("shift=5.0", "shift_terminal=0.1", "use_dynamic_shifting=null", "stochastic_sampling=true")
    res = _run(out, "--seed", 3, *(arg for option in options for arg in ("--scheduler-option", option)))
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == str(out)
    for name in (
        "modular_model_index.json", "scheduler/scheduler_config.json",
        "transformer/config.json", "transformer/diffusion_pytorch_model.safetensors.index.json",
        "text_encoder/config.json", "text_encoder/model.safetensors",
        "tokenizer/tokenizer.json", "tokenizer/tokenizer_config.json",
        "vae/config.json", "vae/diffusion_pytorch_model.safetensors",
    ):  # fmt: skip
        assert (out / name).is_file(), name

    index = json.loads((out / "modular_model_index.json").read_text())
    assert index["_class_name"] == "PAN2ModularPipeline" and index["_diffusers_version"] == "0.37.0"
    assert set(index) - {"_class_name", "_diffusers_version"} == {*COMPONENTS, "tokenizer"}
    for name, entry in index.items():
        if name.startswith("_"):
            continue
        library, class_name, spec = entry
        assert COMPONENTS.get(name, (library, class_name)) == (library, class_name)
        assert spec == {
            "type_hint": [library, class_name],
            "pretrained_model_name_or_path": None,
            "subfolder": name,
            "variant": None,
            "revision": None,
        }
    scheduler = json.loads((out / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler == {
        "_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.37.0", "num_train_timesteps": 1000,
        "shift": 5.0, "shift_terminal": 0.1, "stochastic_sampling": True,
    }  # fmt: skip
    assert json.loads((out / "text_encoder" / "config.json").read_text())["model_type"] == "qwen3_5_text"

    shards = sorted((out / "transformer").glob("diffusion_pytorch_model-*.safetensors"))
    assert len(shards) >= 2
    model = load_pan2_transformer(out, subfolder="transformer", dtype=None)
    assert (
        model.config.text_embed_dim == 32
        and model.config.in_channels == 97
        and model.config.out_channels == 48
    )
    for key, value in model.state_dict().items():
        fp32 = ".norm1.linear." in f".{key}" or key.startswith("norm_out.linear.")
        assert value.dtype == (torch.float32 if fp32 else torch.bfloat16), key
        assert value.float().abs().max() > 0, f"{key} is all zeros"
    assert not torch.equal(model.context_type_embedding, torch.zeros_like(model.context_type_embedding))


def test_tokenizer_header_and_multimodal_text_encoder(tmp_path):
    from transformers import AutoTokenizer

    from pan2cli.testing.tiny_pan2 import write_tiny_pan2

    out = write_tiny_pan2(tmp_path / "PAN2", multimodal_text_encoder=True)
    assert json.loads((out / "text_encoder" / "config.json").read_text())["model_type"] == "qwen3_5"
    tok = AutoTokenizer.from_pretrained(str(out / "tokenizer"), local_files_only=True)
    assert tok.chat_template
    header = tok("<|im_start|>user\n", add_special_tokens=False)["input_ids"]
    for token in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        assert token in tok.all_special_tokens and len(tok(token, add_special_tokens=False)["input_ids"]) == 1
    for prompt in ("a cat", " ", "two\n\nlines", "Ünïcödé ☃ 123"):
        messages = [{"role": "system", "content": "S"}, {"role": "user", "content": prompt}]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        starts = [i for i in range(len(ids)) if ids[i : i + len(header)] == header]
        assert len(starts) == 1, prompt
        assert tok.decode(ids[starts[0] + len(header) :]) == prompt + "<|im_end|>\n<|im_start|>assistant\n"


def test_scheduler_config_default_and_options(tmp_path):
    """The release's config by default (shift 9); `--scheduler-option KEY=JSON` sets or (null) drops a key."""
    from click.testing import CliRunner

    from pan2cli.testing.tiny_pan2 import write_scheduler_config
    from scripts.make_tiny_pan2 import main

    path = write_scheduler_config(tmp_path)
    assert json.loads(path.read_text()) == {
        "_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.37.0", "num_train_timesteps": 1000,
        "shift": 9.0, "use_dynamic_shifting": False,
    }  # fmt: skip
    for bad, message in (("shift", "is not KEY=JSON"), ("shift=five", "the value is not JSON")):
        res = CliRunner().invoke(main, [str(tmp_path / "out"), "--scheduler-option", bad])
        assert res.exit_code == 2 and message in res.output
    assert not (tmp_path / "out").exists()
