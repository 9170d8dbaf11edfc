"""Locating and checking a PAN 2 checkpoint (pan2cli.components.locate / hub_check): the release's layout
accepted, wrong checkpoints refused naming what does not match, before any weight is read or downloaded."""

from __future__ import annotations

import fnmatch
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import (  # bound before `no_tensor_reads` replaces safetensors' readers
    load_file,
    save_file,
)

import pan2cli.checkpoints.hub
from pan2cli.components.locate import resolve_components
from pan2cli.dit.checkpoint import save_pan2_transformer
from pan2cli.dit.model import PAN2Transformer3DModel
from pan2cli.errors import CheckpointError, DownloadError, InputError

TINY = dict(
    num_attention_heads=2,
    attention_head_dim=16,
    rope_axes_dim=(4, 6, 6),
    num_layers=1,
    num_refiner_layers=1,
    text_embed_dim=32,
)
REPO = "IFM/PAN2"
SHA = "0123456789abcdef0123456789abcdef01234567"
OTHER_SHA = "fedcba9876543210fedcba9876543210fedcba98"
CLASSES = {
    "transformer": ("diffusers", "PAN2Transformer3DModel"),
    "text_encoder": ("transformers", "Qwen3_5ForConditionalGeneration"),
    "tokenizer": ("transformers", "Qwen2TokenizerFast"),
    "vae": ("diffusers", "AutoencoderKLWan"),
    "scheduler": ("diffusers", "FlowMatchEulerDiscreteScheduler"),
}


def _write_json(path: Path, data) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2))


def _spec(name: str, repo: str | None = REPO, subfolder: str | None = None) -> list:
    library, class_name = CLASSES[name]
    spec = {
        "type_hint": [library, class_name],
        "pretrained_model_name_or_path": repo,
        "subfolder": subfolder or name,
        "variant": None,
        "revision": None,
    }
    return [library, class_name, spec]


def _modular_index(**specs) -> dict:
    index = {
        "_class_name": "PAN2ModularPipeline",
        "_diffusers_version": "0.37.0",
        "_blocks_class_name": "PAN2AutoBlocks",
    }
    index.update({name: _spec(name) for name in CLASSES})
    index.update(specs)
    return index


def _write_text_encoder(folder: Path, hidden_size: int = 32) -> None:
    _write_json(
        folder / "config.json",
        {"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text", "hidden_size": hidden_size}},
    )
    save_file(
        {"model.language_model.norm.weight": torch.ones(hidden_size)},
        str(folder / "model-00001-of-00001.safetensors"),
    )
    _write_json(
        folder / "model.safetensors.index.json",
        {
            "metadata": {},
            "weight_map": {"model.language_model.norm.weight": "model-00001-of-00001.safetensors"},
        },
    )


def _write_release(root: Path) -> Path:
    """A tiny repo in the release's layout: modular index, sharded transformer, stub text encoder and tokenizer, VAE, scheduler."""
    from pan2cli.testing.random_weights import write_test_checkpoints
    from pan2cli.vae.config import WanVAEConfig

    with torch.random.fork_rng(
        devices=[]
    ):  # the initialisation's weights, seeded, without touching the caller's RNG
        torch.manual_seed(0)
        transformer = PAN2Transformer3DModel(**TINY)
    save_pan2_transformer(transformer, root / "transformer", max_shard_bytes=100_000)
    _write_text_encoder(root / "text_encoder")
    _write_json(root / "tokenizer" / "tokenizer.json", {"version": "1.0"})
    _write_json(root / "tokenizer" / "tokenizer_config.json", {"tokenizer_class": "Qwen2Tokenizer"})
    (root / "tokenizer" / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    )
    vae = write_test_checkpoints(
        root / "_vae", WanVAEConfig(base_dim=16, decoder_base_dim=16), seed=0, formats=("diffusers",)
    )["diffusers"]
    shutil.move(str(vae), root / "vae")
    shutil.rmtree(root / "_vae")
    _write_json(
        root / "scheduler" / "scheduler_config.json",
        {"_class_name": "FlowMatchEulerDiscreteScheduler", "num_train_timesteps": 1000, "shift": 3.0},
    )
    _write_json(root / "modular_model_index.json", _modular_index())
    return root


