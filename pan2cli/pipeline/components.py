"""Locate a PAN 2 checkpoint's components in a folder or a Hugging Face repo (downloading only what is needed).

Layout (diffusers-style, as `IFM/PAN2` ships it):

    transformer/   config.json + diffusion_pytorch_model*.safetensors (our MMDiT keys: pan2cli.dit.checkpoint)
    text_encoder/  a transformers model (config.json + weights), read with AutoModel
    tokenizer/     its tokenizer, read with AutoTokenizer
    vae/           diffusers AutoencoderKLWan: config.json + diffusion_pytorch_model.safetensors (encoder + decoder)
    scheduler/     optional: scheduler_config.json (`num_train_timesteps`; the shift comes from the preset)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pan2cli.errors import CheckpointError, InputError
from pan2cli.hub import hub_errors

DEFAULT_MODEL_REPO = "IFM/PAN2"
COMPONENTS = ("transformer", "text_encoder", "tokenizer", "vae")
OPTIONAL_COMPONENTS = ("scheduler",)
# Only these files are fetched from the hub (not original-format duplicates, images or docs).
ALLOW_PATTERNS = (
    "model_index.json",
    *(f"{name}/*.json" for name in (*COMPONENTS, *OPTIONAL_COMPONENTS)),
    *(f"{name}/*.safetensors" for name in ("transformer", "text_encoder", "vae")),
    "tokenizer/*",
)
_HINT = "pass --model with a PAN 2 folder (transformer/, text_encoder/, tokenizer/, vae/) or a Hugging Face repo id"


@dataclass(frozen=True)
class PAN2Components:
    """Where each component lives, and where the checkpoint came from (for sidecars)."""

    root: Path
    model_id: str
    revision: str | None
    num_train_timesteps: int = 1000

    def folder(self, name: str) -> Path:
        return self.root / name


def _check_folder(root: Path, source: str) -> None:
    missing = [name for name in COMPONENTS if not (root / name).is_dir()]
    if missing:
        raise CheckpointError(
            f"{source} has no {', '.join(f'{m}/' for m in missing)} (a PAN 2 checkpoint needs {', '.join(f'{c}/' for c in COMPONENTS)})",
            hint=_HINT,
        )


def _num_train_timesteps(root: Path) -> int:
    path = root / "scheduler" / "scheduler_config.json"
    if not path.is_file():
        return 1000
    try:
        value = json.loads(path.read_text()).get("num_train_timesteps", 1000)
    except (OSError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path} is not a readable JSON object: {exc}") from exc
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise CheckpointError(f"{path}: num_train_timesteps must be a positive whole number, got {value!r}")
    return value


def _download(repo_id: str, revision: str | None) -> Path:
    from huggingface_hub import snapshot_download

    local_hint = "pass --model PATH to a local PAN 2 folder (or connect to the hub / unset HF_HUB_OFFLINE)"
    with hub_errors(repo_id, revision, what="the PAN 2 checkpoint", local_hint=local_hint):
        return Path(snapshot_download(repo_id, revision=revision, allow_patterns=list(ALLOW_PATTERNS)))


def _looks_like_path(spec: str) -> bool:
    return spec.startswith(("/", "./", "../", "~", ".")) or spec.count("/") != 1


def resolve_components(spec: str | Path | None = None, revision: str | None = None) -> PAN2Components:
    """Find (or fetch) a PAN 2 checkpoint and check that every component is there.

    Args:
        spec: a local folder, or a Hugging Face repo id (default `IFM/PAN2`), fetched with
            `snapshot_download` (only the files in `ALLOW_PATTERNS`; cache, token and offline mode as usual).
        revision: branch, tag or commit of the repo (ignored for folders).

    Raises:
        CheckpointError: a component folder is missing (exit 2).
        InputError: no such folder, repository or revision (exit 2).
        DownloadError: the download failed, or offline with nothing cached (exit 1).
    """
    spec = str(spec) if spec is not None else DEFAULT_MODEL_REPO
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise InputError(f"--model {spec} is a file; a PAN 2 checkpoint is a folder", hint=_HINT)
        _check_folder(path, str(path))
        return PAN2Components(path, str(path), None, _num_train_timesteps(path))
    if _looks_like_path(spec):
        raise InputError(f"no such folder: {spec}", hint=_HINT)
    root = _download(spec, revision)
    _check_folder(root, f"{spec}@{revision}" if revision else spec)
    return PAN2Components(root, spec, revision, _num_train_timesteps(root))
