"""Where a component's tensors are: its safetensors files (one, or shards listed by an index) and, from their
headers alone, every tensor's name, shape and file.

One walk serves the transformer's loader, the text encoder's key check and the checks run before a download
(`pan2cli.components.checks`), on disk or, through a `FileView`, on a hub repo.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from pan2cli.checkpoints.json_files import read_json_object
from pan2cli.checkpoints.keys import listing
from pan2cli.errors import CheckpointError

Shapes = dict[str, tuple[int, ...]]


def index_weight_map(index: Path) -> dict[str, str]:
    """Checkpoint key → shard file name, from a `*.safetensors.index.json` (checked to be non-empty strings)."""
    weight_map = read_json_object(index).get("weight_map")
    if (
        not isinstance(weight_map, dict)
        or not weight_map
        or not all(isinstance(v, str) for v in weight_map.values())
    ):
        raise CheckpointError(f"{index} has no weight_map of key → shard file")
    return weight_map


def _local_tensor_shapes(paths: list[Path]) -> list[Shapes]:
    """Tensor name → shape of each file, from its header (memory-mapped; no tensor is read)."""
    from pan2cli.checkpoints.files import read_safetensors

    return [read_safetensors(path).shapes for path in paths]


@dataclass(frozen=True)
class FileView:
    """How a checkpoint's files are seen (small files are on disk either way).

    Args:
        exists: whether a file, or a folder holding files, is in the checkpoint.
        tensor_shapes: tensor name → shape of each safetensors file, from the headers only.
        label: how messages name a path.
    """

    exists: Callable[[Path], bool] = Path.exists
    tensor_shapes: Callable[[list[Path]], list[Shapes]] = _local_tensor_shapes
    label: Callable[[Path], str] = str


LOCAL_FILES = FileView()


def weight_files(
    folder: Path, stems: tuple[str, ...], files: FileView = LOCAL_FILES
) -> tuple[Path | None, list[Path]]:
    """The index (None for a single file) and the safetensors files of a component, checked to exist.

    Args:
        folder: the component's folder.
        stems: file name stems to look for, first match wins (`<stem>.safetensors.index.json`, then `<stem>.safetensors`).
        files: how the files are seen.

    Raises:
        CheckpointError: no weights, a malformed index, or shards the index lists that are not there.
    """
    for stem in stems:
        index = folder / f"{stem}.safetensors.index.json"
        if files.exists(index):
            shards = sorted(set(index_weight_map(index).values()))
            odd = [name for name in shards if Path(name).name != name or name in (".", "..")]
            if odd:
                raise CheckpointError(
                    f"{files.label(index)} lists shard files outside its folder: {listing(odd)}"
                )
            missing = [name for name in shards if not files.exists(folder / name)]
            if missing:
                raise CheckpointError(
                    f"{files.label(index)} lists {listing(missing)}, not in {files.label(folder)}"
                )
            return index, [folder / name for name in shards]
        single = folder / f"{stem}.safetensors"
        if files.exists(single):
            return None, [single]
    names = " or ".join(
        f"{stem}.safetensors (or shards with {stem}.safetensors.index.json)" for stem in stems
    )
    raise CheckpointError(f"{files.label(folder)} has no {names}")


def tensor_locations(
    folder: Path, stems: tuple[str, ...], files: FileView = LOCAL_FILES
) -> tuple[Shapes, dict[str, Path]]:
    """Tensor name → shape, and tensor name → the file holding it, over all the files of a component; the index
    checked against the headers.

    Raises:
        CheckpointError: see `weight_files`; a key in two shards, or an index mapping keys to shards that do not hold them.
    """
    index, paths = weight_files(folder, stems, files)
    shapes: Shapes = {}
    owner: dict[str, Path] = {}
    for path, header in zip(paths, files.tensor_shapes(paths)):
        for key, shape in header.items():
            if key in owner:
                raise CheckpointError(
                    f"{key} is in both {owner[key].name} and {path.name} ({files.label(folder)})"
                )
            shapes[key], owner[key] = tuple(shape), path
    if index is not None:
        wrong = sorted(
            key
            for key, shard in index_weight_map(index).items()
            if key not in owner or owner[key].name != shard
        )
        if wrong:
            raise CheckpointError(
                f"{files.label(index)} maps keys to shards that do not hold them: {listing(wrong)}"
            )
    return shapes, owner


def weight_shapes(folder: Path, stems: tuple[str, ...], files: FileView = LOCAL_FILES) -> Shapes:
    """Tensor name → shape over all the files of a component (see `tensor_locations`)."""
    return tensor_locations(folder, stems, files)[0]
