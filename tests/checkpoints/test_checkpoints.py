"""pan2cli.checkpoints on tiny files: tensor files read lazily with their shapes, dtypes and metadata, every
failure worded once (CheckpointError for checkpoints, InputError for latents), sharded indexes, the strict
key check, JSON objects and the hub's file download."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pan2cli.checkpoints import files
from pan2cli.checkpoints.files import (
    ReadErrors,
    float_tensor,
    read_pickle,
    read_safetensors,
    read_state_dict,
    read_tensor_file,
    tensor_reader,
)
from pan2cli.checkpoints.json_files import read_json_object
from pan2cli.checkpoints.keys import check_keys, key_problems, listing
from pan2cli.checkpoints.sharded import FileView, tensor_locations, weight_files, weight_shapes
from pan2cli.errors import CheckpointError, DownloadError, InputError

LATENTS = ReadErrors(error=InputError, noun="latents file", loads="latents", hint="use a latents file")


class _NotATensor:
    """A class that weights_only=True refuses to unpickle."""


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(2, 3, generator=gen),
        "b.bias": torch.randn(4, generator=gen).to(torch.bfloat16),
        "steps": torch.arange(5),
    }


def _cut(path: Path) -> Path:
    """A copy of `path` with its second half missing."""
    data = path.read_bytes()
    cut = path.with_name(f"cut{path.suffix}")
    cut.write_bytes(data[: len(data) // 2])
    return cut


# -- safetensors ---------------------------------------------------------------------------------------
def test_safetensors_header_and_lazy_loads(tmp_path):
    tensors = _tensors()
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path), metadata={"fps": "24"})
    read = read_safetensors(path)
    assert read.path == path
    assert read.shapes == {"a.weight": (2, 3), "b.bias": (4,), "steps": (5,)}
    assert read.dtypes == {"a.weight": torch.float32, "b.bias": torch.bfloat16, "steps": torch.int64}
    assert read.metadata == {"fps": "24"}
    for key, tensor in tensors.items():
        assert torch.equal(read.load(key), tensor)


def test_safetensors_opened_once_for_every_load(tmp_path, monkeypatch):
    import safetensors

    first, second = tmp_path / "1.safetensors", tmp_path / "2.safetensors"
    save_file({"x": torch.ones(2)}, str(first))
    save_file({"y": torch.full((3,), 2.0), "z": torch.zeros(1)}, str(second))
    real, opened = safetensors.safe_open, []

    def counting(path, *args, **kwargs):
        opened.append(Path(path).name)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(safetensors, "safe_open", counting)
    read = tensor_reader({"x": first, "y": second, "z": second})
    assert torch.equal(read("y"), torch.full((3,), 2.0)) and torch.equal(read("x"), torch.ones(2))
    assert torch.equal(read("z"), torch.zeros(1)) and torch.equal(read("y"), torch.full((3,), 2.0))
    assert sorted(opened) == ["1.safetensors", "2.safetensors"]


def test_safetensors_unreadable_tensor_names_file_and_key(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"x": torch.ones(1)}, str(path))
    with pytest.raises(
        CheckpointError, match=rf"^{re.escape(str(path))}: tensor nope could not be read \(truncated file\?\)"
    ):
        read_safetensors(path).load("nope")


def test_truncated_safetensors(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file(_tensors(), str(path))
    cut = _cut(path)
    with pytest.raises(CheckpointError) as err:
        read_safetensors(cut, ReadErrors(hint="try another file"))
    assert str(err.value).startswith(f"{cut} could not be read (truncated or not a safetensors file): ")
    assert err.value.hint == "try another file"
    with pytest.raises(InputError) as err:
        read_safetensors(cut, LATENTS)
    assert not isinstance(err.value, CheckpointError)
    assert str(err.value).startswith(
        f"latents file {cut} could not be read (truncated or not a latents file)"
    )
    assert err.value.hint == "use a latents file"


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_empty_file(tmp_path, suffix):
    path = tmp_path / f"empty{suffix}"
    path.write_bytes(b"")
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))} is empty \(0 bytes\)$"):
        read_tensor_file(path)
    with pytest.raises(
        InputError, match=rf"^latents file {re.escape(str(path))} is empty \(0 bytes\)$"
    ) as err:
        (read_safetensors if suffix == ".safetensors" else read_pickle)(path, LATENTS)
    assert not isinstance(err.value, CheckpointError) and err.value.hint == "use a latents file"


# -- torch pickles -------------------------------------------------------------------------------------
@pytest.mark.parametrize("wrapped", [False, True], ids=["flat", "state_dict"])
@pytest.mark.parametrize("zipped", [True, False], ids=["zip", "legacy"])
def test_state_dict_pickle(tmp_path, wrapped, zipped):
    # Legacy (non-zip) pickles cannot be memory-mapped: they are read whole instead.
    tensors = _tensors()
    path = tmp_path / "w.pth"
    torch.save({"state_dict": tensors} if wrapped else tensors, path, _use_new_zipfile_serialization=zipped)
    read = read_tensor_file(path)
    assert read.shapes == {"a.weight": (2, 3), "b.bias": (4,), "steps": (5,)}
    assert read.dtypes == {"a.weight": torch.float32, "b.bias": torch.bfloat16, "steps": torch.int64}
    assert read.metadata == {}
    for key, tensor in tensors.items():
        assert torch.equal(read.load(key), tensor)


def test_pickle_holds_whatever_weights_only_allows(tmp_path):
    path = tmp_path / "z.pt"
    torch.save({"latents": torch.ones(2), "fps": 24}, path)
    obj = read_pickle(path, LATENTS)
    assert obj["fps"] == 24 and torch.equal(obj["latents"], torch.ones(2))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))} is not a state dict of tensors$"):
        read_state_dict(path)


@pytest.mark.parametrize("inside", [False, True], ids=["object", "object_in_dict"])
def test_pickled_objects_are_refused(tmp_path, inside):
    path = tmp_path / "evil.pth"
    torch.save({"w": torch.zeros(1), "extra": _NotATensor()} if inside else _NotATensor(), path)
    with pytest.raises(CheckpointError) as err:
        read_tensor_file(path)
    assert str(err.value) == (
        f"{path} holds objects other than plain tensors; pan2 loads checkpoints with weights_only=True"
    )
    objects = ReadErrors(error=InputError, noun="latents file", loads="latents", objects_hint="save a tensor")
    with pytest.raises(InputError) as err:
        read_pickle(path, objects)
    assert str(err.value) == (
        f"latents file {path} holds objects other than plain tensors; pan2 loads latents with weights_only=True"
    )
    assert err.value.hint == "save a tensor"


def test_truncated_pickle(tmp_path):
    path = tmp_path / "w.pth"
    torch.save(_tensors(), path)
    cut = _cut(path)
    with pytest.raises(
        CheckpointError, match=rf"^{re.escape(str(cut))} could not be read \(truncated or not a checkpoint\)"
    ):
        read_tensor_file(cut)


@pytest.mark.parametrize(
    "content", [b"these are not tensors\n", bytes(range(256)) * 4], ids=["text", "bytes"]
)
def test_foreign_bytes_are_unreadable_not_objects(tmp_path, content):
    # torch.load calls random bytes a weights_only refusal and advises weights_only=False: neither is said.
    path = tmp_path / "w.pth"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as err:
        read_tensor_file(path)
    message = str(err.value)
    assert message.startswith(f"{path} could not be read (truncated or not a checkpoint)")
    assert "plain tensors" not in message and "Weights only" not in message


def test_float_tensor():
    tensor = torch.ones(2, dtype=torch.float16)
    assert float_tensor(tensor, "here", "w") is tensor
    with pytest.raises(CheckpointError, match=r"^here: tensor w has dtype torch.int64, expected a float$"):
        float_tensor(torch.arange(2), "here", "w")


def test_loader_detail_keeps_one_short_line():
    assert files._loader_detail(RuntimeError("first line\nsecond line")) == "first line"
    assert files._loader_detail(RuntimeError("x" * 500)) == "x" * 200
    assert files._loader_detail(KeyError("101")) == ""


# -- sharded weights -----------------------------------------------------------------------------------
def _sharded(folder: Path, stem: str = "model") -> dict[str, torch.Tensor]:
    folder.mkdir(parents=True, exist_ok=True)
    tensors = _tensors()
    save_file({"a.weight": tensors["a.weight"]}, str(folder / f"{stem}-00001-of-00002.safetensors"))
    save_file(
        {k: tensors[k] for k in ("b.bias", "steps")}, str(folder / f"{stem}-00002-of-00002.safetensors")
    )
    weight_map = {
        "a.weight": f"{stem}-00001-of-00002.safetensors",
        "b.bias": f"{stem}-00002-of-00002.safetensors",
        "steps": f"{stem}-00002-of-00002.safetensors",
    }
    _write_index(folder, weight_map, stem)
    return tensors


def _write_index(folder: Path, weight_map: dict, stem: str = "model") -> Path:
    index = folder / f"{stem}.safetensors.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return index


def test_sharded_locations_and_shapes(tmp_path):
    tensors = _sharded(tmp_path)
    shapes, owners = tensor_locations(tmp_path, ("diffusion_pytorch_model", "model"))
    assert shapes == {"a.weight": (2, 3), "b.bias": (4,), "steps": (5,)}
    assert {k: p.name for k, p in owners.items()} == {
        "a.weight": "model-00001-of-00002.safetensors",
        "b.bias": "model-00002-of-00002.safetensors",
        "steps": "model-00002-of-00002.safetensors",
    }
    assert weight_shapes(tmp_path, ("model",)) == shapes
    read = tensor_reader(owners)
    assert all(torch.equal(read(key), tensor) for key, tensor in tensors.items())


def test_single_file_wins_over_a_later_stem(tmp_path):
    save_file({"w": torch.ones(1)}, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    _sharded(tmp_path)
    assert weight_files(tmp_path, ("diffusion_pytorch_model", "model")) == (
        None,
        [tmp_path / "diffusion_pytorch_model.safetensors"],
    )


def test_sharded_errors(tmp_path):
    _sharded(tmp_path)
    shard = tmp_path / "model-00002-of-00002.safetensors"
    with pytest.raises(CheckpointError, match="maps keys to shards that do not hold them: a.weight"):
        _write_index(tmp_path, {"a.weight": shard.name, "b.bias": shard.name, "steps": shard.name})
        tensor_locations(tmp_path, ("model",))
    with pytest.raises(CheckpointError, match=r"lists shard files outside its folder: \.\./x\.safetensors"):
        _write_index(tmp_path, {"a.weight": "../x.safetensors"})
        weight_files(tmp_path, ("model",))
    with pytest.raises(CheckpointError, match="has no weight_map"):
        _write_index(tmp_path, {})
        weight_files(tmp_path, ("model",))
    save_file({"a.weight": torch.ones(1)}, str(shard))
    with pytest.raises(
        CheckpointError, match="a.weight is in both model-00001-of-00002.safetensors and model-00002"
    ):
        _write_index(tmp_path, {"a.weight": "model-00001-of-00002.safetensors", "b.bias": shard.name})
        tensor_locations(tmp_path, ("model",))
    shard.write_bytes(shard.read_bytes()[:20])
    with pytest.raises(
        CheckpointError,
        match=rf"^{re.escape(str(shard))} could not be read \(truncated or not a safetensors file\)",
    ):
        tensor_locations(tmp_path, ("model",))
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"lists {shard.name}, not in {re.escape(str(tmp_path))}"):
        weight_files(tmp_path, ("model",))
    with pytest.raises(
        CheckpointError,
        match=r"has no weights\.safetensors \(or shards with weights\.safetensors\.index\.json\)",
    ):
        weight_files(tmp_path, ("weights",))


def test_a_file_view_decides_what_exists_and_how_paths_read(tmp_path):
    """The hub's view: files that are not on disk, headers from elsewhere, paths named `repo:path`."""
    listed = {tmp_path / "model.safetensors"}
    view = FileView(
        exists=lambda path: path in listed,
        tensor_shapes=lambda paths: [{"w": (2, 2)} for _ in paths],
        label=lambda path: f"org/repo:{path.relative_to(tmp_path).as_posix()}",
    )
    assert weight_shapes(tmp_path, ("model",), view) == {"w": (2, 2)}
    with pytest.raises(CheckpointError, match=r"^org/repo:\. has no other\.safetensors"):
        weight_files(tmp_path, ("other",), view)


