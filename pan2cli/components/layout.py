"""The layout of a PAN 2 checkpoint: its components, where its pipeline index puts them, what a checked one is.

Layout (IFM/PAN2, a Modular Diffusers repository):

    modular_model_index.json  `_class_name` PAN2ModularPipeline; per component `[library, class_name, spec]`,
                              the spec's `subfolder` (and `pretrained_model_name_or_path`, `revision`)
    transformer/   config.json + diffusion_pytorch_model[-0000i-of-0000n].safetensors (+ .index.json)
    text_encoder/  Qwen3.5 (transformers): config.json + model[-0000i-of-0000n].safetensors (+ .index.json)
    tokenizer/     tokenizer.json, tokenizer_config.json, chat template (chat_template.jinja)
    vae/           AutoencoderKLWan: config.json + diffusion_pytorch_model.safetensors
    scheduler/     optional: scheduler_config.json (FlowMatchEulerDiscreteScheduler: `num_train_timesteps`, `shift`,
                   `shift_terminal`; the options pan2 does not run are refused by name: `pan2cli.scheduler`)

Without `modular_model_index.json`, a `model_index.json` (`PAN2Pipeline`) is read; with neither, the
components are in the folders named above. A local folder (`components`) and a hub repo (`hub_check`) are
read the same way, through this module.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from pan2cli.checkpoints.json_files import read_json_object
from pan2cli.errors import CheckpointError
from pan2cli.scheduler import SchedulerConfig

COMPONENTS = ("transformer", "text_encoder", "tokenizer", "vae")
OPTIONAL_COMPONENTS = ("scheduler",)
INDEX_FILES = ("modular_model_index.json", "model_index.json")  # the first one present is read
PIPELINE_CLASSES = ("PAN2ModularPipeline", "PAN2Pipeline")
HINT = "pass --model with a PAN 2 folder (transformer/, text_encoder/, tokenizer/, vae/) or a Hugging Face repo id"
_COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class ComponentPlace:
    """Where a pipeline index puts a component: a subfolder ("" for the root) of this checkpoint or of another repo."""

    name: str
    subfolder: str
    repo_id: str | None = None  # `pretrained_model_name_or_path` of the spec; None: this checkpoint
    revision: str | None = None

    def folder(self, root: Path) -> Path:
        return root / self.subfolder if self.subfolder else root

    @property
    def shown(self) -> str:
        return f"{self.subfolder}/" if self.subfolder else "the root"


@dataclass(frozen=True)
class PAN2Components:
    """A checked PAN 2 checkpoint: where each component's files are, and where they came from (for sidecars).

    Attributes:
        root: the checkpoint's folder (a hub repo: its snapshot folder in the huggingface_hub cache).
        model_id: the repo id, or the folder's absolute path.
        revision: the commit of the hub snapshot (a folder inside the hub cache: its commit; else None).
        scheduler: what `scheduler/scheduler_config.json` sets (defaults when absent): the timestep scale, the
            shift a preset or flag may override, the terminal stretch.
        folders: component name → folder (a component from another repo: in that repo's snapshot).
        sources: component name → where it came from (`repo@commit:subfolder`, or a path), for messages.
        transformer_arguments: the checked constructor arguments of `transformer/config.json`.
    """

    root: Path
    model_id: str
    revision: str | None
    scheduler: SchedulerConfig = SchedulerConfig()
    folders: Mapping[str, Path] = field(default_factory=dict)
    sources: Mapping[str, str] = field(default_factory=dict)
    transformer_arguments: Mapping[str, Any] = field(default_factory=dict)

    def folder(self, name: str) -> Path:
        return self.folders.get(name, self.root / name)

    @property
    def num_train_timesteps(self) -> int:
        return self.scheduler.num_train_timesteps

    @property
    def scheduler_shift(self) -> float | None:
        """The scheduler config's `shift` (None when it sets none)."""
        return self.scheduler.shift


def _place(index: Mapping[str, Any], name: str, source: str) -> ComponentPlace:
    entry = index.get(name)
    if not (isinstance(entry, list) and len(entry) == 3 and isinstance(entry[2], Mapping)):
        return ComponentPlace(name, name)  # absent, or a model_index.json pair [library, class_name]
    spec = entry[2]
    subfolder = spec.get("subfolder", name)
    subfolder = "" if subfolder is None else subfolder
    if not isinstance(subfolder, str) or Path(subfolder).is_absolute() or ".." in Path(subfolder).parts:
        raise CheckpointError(
            f"{source}: {name}'s subfolder {subfolder!r} is not a folder inside the checkpoint"
        )
    repo_id, revision = spec.get("pretrained_model_name_or_path"), spec.get("revision")
    for key, value in (("pretrained_model_name_or_path", repo_id), ("revision", revision)):
        if value is not None and not isinstance(value, str):
            raise CheckpointError(f"{source}: {name}'s {key} must be a string or null, got {value!r}")
    if spec.get("variant"):
        raise CheckpointError(
            f"{source}: {name} names the weight variant {spec['variant']!r}; pan2 reads the default weight files only"
        )
    return ComponentPlace(name, subfolder.strip("/"), repo_id or None, revision or None)


def read_pipeline_index(root: Path, label: Callable[[Path], str] = str) -> dict[str, ComponentPlace]:
    """Where each component is, from `modular_model_index.json` (or `model_index.json`); defaults without either.

    Raises:
        CheckpointError: the index names another pipeline class, or a component spec is malformed.
    """
    for name in INDEX_FILES:
        path = root / name
        if path.is_file():
            index = read_json_object(path)
            class_name = index.get("_class_name")
            if class_name is not None and class_name not in PIPELINE_CLASSES:
                raise CheckpointError(
                    f"{label(path)} describes a {class_name}, not a PAN 2 pipeline ({' or '.join(PIPELINE_CLASSES)})",
                    hint=HINT,
                )
            return {c: _place(index, c, label(path)) for c in (*COMPONENTS, *OPTIONAL_COMPONENTS)}
    return {c: ComponentPlace(c, c) for c in (*COMPONENTS, *OPTIONAL_COMPONENTS)}


def missing_components_error(source: str, missing: list[ComponentPlace], hint: str = HINT) -> CheckpointError:
    """The error for required component folders that are not there (all of them named)."""
    folders = ", ".join(place.shown for place in missing)
    needs = ", ".join(f"{c}/" for c in COMPONENTS)
    return CheckpointError(f"{source} has no {folders} (a PAN 2 checkpoint needs {needs})", hint=hint)


def cached_commit(folder: Path) -> str | None:
    """The commit of a huggingface_hub cache snapshot folder (`…/snapshots/<commit>`), else None."""
    return folder.name if folder.parent.name == "snapshots" and _COMMIT.fullmatch(folder.name) else None