@pytest.fixture(scope="module")
def release_template(tmp_path_factory) -> Path:
    return _write_release(tmp_path_factory.mktemp("release") / "PAN2")


@pytest.fixture
def release(release_template, tmp_path) -> Path:
    """A fresh copy of the tiny release for a test to change."""
    return Path(shutil.copytree(release_template, tmp_path / "PAN2"))


@pytest.fixture
def no_tensor_reads(monkeypatch):
    """Any tensor read through safetensors fails the test: the checks must use headers only."""
    import safetensors
    import safetensors.torch

    real = safetensors.safe_open
    reads = []

    class HeaderOnly:
        def __init__(self, *args, **kwargs):
            self._handle = real(*args, **kwargs)

        def __enter__(self):
            self._handle.__enter__()
            return self

        def __exit__(self, *exc):
            return self._handle.__exit__(*exc)

        def get_tensor(self, key):
            reads.append(key)
            raise AssertionError(f"tensor {key} was read during the checks")

        def __getattr__(self, name):
            return getattr(self._handle, name)

    def load_file(*args, **kwargs):
        raise AssertionError("a whole safetensors file was read during the checks")

    monkeypatch.setattr(safetensors, "safe_open", HeaderOnly)
    monkeypatch.setattr(safetensors.torch, "load_file", load_file)
    return reads


def _single_file_transformer(folder: Path) -> dict[str, torch.Tensor]:
    """Rewrite the sharded transformer as one file; returns its state dict (to be changed and saved again)."""
    state = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(shard)))
        shard.unlink()
    (folder / "diffusion_pytorch_model.safetensors.index.json").unlink()
    return state


# -- local folders ------------------------------------------------------------------------------------
def test_release_layout_accepted_without_reading_tensors(release, no_tensor_reads):
    components = resolve_components(release)
    assert components.model_id == str(release.resolve()) and components.revision is None
    for name in ("transformer", "text_encoder", "tokenizer", "vae", "scheduler"):
        assert components.folder(name) == release.resolve() / name
    assert components.num_train_timesteps == 1000 and components.scheduler_shift == 3.0
    assert (
        components.transformer_arguments["num_layers"] == 1
        and components.transformer_arguments["text_embed_dim"] == 32
    )
    assert no_tensor_reads == []


def test_folder_without_index_or_scheduler_accepted(release):
    (release / "modular_model_index.json").unlink()
    shutil.rmtree(release / "scheduler")
    components = resolve_components(str(release))
    assert components.folder("vae") == release.resolve() / "vae"
    assert components.num_train_timesteps == 1000 and components.scheduler_shift is None


def test_index_subfolders_are_followed(release):
    (release / "transformer").rename(release / "dit")
    _write_json(
        release / "modular_model_index.json",
        _modular_index(transformer=_spec("transformer", subfolder="dit")),
    )
    assert resolve_components(release).folder("transformer") == release.resolve() / "dit"


def test_snapshot_folder_in_the_hub_cache_records_its_commit(release_template, tmp_path):
    snapshot = Path(shutil.copytree(release_template, tmp_path / "models--IFM--PAN2" / "snapshots" / SHA))
    assert resolve_components(snapshot).revision == SHA


@pytest.mark.parametrize(
    ("index_name", "class_name"),
    [("modular_model_index.json", "WanModularPipeline"), ("model_index.json", "WanPipeline")],
)
def test_index_of_another_pipeline_refused(release, index_name, class_name):
    (release / "modular_model_index.json").unlink()
    _write_json(
        release / index_name,
        {"_class_name": class_name, "transformer": ["diffusers", "WanTransformer3DModel"]},
    )
    with pytest.raises(CheckpointError, match=f"describes a {class_name}, not a PAN 2 pipeline") as info:
        resolve_components(release)
    assert info.value.exit_code == 2


def test_missing_component_folder_named(release):
    shutil.rmtree(release / "vae")
    shutil.rmtree(release / "tokenizer")
    with pytest.raises(CheckpointError, match=r"has no tokenizer/, vae/ \(a PAN 2 checkpoint needs") as info:
        resolve_components(release)
    assert (
        info.value.hint == "its index takes them from IFM/PAN2: pass --model IFM/PAN2 to fetch from the hub"
    )  # no download


