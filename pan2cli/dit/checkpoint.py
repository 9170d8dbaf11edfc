"""Load (and write) PAN 2 MMDiT checkpoints: a diffusers-style folder, memory-mapped, strictly checked.

Accepted: a folder (or a repository root holding it in `transformer/`) with `config.json` and either
`diffusion_pytorch_model.safetensors`, shards listed by `diffusion_pytorch_model.safetensors.index.json`,
or the same under the name `model` (`model.safetensors`, `model.safetensors.index.json`). Tensors are
read one at a time from the memory-mapped files, cast and moved to the device, so host memory stays at one
tensor. Every key of the model must be present with its shape; any other key is an error that names it.

Key layout (D hidden, F = round(D·mlp_ratio) MLP width, h head_dim, C 48 latent channels, (pt, ph, pw)
the patch; `{i}` a block index; video stream first, text ("context") stream second):

| key | shape | role |
| --- | --- | --- |
| `patch_embedding.weight` / `.bias` | `[D, C, pt, ph, pw]` / `[D]` | Conv3d patchify, kernel = stride |
| `condition_embedder.time_embedder.linear_1.*` | `[D, freq_dim]`, `[D]` | timestep MLP (SiLU) |
| `condition_embedder.time_embedder.linear_2.*` | `[D, D]`, `[D]` | |
| `condition_embedder.time_proj.*` | `[6D, D]`, `[6D]` | SiLU(temb) → modulation, shared by blocks |
| `condition_embedder.text_embedder.linear_1.*` | `[D, text_dim]`, `[D]` | text MLP (GELU tanh) |
| `condition_embedder.text_embedder.linear_2.*` | `[D, D]`, `[D]` | |
| `blocks.{i}.scale_shift_table` | `[1, 6, D]` | video AdaLN: shift, scale, gate (attn), shift, scale, gate (MLP) |
| `blocks.{i}.scale_shift_table_context` | `[1, 6, D]` | text AdaLN, same order |
| `blocks.{i}.attn.to_q` / `to_k` / `to_v` / `to_out` `.weight`/`.bias` | `[D, D]`, `[D]` | video projections |
| `blocks.{i}.attn.add_q_proj` / `add_k_proj` / `add_v_proj` / `to_add_out` | `[D, D]`, `[D]` | text projections |
| `blocks.{i}.attn.norm_q` / `norm_k` / `norm_added_q` / `norm_added_k` `.weight` | `[h]` | Q/K RMSNorm per head |
| `blocks.{i}.ffn.fc1.*` / `ffn.fc2.*` | `[F, D]`, `[F]` / `[D, F]`, `[D]` | video MLP (GELU tanh) |
| `blocks.{i}.ffn_context.fc1.*` / `ffn_context.fc2.*` | as above | text MLP |
| `scale_shift_table` | `[1, 2, D]` | final AdaLN: shift, scale (added to temb) |
| `proj_out.weight` / `.bias` | `[pt·ph·pw·C, D]` / `[pt·ph·pw·C]` | features in (pt, ph, pw, c) order |

q/k channels use the "halves" RoPE layout (`pan2cli.dit.rope`). Other layouts map onto these names through
`KEY_RENAMES`, the one table of renames (first matching prefix wins).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from pan2cli.dit.config import PAN2TransformerConfig
from pan2cli.dit.model import PAN2Transformer3DModel
from pan2cli.errors import CheckpointError, InputError
from pan2cli.jsonfile import read_json_object
from pan2cli.statedict import key_problems, listing

CONFIG_NAME = "config.json"
WEIGHT_STEMS = ("diffusion_pytorch_model", "model")
_HINT = "pass a folder with config.json and diffusion_pytorch_model*.safetensors (or model*.safetensors)"

# Other layouts → ours: (prefix in the file, prefix here). ComfyUI single files nest the DiT in
# `model.diffusion_model.`.
KEY_RENAMES: tuple[tuple[str, str], ...] = (("model.diffusion_model.", ""),)


def rename_key(key: str) -> str:
    """Map a checkpoint key to the model's name through `KEY_RENAMES` (unchanged if no prefix matches)."""
    for prefix, replacement in KEY_RENAMES:
        if key.startswith(prefix):
            return replacement + key[len(prefix) :]
    return key


@dataclass(frozen=True)
class PAN2Checkpoint:
    """A located checkpoint: its config and the file holding each tensor (checkpoint key → file)."""

    folder: Path
    config: PAN2TransformerConfig
    files: dict[str, Path]


def _model_folder(path: Path) -> Path:
    for candidate in (path, path / "transformer"):
        if (candidate / CONFIG_NAME).is_file():
            return candidate
    raise CheckpointError(f"{path} holds no {CONFIG_NAME} (looked in it and in transformer/)", hint=_HINT)


def _safetensors_keys(path: Path) -> list[str]:
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            return list(handle.keys())
    except Exception as exc:  # safetensors raises its own SafetensorError and OSErrors
        raise CheckpointError(f"{path} could not be read as safetensors (truncated?): {exc}", hint=_HINT) from exc