# -- the strict key check ------------------------------------------------------------------------------
def test_key_problems_and_check_keys():
    expected = {"a": (2,), "b": (3,), "c": (1,)}
    assert key_problems({"a": (2,), "b": (3,), "c": (1,), "enc.x": (9,)}, expected, ("enc.",)) == []
    shapes = {"a": (2,), "b": (4,), "d": (1,), "enc.x": (9,)}
    assert key_problems(shapes, expected, ("enc.",)) == [
        "missing keys: c",
        "unexpected keys: d",
        "wrong shapes: b [4] (expected [3])",
    ]
    check_keys(expected, expected, "never raised")
    with pytest.raises(CheckpointError) as err:
        check_keys(shapes, expected, "w.safetensors does not match the model", hint="check the file")
    assert str(err.value) == (
        "w.safetensors does not match the model (missing keys: c; unexpected keys: d, enc.x; "
        "wrong shapes: b [4] (expected [3]))"
    )
    assert err.value.hint == "check the file"


def test_listing():
    assert listing(["c", "a", "b"]) == "a, b, c"
    assert listing([f"k{i}" for i in range(10)], 3) == "k0, k1, k2 (+7 more)"


# -- JSON objects --------------------------------------------------------------------------------------
def test_read_json_object(tmp_path):
    path = tmp_path / "config.json"
    path.write_text('{"num_layers": 2}')
    assert read_json_object(path) == {"num_layers": 2}
    path.write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))} is not a JSON object$"):
        read_json_object(path)
    path.write_text("{num_layers: 2}")
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))} is not readable JSON: "):
        read_json_object(path)
    with pytest.raises(CheckpointError, match="is not readable JSON"):
        read_json_object(tmp_path / "missing.json")


# -- the hub -------------------------------------------------------------------------------------------
def test_hub_file_errors_go_through_hub_errors(monkeypatch, tmp_path):
    import huggingface_hub

    import pan2cli.checkpoints.hub as hub

    monkeypatch.setattr(hub, "_unreachable", False)  # no reachability probe: nothing leaves this machine
    calls = []

    def download(repo_id, filename, *, subfolder=None, revision=None, **kwargs):
        calls.append((repo_id, filename, subfolder, revision))
        return str(tmp_path / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    with hub.hub_errors("org/vae", "main", what="the VAE", local_hint="pass a file"):
        path = hub.hub_file("org/vae", "config.json", subfolder="vae", revision="main")
    assert path == tmp_path / "config.json" and calls == [("org/vae", "config.json", "vae", "main")]

    def refused(*args, **kwargs):
        raise ConnectionRefusedError("connection refused")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", refused)
    with pytest.raises(
        DownloadError, match=r"^download of the VAE from org/vae@main failed: connection refused$"
    ):
        with hub.hub_errors("org/vae", "main", what="the VAE", local_hint="pass a file"):
            hub.hub_file("org/vae", "config.json", subfolder=None, revision="main")
