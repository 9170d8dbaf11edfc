"""Locate a PAN 2 checkpoint (a folder or a Hugging Face repo) and check its components before anything big is read.

The layout a checkpoint follows is in `checkpoint_layout`. Checks (`component_checks`) run on the small
files and the safetensors headers before any weight is read; from the hub, before the weights are
downloaded (`hub_check`).
"""

from __future__ import annotations

from pathlib import Path

from pan2cli.components.layout import (
    COMPONENTS,
    HINT,
    PAN2Components,
    cached_commit,
    missing_components_error,
    read_pipeline_index,
)
from pan2cli.errors import InputError
from pan2cli.paths import looks_like_path

DEFAULT_MODEL_REPO = "IFM/PAN2"


def local_components(root: Path) -> PAN2Components:
    """Check a local checkpoint folder (every component must be in it) and describe it.

    A component whose index spec names another repo must still be in the folder: a local folder is read
    without network (pass the repo id as --model to fetch such components).

    Raises:
        CheckpointError: see `read_pipeline_index`, a missing component folder (named), `check_components`.
    """
    from pan2cli.checkpoints.sharded import LOCAL_FILES
    from pan2cli.components.checks import check_components

    places = read_pipeline_index(root)
    folders = {name: place.folder(root) for name, place in places.items()}
    missing = [places[name] for name in COMPONENTS if not folders[name].is_dir()]
    if missing:
        repos = sorted({p.repo_id for p in missing if p.repo_id and not looks_like_path(p.repo_id)})
        hint = (
            f"its index takes them from {' and '.join(repos)}: pass --model {repos[0]} to fetch from the hub"
            if repos
            else HINT
        )
        raise missing_components_error(str(root), missing, hint)
    if not folders["scheduler"].is_dir():
        del folders["scheduler"]
    checked = check_components(folders, LOCAL_FILES)
    return PAN2Components(
        root, str(root), cached_commit(root), checked.scheduler, folders,
        {name: str(folder) for name, folder in folders.items()}, checked.transformer_arguments,
    )  # fmt: skip


def resolve_components(spec: str | Path | None = None, revision: str | None = None) -> PAN2Components:
    """Find (or fetch) a PAN 2 checkpoint and check every component before anything big is read.

    Args:
        spec: a local folder, or a Hugging Face repo id (default `IFM/PAN2`): its small files are fetched
            and checked first, then the weights (`pan2cli.components.hub_check`; cache, token and
            `HF_HUB_OFFLINE` as usual).
        revision: branch, tag or commit of the repo (ignored for folders).

    Returns:
        The checked components; `model_id` is the repo id or the folder's absolute path, `revision` the
        commit used.

    Raises:
        CheckpointError: another pipeline or model, unknown config keys, a missing component (named),
            tensors missing, unexpected or mis-shaped (named) (exit 2).
        InputError: no such folder, repository or revision (exit 2).
        DownloadError: the download failed, or offline with nothing cached (exit 1).
    """
    spec = str(spec) if spec is not None else DEFAULT_MODEL_REPO
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise InputError(f"--model {spec} is a file; a PAN 2 checkpoint is a folder", hint=HINT)
        return local_components(path.resolve())
    if looks_like_path(spec):
        raise InputError(f"no such folder: {spec}", hint=HINT)
    from pan2cli.components.hub_check import hub_components

    return hub_components(spec, revision)