def _weight_files(folder: Path) -> dict[str, Path]:
    """Checkpoint key → the file holding it, from an index (sharded) or a single file."""
    for stem in WEIGHT_STEMS:
        index = folder / f"{stem}.safetensors.index.json"
        if index.is_file():
            weight_map = read_json_object(index).get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index} has no weight_map")
            files: dict[str, Path] = {}
            for shard in sorted(set(weight_map.values())):
                shard_path = folder / shard
                if not shard_path.is_file():
                    raise CheckpointError(f"{index} lists {shard}, which is not in {folder}")
                for key in _safetensors_keys(shard_path):
                    if key in files:
                        raise CheckpointError(f"{key} is in both {files[key].name} and {shard}")
                    files[key] = shard_path
            wrong = sorted(k for k, shard in weight_map.items() if k not in files or files[k].name != shard)
            if wrong:
                raise CheckpointError(f"{index} maps keys to shards that do not hold them: {listing(wrong)}")
            return files
        single = folder / f"{stem}.safetensors"
        if single.is_file():
            return {key: single for key in _safetensors_keys(single)}
    raise CheckpointError(f"{folder} has no {WEIGHT_STEMS[0]}*.safetensors or model*.safetensors weights", hint=_HINT)


def resolve_pan2_checkpoint(path: str | Path) -> PAN2Checkpoint:
    """Locate config and weights in a folder (or its `transformer/` subfolder).

    Raises:
        InputError: no such path. CheckpointError: no config or weights, an inconsistent index.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise InputError(f"no such file or folder: {path}", hint=_HINT)
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file; the DiT loads from a folder", hint=_HINT)
    folder = _model_folder(path)
    config = PAN2TransformerConfig.from_config_dict(read_json_object(folder / CONFIG_NAME), source=str(folder / CONFIG_NAME))
    return PAN2Checkpoint(folder, config, _weight_files(folder))


def _open_all(files: dict[str, Path]) -> tuple[dict[str, tuple[int, ...]], Callable[[str], torch.Tensor], list]:
    """Shapes of every tensor and a reader that memory-maps each file once."""
    from safetensors import safe_open

    handles = {path: safe_open(str(path), framework="pt", device="cpu") for path in sorted(set(files.values()))}
    shapes = {key: tuple(handles[path].get_slice(key).get_shape()) for key, path in files.items()}

    def read(key: str) -> torch.Tensor:
        try:
            return handles[files[key]].get_tensor(key)
        except Exception as exc:
            raise CheckpointError(f"{files[key]}: tensor {key} could not be read (truncated file?): {exc}") from exc

    return shapes, read, list(handles.values())


def load_pan2_transformer(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cpu",
) -> PAN2Transformer3DModel:
    """Build the MMDiT from a checkpoint folder, strictly.

    Args:
        path: the folder (or a repository root with `transformer/`).
        dtype: parameter dtype (bf16 by default; fp32 for reference runs).
        device: where the model lives; tensors stream there one at a time.

    Returns:
        The model in eval mode without gradients; fused kernels on for CUDA (its default).

    Raises:
        CheckpointError: missing, unexpected or mis-shaped keys (named), unreadable files.
    """
    ckpt = resolve_pan2_checkpoint(path)
    renamed = {rename_key(k): k for k in ckpt.files}
    if len(renamed) != len(ckpt.files):
        raise CheckpointError(f"{ckpt.folder} holds the same tensor under two key names")
    with torch.device("meta"):
        model = PAN2Transformer3DModel(ckpt.config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    shapes, read, _handles = _open_all(ckpt.files)
    shapes = {ours: shapes[theirs] for ours, theirs in renamed.items()}
    problems = key_problems(shapes, expected)
    if problems:
        raise CheckpointError(
            f"{ckpt.folder} does not match its config.json ({'; '.join(problems)})",
            hint="check that config.json belongs to these weights",
        )
    state = {}
    for key in expected:
        tensor = read(renamed[key])
        if not tensor.is_floating_point():
            raise CheckpointError(f"{ckpt.files[renamed[key]]}: tensor {renamed[key]} has dtype {tensor.dtype}, expected a float")
        state[key] = tensor.to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def save_pan2_transformer(
    model: PAN2Transformer3DModel,
    folder: str | Path,
    *,
    max_shard_bytes: int | None = None,
    stem: str = WEIGHT_STEMS[0],
) -> Path:
    """Write `config.json` and the weights (sharded with an index when `max_shard_bytes` is given).

    Args:
        model: the model to save (its parameters, as they are: dtype and names).
        folder: created if missing.
        max_shard_bytes: start a new shard when the current one would pass this size.
        stem: file name stem, `diffusion_pytorch_model` or `model`.

    Returns:
        The folder.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_NAME).write_text(json.dumps(model.config.to_config_dict(), indent=2) + "\n")
    state = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
    if max_shard_bytes is None:
        save_file(state, str(folder / f"{stem}.safetensors"))
        return folder
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][key] = tensor
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name))
        weight_map.update({key: name for key in shard})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return folder
