"""Fetch a PAN 2 checkpoint from the Hugging Face hub, checking it before its weights are downloaded.

Requests, in order (each through a `pan2cli.checkpoints.hub` function; errors mapped by `hub_errors`):
1. `modular_model_index.json` / `model_index.json` (`snapshot_download`, which resolves the revision to a
   commit; every later request is pinned to that commit);
2. the small files of every component: config JSONs, safetensors indexes, tokenizer files;
3. the repo's file list;
4. the checks of `component_checks` on them, with the safetensors headers of the transformer's shards and
   of the VAE read by HTTP range requests (`parse_safetensors_file_metadata`, what
   `get_safetensors_metadata` does per shard; that one only looks at the repo root, not in `transformer/`);
5. the weights: one `snapshot_download` per repo, with huggingface_hub's progress bars.
Offline (`HF_HUB_OFFLINE=1`, or the hub unreachable) 3 and 4 are skipped: 5 takes the weights from the
cache (or fails naming the repo), then the same checks run on the cached files before anything loads.
A component whose index spec names another repo is fetched from that repo the same way.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pan2cli.checkpoints.hub import hub_errors, hub_list_files, hub_snapshot, hub_tensor_shapes
from pan2cli.checkpoints.sharded import LOCAL_FILES, FileView, Shapes, index_weight_map
from pan2cli.components.checks import WEIGHT_STEMS, CheckedComponents, check_components
from pan2cli.components.layout import (
    COMPONENTS,
    INDEX_FILES,
    ComponentPlace,
    PAN2Components,
    cached_commit,
    missing_components_error,
    read_pipeline_index,
)
from pan2cli.errors import CheckpointError
from pan2cli.paths import looks_like_path

_LOCAL_HINT = "pass --model PATH to a local PAN 2 folder (or connect to the hub / unset HF_HUB_OFFLINE)"
_TOKENIZER_PATTERNS = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")
_HEADER_WORKERS = 8


@dataclass
class _Repo:
    """One hub repo the checkpoint's files come from, and what was learnt about it."""

    repo_id: str
    revision: str | None  # as asked
    places: list[ComponentPlace] = field(default_factory=list)
    root: Path | None = None  # snapshot folder
    commit: str | None = None
    files: set[str] | None = None  # every file path; None when offline

    @property
    def where(self) -> str:
        ref = self.commit[:12] if self.commit else self.revision
        return f"{self.repo_id}@{ref}" if ref else self.repo_id

    def snapshot(self, patterns: list[str], what: str) -> Path:
        with hub_errors(self.repo_id, self.revision, what=what, local_hint=_LOCAL_HINT):
            root = hub_snapshot(self.repo_id, self.commit or self.revision, patterns)
        self.root, self.commit = root, cached_commit(root) or self.commit
        return root


def _prefix(place: ComponentPlace) -> str:
    return f"{place.subfolder}/" if place.subfolder else ""


def _small_patterns(place: ComponentPlace) -> list[str]:
    patterns = _TOKENIZER_PATTERNS if place.name == "tokenizer" else ("*.json",)
    return [_prefix(place) + pattern for pattern in patterns]


def _weight_patterns(repo: _Repo, place: ComponentPlace) -> list[str]:
    """The exact weight files of a component: the shards its index lists (fetched with the small files), or the single file."""
    stems = WEIGHT_STEMS.get(place.name, ())
    for stem in stems:
        index = place.folder(repo.root) / f"{stem}.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(index_weight_map(index).values()))
            return [_prefix(place) + name for name in (index.name, *shards)]
    singles = [f"{_prefix(place)}{stem}.safetensors" for stem in stems]
    return [name for name in singles if repo.files is None or name in repo.files]


def _is_this_repo(repo_id: str | None, main: str) -> bool:
    # A spec holding a local path (an index saved from a local copy) cannot point at the hub: this repo.
    return repo_id is None or repo_id.lower() == main.lower() or looks_like_path(repo_id)