def test_transformer_config_of_another_model_refused(release, no_tensor_reads):
    config = {
        "_class_name": "WanTransformer3DModel",
        "_diffusers_version": "0.35.0",
        "num_layers": 30,
        "in_channels": 48,
    }
    _write_json(release / "transformer" / "config.json", config)
    with pytest.raises(
        CheckpointError, match="describes a WanTransformer3DModel, not a PAN2Transformer3DModel"
    ):
        resolve_components(release)


def test_unknown_transformer_config_keys_named(release, no_tensor_reads):
    config = json.loads((release / "transformer" / "config.json").read_text())
    _write_json(
        release / "transformer" / "config.json", {**config, "qk_norm": "rms_norm", "guidance_embeds": False}
    )
    with pytest.raises(
        CheckpointError, match="not PAN2Transformer3DModel config keys: guidance_embeds, qk_norm"
    ):
        resolve_components(release)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("missing", r"missing keys: proj_out\.bias"),
        ("unexpected", r"unexpected keys: transformer_blocks\.7\.attn\.to_q\.weight"),
        ("misshaped", r"wrong shapes: norm_out\.linear\.weight \[64, 16\] \(expected \[64, 32\]\)"),
    ],
)
def test_tensor_names_and_shapes_checked_from_headers(release, no_tensor_reads, change, expected):
    state = _single_file_transformer(release / "transformer")
    if change == "missing":
        del state["proj_out.bias"]
    elif change == "unexpected":
        state["transformer_blocks.7.attn.to_q.weight"] = torch.zeros(32, 32)
    else:
        state["norm_out.linear.weight"] = torch.zeros(64, 16)
    save_file(state, str(release / "transformer" / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(CheckpointError, match=expected) as info:
        resolve_components(release)
    assert info.value.exit_code == 2 and no_tensor_reads == []


def test_shard_listed_in_index_but_absent_named(release):
    shard = sorted((release / "transformer").glob("*-00002-of-*.safetensors"))[0]
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"lists {shard.name}, not in"):
        resolve_components(release)


def test_tokenizer_without_chat_template_named(release):
    (release / "tokenizer" / "chat_template.jinja").unlink()
    with pytest.raises(CheckpointError, match="tokenizer has no chat template"):
        resolve_components(release)


def test_text_encoder_of_another_width_named(release):
    shutil.rmtree(release / "text_encoder")
    _write_text_encoder(release / "text_encoder", hidden_size=48)
    with pytest.raises(
        CheckpointError, match="has hidden_size 48, but the transformer's text_embed_dim is 32"
    ):
        resolve_components(release)


def test_vae_of_another_model_refused(release):
    _write_json(release / "vae" / "config.json", {"_class_name": "AutoencoderKLHunyuanVideo"})
    with pytest.raises(CheckpointError, match="describes a AutoencoderKLHunyuanVideo, not a Wan VAE"):
        resolve_components(release)


def test_bad_scheduler_values_named(release):
    _write_json(release / "scheduler" / "scheduler_config.json", {"num_train_timesteps": 0})
    with pytest.raises(CheckpointError, match="num_train_timesteps must be a positive whole number, got 0"):
        resolve_components(release)


def test_weight_variants_refused(release):
    spec = _spec("transformer")
    spec[2]["variant"] = "bf16"
    _write_json(release / "modular_model_index.json", _modular_index(transformer=spec))
    with pytest.raises(CheckpointError, match="transformer names the weight variant 'bf16'"):
        resolve_components(release)


def test_no_such_folder_and_file_are_input_errors(tmp_path):
    with pytest.raises(InputError, match="no such folder"):
        resolve_components(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError, match="is a file"):
        resolve_components(tmp_path / "file")


# -- the hub (huggingface_hub's functions replaced by a fake hub serving local folders) ----------------
def _hub_http_client():
    """The HTTP library huggingface_hub's errors carry responses of: httpx2 (huggingface_hub 2.x) or httpx (1.x)."""
    try:
        import httpx2 as http
    except ImportError:
        import httpx as http
    return http


class FakeHub:
    """Serves local folders as hub repos and records every request, in order."""

    def __init__(self, cache: Path, repos: dict[str, tuple[Path, str]]):
        self.cache, self.repos, self.calls = cache, repos, []

    def _repo(self, repo_id: str, revision: str | None) -> tuple[Path, str]:
        from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

        http = _hub_http_client()
        response = http.Response(
            404, request=http.Request("GET", f"https://huggingface.co/api/models/{repo_id}")
        )
        if repo_id not in self.repos:
            raise RepositoryNotFoundError(f"404: {repo_id}", response=response)
        folder, sha = self.repos[repo_id]
        if revision not in (None, "main", sha):
            raise RevisionNotFoundError(f"404: {revision}", response=response)
        return folder, sha

    def _files(self, folder: Path) -> list[str]:
        return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())

    def snapshot_download(self, repo_id, *, revision=None, allow_patterns=None, **kwargs):
        self.calls.append(("snapshot", repo_id, revision, tuple(allow_patterns)))
        folder, sha = self._repo(repo_id, revision)
        snapshot = self.cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / sha
        for name in self._files(folder):
            if any(fnmatch.fnmatch(name, pattern) for pattern in allow_patterns):
                (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(folder / name, snapshot / name)
        return str(snapshot)

    def list_repo_files(self, repo_id, *, revision=None, **kwargs):
        self.calls.append(("list", repo_id, revision))
        return self._files(self._repo(repo_id, revision)[0])

    def parse_safetensors_file_metadata(self, repo_id, filename, *, revision=None, **kwargs):
        from safetensors import safe_open

        self.calls.append(("header", repo_id, filename, revision))
        path = self._repo(repo_id, revision)[0] / filename
        with safe_open(str(path), framework="pt") as handle:
            tensors = {
                key: SimpleNamespace(shape=list(handle.get_slice(key).get_shape())) for key in handle.keys()
            }
        return SimpleNamespace(tensors=tensors)

    def kinds(self) -> list[str]:
        return [call[0] for call in self.calls]

    def weight_calls(self) -> list[tuple]:
        return [
            call
            for call in self.calls
            if call[0] == "snapshot" and any(p.endswith(".safetensors") for p in call[3])
        ]


@pytest.fixture
def fake_hub(monkeypatch, tmp_path):
    import huggingface_hub
    from huggingface_hub import constants

    def install(repos: dict[str, tuple[Path, str]]) -> FakeHub:
        hub = FakeHub(tmp_path / "hub-cache", repos)
        for name in ("snapshot_download", "list_repo_files", "parse_safetensors_file_metadata"):
            monkeypatch.setattr(huggingface_hub, name, getattr(hub, name))
        return hub

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv(
        "HF_HUB_OFFLINE", raising=False
    )  # a machine without network may set it (the device's does)
    monkeypatch.setattr(
        pan2cli.checkpoints.hub, "_unreachable", False
    )  # the fake hub answers: no reachability probe
    return install


def _expected_weights(release: Path) -> list[str]:
    index = json.loads(
        (release / "transformer" / "diffusion_pytorch_model.safetensors.index.json").read_text()
    )
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2  # the fixture is sharded
    return sorted([
        "transformer/diffusion_pytorch_model.safetensors.index.json", *(f"transformer/{s}" for s in shards),
        "text_encoder/model.safetensors.index.json", "text_encoder/model-00001-of-00001.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
    ])  # fmt: skip


def test_hub_checks_small_files_and_headers_before_one_weight_download(release, fake_hub):
    hub = fake_hub({REPO: (release, SHA)})
    components = resolve_components(REPO, "main")
    kinds = hub.kinds()
    # index (resolves the commit), small files, file list, headers, then the weights: once
    assert kinds[:3] == ["snapshot", "snapshot", "list"] and kinds[-1] == "snapshot"
    assert set(kinds[3:-1]) == {"header"}
    assert hub.calls[0] == ("snapshot", REPO, "main", ("modular_model_index.json", "model_index.json"))
    small = hub.calls[1][3]
    assert (
        hub.calls[1][2] == SHA
        and "transformer/*.json" in small
        and not any(p.endswith(".safetensors") for p in small)
    )
    headers = sorted(call[2] for call in hub.calls if call[0] == "header")
    weights = _expected_weights(release)
    assert headers == sorted(
        w for w in weights if w.startswith(("transformer/diffusion_pytorch_model-", "vae/"))
    )
    assert all(call[3] == SHA for call in hub.calls if call[0] == "header")
    assert hub.weight_calls() == [("snapshot", REPO, SHA, tuple(weights))]
    assert components.model_id == REPO and components.revision == SHA
    snapshot = hub.cache / "models--IFM--PAN2" / "snapshots" / SHA
    assert components.root == snapshot and components.folder("transformer") == snapshot / "transformer"
    assert (snapshot / weights[-1]).is_file() and components.scheduler_shift == 3.0
    assert components.sources["vae"] == f"{REPO}@{SHA[:12]}:vae"


def test_hub_wrong_tensors_fail_before_the_weight_download(release, fake_hub):
    state = _single_file_transformer(release / "transformer")
    state["transformer_blocks.0.ff.net.2.weight"] = torch.zeros(32, 64)
    save_file(state, str(release / "transformer" / "diffusion_pytorch_model.safetensors"))
    hub = fake_hub({REPO: (release, SHA)})
    with pytest.raises(
        CheckpointError, match=r"wrong shapes: transformer_blocks\.0\.ff\.net\.2\.weight \[32, 64\]"
    ) as info:
        resolve_components(REPO)
    assert f"{REPO}@{SHA[:12]}:transformer" in str(info.value)
    assert ("header", REPO, "transformer/diffusion_pytorch_model.safetensors", SHA) in hub.calls
    assert hub.weight_calls() == [] and not list(hub.cache.rglob("*.safetensors"))


def test_hub_transformer_of_another_model_fails_before_any_header(release, fake_hub):
    _write_json(
        release / "transformer" / "config.json", {"_class_name": "WanTransformer3DModel", "num_layers": 30}
    )
    hub = fake_hub({REPO: (release, SHA)})
    with pytest.raises(CheckpointError, match="describes a WanTransformer3DModel"):
        resolve_components(REPO)
    assert "header" not in hub.kinds() and hub.weight_calls() == []


def test_hub_missing_component_named_before_any_header(release, fake_hub):
    shutil.rmtree(release / "text_encoder")
    hub = fake_hub({REPO: (release, SHA)})
    with pytest.raises(CheckpointError, match=rf"{REPO}@{SHA[:12]} has no text_encoder/"):
        resolve_components(REPO)
    assert "header" not in hub.kinds() and hub.weight_calls() == []


def test_hub_index_of_another_pipeline_fails_after_one_request(release, fake_hub):
    _write_json(release / "modular_model_index.json", {"_class_name": "QwenImageModularPipeline"})
    hub = fake_hub({REPO: (release, SHA)})
    with pytest.raises(CheckpointError, match="describes a QwenImageModularPipeline"):
        resolve_components(REPO)
    assert len(hub.calls) == 1


def test_hub_component_in_another_repo_is_fetched_from_it(release, tmp_path, fake_hub):
    other = tmp_path / "other"
    other.mkdir()
    shutil.move(str(release / "text_encoder"), other / "encoder")
    _write_json(
        release / "modular_model_index.json",
        _modular_index(text_encoder=_spec("text_encoder", "Qwen/Qwen3.5-9B", "encoder")),
    )
    hub = fake_hub({REPO: (release, SHA), "Qwen/Qwen3.5-9B": (other, OTHER_SHA)})
    components = resolve_components(REPO)
    assert (
        components.folder("text_encoder")
        == hub.cache / "models--Qwen--Qwen3.5-9B" / "snapshots" / OTHER_SHA / "encoder"
    )
    assert [call[1] for call in hub.weight_calls()] == [REPO, "Qwen/Qwen3.5-9B"]
    assert hub.weight_calls()[1][3] == (
        "encoder/model-00001-of-00001.safetensors",
        "encoder/model.safetensors.index.json",
    )
    assert (
        components.revision == SHA
        and components.sources["text_encoder"] == f"Qwen/Qwen3.5-9B@{OTHER_SHA[:12]}:encoder"
    )


def test_hub_offline_takes_the_cache_and_checks_the_cached_files(release, fake_hub, monkeypatch):
    from huggingface_hub import constants

    state = _single_file_transformer(release / "transformer")
    state["extra.weight"] = torch.zeros(1)
    save_file(state, str(release / "transformer" / "diffusion_pytorch_model.safetensors"))
    hub = fake_hub({REPO: (release, SHA)})  # stands for the cache: nothing is listed or read remotely
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(CheckpointError, match=r"unexpected keys: extra\.weight"):
        resolve_components(REPO)
    assert "list" not in hub.kinds() and "header" not in hub.kinds()
    assert (
        len(hub.weight_calls()) == 1
        and "transformer/diffusion_pytorch_model.safetensors" in hub.weight_calls()[0][3]
    )


def test_hub_offline_good_cache_records_the_cached_commit(release, fake_hub, monkeypatch):
    from huggingface_hub import constants

    hub = fake_hub({REPO: (release, SHA)})
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    components = resolve_components(REPO)
    assert components.revision == SHA and "header" not in hub.kinds()
    assert hub.weight_calls()[0][3] == tuple(_expected_weights(release))


def test_hub_no_such_repo_or_revision_is_input_error(release, fake_hub):
    fake_hub({REPO: (release, SHA)})
    with pytest.raises(InputError, match="no Hugging Face repository 'IFM/PAN3'"):
        resolve_components("IFM/PAN3")
    with pytest.raises(InputError, match="IFM/PAN2 has no revision 'v9'"):
        resolve_components(REPO, "v9")


def test_hub_unreachable_without_cache_is_download_error(fake_hub, monkeypatch):
    import huggingface_hub
    from huggingface_hub.errors import LocalEntryNotFoundError

    def offline(*args, **kwargs):
        raise LocalEntryNotFoundError("outgoing traffic has been disabled")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(DownloadError, match="no copy is cached") as info:
        resolve_components(REPO)
    assert info.value.exit_code == 1


def test_real_huggingface_hub_offline_reads_a_cached_snapshot(release_template, tmp_path, monkeypatch):
    """huggingface_hub's own snapshot_download (offline, so no request is made) on a cache laid out as it writes one."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    repo = cache / "models--IFM--PAN2"
    shutil.copytree(release_template, repo / "snapshots" / SHA)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(SHA)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # what users set; some 1.x versions read the variable itself
    components = resolve_components(REPO)
    assert (
        components.revision == SHA
        and components.folder("tokenizer") == repo / "snapshots" / SHA / "tokenizer"
    )
    with pytest.raises(DownloadError, match="no copy is cached"):
        resolve_components("IFM/Other")


# -- through the CLI: one `Error:` line naming the problem, exit 2, nothing written ---------------------
@pytest.mark.parametrize(
    ("case", "named"),
    [
        ("missing component", "has no vae/"),
        ("another pipeline", "describes a WanPipeline, not a PAN 2 pipeline"),
        ("another transformer", "describes a WanTransformer3DModel, not a PAN2Transformer3DModel"),
        ("unknown config key", "not PAN2Transformer3DModel config keys: qk_norm"),
        ("wrong tensor shape", r"wrong shapes: proj_out.weight [8, 32] (expected [192, 32])"),
    ],
)
def test_generate_refuses_a_wrong_checkpoint_in_one_line(release, run_cli, tmp_path, case, named):
    if case == "missing component":
        shutil.rmtree(release / "vae")
    elif case == "another pipeline":
        _write_json(release / "modular_model_index.json", {"_class_name": "WanPipeline"})
    elif case == "another transformer":
        _write_json(release / "transformer" / "config.json", {"_class_name": "WanTransformer3DModel"})
    elif case == "unknown config key":
        config = json.loads((release / "transformer" / "config.json").read_text())
        _write_json(release / "transformer" / "config.json", {**config, "qk_norm": "rms_norm"})
    else:
        state = _single_file_transformer(release / "transformer")
        state["proj_out.weight"] = torch.zeros(8, 32)
        save_file(state, str(release / "transformer" / "diffusion_pytorch_model.safetensors"))
    out = tmp_path / "x.mp4"
    res = run_cli(
        "generate",
        "a cat",
        "--model",
        release,
        "--device",
        "cpu",
        "--steps",
        2,
        "--frames",
        5,
        "--size",
        "64x96",
        "-o",
        out,
    )
    assert res.exit_code == 2, res.stderr
    first = res.stderr.splitlines()[0]
    assert first.startswith("Error: ") and named in first, res.stderr
    assert not any(line.startswith("Error: ") for line in res.stderr.splitlines()[1:])
    assert not out.exists() and not (tmp_path / "x.json").exists()