def _hub_view(repos: list[_Repo]) -> FileView:
    """The checks' view of hub repos: their file lists, and headers read by range requests (several at once)."""

    def locate(path: Path) -> tuple[_Repo, str]:
        for repo in repos:
            if path == repo.root or repo.root in path.parents:
                return repo, path.relative_to(repo.root).as_posix()
        raise ValueError(f"{path} is in no snapshot of {', '.join(r.repo_id for r in repos)}")

    def exists(path: Path) -> bool:
        repo, rel = locate(path)
        return rel == "." or rel in repo.files or any(name.startswith(rel + "/") for name in repo.files)

    def label(path: Path) -> str:
        repo, rel = locate(path)
        return repo.where if rel == "." else f"{repo.where}:{rel}"

    def header(path: Path) -> Shapes:
        from huggingface_hub.errors import (
            EntryNotFoundError,
            LocalEntryNotFoundError,
            SafetensorsParsingError,
        )

        repo, rel = locate(path)
        with hub_errors(repo.repo_id, repo.revision, what=f"the header of {rel}", local_hint=_LOCAL_HINT):
            try:
                return hub_tensor_shapes(repo.repo_id, rel, repo.commit)
            except SafetensorsParsingError as exc:
                raise CheckpointError(f"{label(path)} is not a safetensors file: {exc}") from exc
            except EntryNotFoundError as exc:
                if isinstance(exc, LocalEntryNotFoundError):
                    raise
                raise CheckpointError(f"{label(path)} could not be found on the hub") from exc

    def tensor_shapes(paths: list[Path]) -> list[Shapes]:
        with ThreadPoolExecutor(max_workers=max(1, min(_HEADER_WORKERS, len(paths)))) as pool:
            return list(pool.map(header, paths))

    return FileView(exists=exists, tensor_shapes=tensor_shapes, label=label)


def hub_components(repo_id: str, revision: str | None = None) -> PAN2Components:
    """Fetch and check a PAN 2 checkpoint from the hub (see the module docstring for the order of requests).

    Raises:
        InputError: no such repository or revision. DownloadError: network, gated, offline with nothing cached.
        CheckpointError: what does not match (named), before any weight is downloaded when the hub is reachable.
    """
    # 1. The pipeline index; the snapshot folder is named by the commit the revision resolves to.
    main = _Repo(repo_id, revision)
    main.snapshot(list(INDEX_FILES), "the PAN 2 checkpoint")
    places = read_pipeline_index(main.root, label=lambda path: f"{main.where}:{path.name}")
    repos = {(repo_id, None): main}
    for place in places.values():
        key = (repo_id, None) if _is_this_repo(place.repo_id, repo_id) else (place.repo_id, place.revision)
        repos.setdefault(key, _Repo(*key)).places.append(place)
    # 2. Small files; 3. file lists
    for repo in repos.values():
        repo.snapshot(
            sorted({p for place in repo.places for p in _small_patterns(place)}), "the PAN 2 configs"
        )
        with hub_errors(repo.repo_id, repo.revision, what="the file list", local_hint=_LOCAL_HINT):
            repo.files = hub_list_files(repo.repo_id, repo.commit)
    folders = {place.name: place.folder(repo.root) for repo in repos.values() for place in repo.places}
    online = all(repo.files is not None for repo in repos.values())
    view = _hub_view(list(repos.values())) if online else LOCAL_FILES
    # 4. Checks before the download (the hub's file lists and headers)
    if online:
        checked, folders = _check(repos, folders, view)
    # 5. The weights (offline: from the cache), one call per repo
    for repo in repos.values():
        patterns = sorted({p for place in repo.places for p in _weight_patterns(repo, place)})
        if patterns:
            repo.snapshot(patterns, "the PAN 2 weights")
    if not online:  # the same checks on the cached files, before anything loads
        checked, folders = _check(repos, folders, view)
    sources = {
        place.name: _source(repo, place)
        for repo in repos.values()
        for place in repo.places
        if place.name in folders
    }
    return PAN2Components(
        main.root, repo_id, main.commit, checked.scheduler, folders, sources,
        checked.transformer_arguments,
    )  # fmt: skip


def _source(repo: _Repo, place: ComponentPlace) -> str:
    return f"{repo.where}:{place.subfolder}" if place.subfolder else repo.where


def _check(
    repos: dict, folders: dict[str, Path], view: FileView
) -> tuple[CheckedComponents, dict[str, Path]]:
    """Required folders present (named per repo), then `check_components`; returns the folders that exist."""
    for repo in repos.values():
        missing = [
            place
            for place in repo.places
            if place.name in COMPONENTS and not view.exists(folders[place.name])
        ]
        if missing:
            raise missing_components_error(repo.where, missing)
    present = {name: folder for name, folder in folders.items() if name in COMPONENTS or view.exists(folder)}
    return check_components(present, view), present
