"""Load (and write) the PAN 2 transformer: `config.json` + safetensors, strictly checked.

Accepted: the transformer's folder (or a repository root holding it in `transformer/`, or a hub repo id)
with `config.json` and `diffusion_pytorch_model.safetensors`, or shards listed by
`diffusion_pytorch_model.safetensors.index.json` (also under the stem `model`). The files are read by
several threads through pinned buffers straight into the device's tensors (`pan2cli.checkpoints.staged`), then
cast there, so host memory stays at a few buffers of 32 MB.
Every parameter of the model must be present with its shape; any other key is an error that names it.

Keys (diffusers names, as released; D = heads·head_dim = 4096, i a block 0…43, r a refiner block 0…3;
F = 8D video MLP, F' = 4D text MLP, R = 4D refiner SwiGLU, h = 128, C_in = 97, C = 48):

| key | shape |
| --- | --- |
| `x_embedder.weight` / `.bias` | `[D, C_in, 1, 2, 2]` / `[D]` |
| `time_embedder.linear_1.weight` / `.bias`, `time_embedder.linear_2.*` | `[D, 256]` / `[D]`, `[D, D]` / `[D]` |
| `context_embedder.0.weight` (RMSNorm), `context_embedder.1.weight` / `.bias` | `[4096]`, `[D, 4096]` / `[D]` |
| `context_refiner.{r}.norm1.weight`, `.norm2.weight` | `[D]` |
| `context_refiner.{r}.attn.to_q` / `to_k` / `to_v` / `to_out.0` `.weight` (no bias) | `[D, D]` |
| `context_refiner.{r}.attn.norm_q.weight`, `.norm_k.weight` | `[h]` |
| `context_refiner.{r}.ff.net.0.proj.weight` (value ‖ gate), `ff.net.2.weight` | `[2R, D]`, `[D, R]` |
| `context_type_embedding` | `[D]` |
| `transformer_blocks.{i}.norm1.linear.weight` / `.bias` (float32 as released) | `[6D, D]` / `[6D]` |
| `transformer_blocks.{i}.scale_shift_table_context` | `[6D]` |
| `transformer_blocks.{i}.attn.{to_q,to_k,to_v,to_out.0,add_q_proj,add_k_proj,add_v_proj,to_add_out}.weight` / `.bias` | `[D, D]` / `[D]` |
| `transformer_blocks.{i}.attn.{norm_q,norm_k,norm_added_q,norm_added_k}.weight` | `[h]` |
| `transformer_blocks.{i}.ff.net.0.proj.*`, `ff.net.2.*` | `[F, D]` / `[F]`, `[D, F]` / `[D]` |
| `transformer_blocks.{i}.ff_context.net.0.proj.*`, `ff_context.net.2.*` | `[F', D]` / `[F']`, `[D, F']` / `[D]` |
| `norm_out.linear.weight` / `.bias` (float32 as released) | `[2D, D]` / `[2D]` |
| `proj_out.weight` / `.bias` | `[4C, D]` / `[4C]`, features (c, pt, ph, pw) |

1,418 tensors and 29,201,996,992 parameters at the default config (tests/dit/test_dit_model.py checks both).
"""

from __future__ import annotations

import inspect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from pan2cli.checkpoints.json_files import read_json_object
from pan2cli.checkpoints.keys import check_keys
from pan2cli.checkpoints.sharded import tensor_locations
from pan2cli.checkpoints.staged import StagedReader
from pan2cli.dit.config import PAN2TransformerConfig, config_arguments
from pan2cli.dit.model import PAN2Transformer3DModel
from pan2cli.errors import CheckpointError, InputError

CONFIG_NAME = "config.json"
WEIGHT_STEMS = ("diffusion_pytorch_model", "model")
SUBFOLDER = "transformer"
_HINT = "pass the transformer/ folder of a PAN 2 checkpoint (config.json and diffusion_pytorch_model*.safetensors)"


@dataclass(frozen=True)
class PAN2Checkpoint:
    """A located checkpoint: its folder, constructor arguments, each tensor's shape and the file holding it."""

    folder: Path
    arguments: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    files: dict[str, Path]


def model_on_meta(arguments: dict[str, Any]) -> PAN2Transformer3DModel:
    """The model for these constructor arguments without memory (shapes only)."""
    with torch.device("meta"):
        return PAN2Transformer3DModel(**arguments)


def expected_shapes(arguments: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Checkpoint key → shape for these constructor arguments."""
    return {key: tuple(value.shape) for key, value in model_on_meta(arguments).state_dict().items()}


def check_tensor_shapes(shapes: dict[str, tuple[int, ...]], arguments: dict[str, Any], source: str) -> None:
    """Raise a `CheckpointError` naming every missing, unexpected or mis-shaped key of `shapes`."""
    check_keys(
        shapes,
        expected_shapes(arguments),
        f"{source} does not hold the PAN 2 transformer its config.json describes",
        hint="check that config.json and the weights come from the same PAN 2 checkpoint",
    )


def release_defaults() -> dict[str, Any]:
    """The constructor's defaults: the released model's config."""
    return {name: p.default for name, p in inspect.signature(PAN2Transformer3DModel).parameters.items()}


def read_config(path: Path) -> dict[str, Any]:
    """The constructor arguments in a transformer `config.json`, their names and values checked.

    Raises:
        CheckpointError: another model class, unknown keys, or values the model cannot take (all named).
    """
    arguments = config_arguments(read_json_object(path), source=str(path))
    try:
        PAN2TransformerConfig(**{**release_defaults(), **arguments})
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {exc}", hint=exc.hint) from exc
    return arguments


def _model_folder(path: Path, subfolder: str | None) -> Path:
    candidates = [path / subfolder] if subfolder else [path, path / SUBFOLDER]
    for candidate in candidates:
        if (candidate / CONFIG_NAME).is_file():
            return candidate
    looked = " and ".join(str(c) for c in candidates)
    raise CheckpointError(f"no {CONFIG_NAME} in {looked}", hint=_HINT)


def _local_root(path_or_repo: str | Path, subfolder: str | None, revision: str | None) -> Path:
    """A local folder for `path_or_repo`: itself, or the hub snapshot of the transformer's files."""
    from pan2cli.paths import looks_like_path

    spec = str(path_or_repo)
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{path} is a file; the transformer loads from a folder", hint=_HINT)
        return path
    if looks_like_path(spec):
        raise InputError(f"no such folder: {spec}", hint=_HINT)
    from pan2cli.checkpoints.hub import hub_errors, hub_snapshot

    folder = subfolder or SUBFOLDER
    with hub_errors(spec, revision, what="the PAN 2 transformer", local_hint="pass a local folder instead"):
        return hub_snapshot(spec, revision, [f"{folder}/*.json", f"{folder}/*.safetensors"])


def resolve_pan2_checkpoint(
    path_or_repo: str | Path, subfolder: str | None = None, revision: str | None = None
) -> PAN2Checkpoint:
    """Locate config and weights (a folder, a repo root with `transformer/`, or a hub repo id).

    Raises:
        InputError: no such path. CheckpointError: no config or weights, unknown config keys, an inconsistent index.
    """
    folder = _model_folder(_local_root(path_or_repo, subfolder, revision), subfolder)
    arguments = read_config(folder / CONFIG_NAME)
    shapes, files = tensor_locations(folder, WEIGHT_STEMS)
    return PAN2Checkpoint(folder, arguments, shapes, files)


def keeps_fp32(key: str) -> bool:
    """Whether a parameter belongs to a module kept in float32 (`PAN2Transformer3DModel.keep_in_fp32_modules`)."""
    return any(f"{name}." in f".{key}" for name in PAN2Transformer3DModel.keep_in_fp32_modules)


def loaded_bytes(
    shapes: dict[str, tuple[int, ...]],
    dtype: torch.dtype | None = torch.bfloat16,
    *,
    keep_fp32_modules: bool = True,
    precision: str = "bf16",
) -> int:
    """Bytes of device memory the loaded model's tensors take (what `load_pan2_transformer` with these
    arguments makes of a checkpoint with these shapes; `dtype` None counts 2 bytes an element)."""
    from pan2cli.dit.quantize import is_fp8_weight

    size = torch.empty(0, dtype=dtype).element_size() if dtype is not None else 2
    total = 0
    for key, shape in shapes.items():
        elements = math.prod(shape)
        if precision == "fp8" and is_fp8_weight(key):
            total += elements + 4 * shape[0]  # e4m3, and a float32 scale per output channel
            if key.endswith(".attn.to_q.weight"):
                total += 4  # the block's fp8 attention scale (`Fp8AttentionScales.qk_descale`, float32)
        elif keep_fp32_modules and keeps_fp32(key) and dtype != torch.float64:
            total += 4 * elements
        else:
            total += size * elements
    return total


def load_pan2_transformer(
    path_or_repo: str | Path,
    *,
    subfolder: str | None = None,
    dtype: torch.dtype | None = torch.bfloat16,
    revision: str | None = None,
    device: str | torch.device = "cpu",
    keep_fp32_modules: bool = True,
    precision: str = "bf16",
    quantize_device: str | torch.device | None = None,
    on_tensor: Callable[[], None] | None = None,
    on_block: Callable[[int, torch.nn.Module], None] | None = None,
) -> PAN2Transformer3DModel:
    """Build the transformer from a checkpoint (its `config.json` and safetensors), strictly.

    Args:
        path_or_repo, subfolder, revision: where the checkpoint is (see `resolve_pan2_checkpoint`).
        dtype: parameter dtype (None: as stored); the AdaLN linears stay float32 when `keep_fp32_modules`
            (unless `dtype` is float64, which takes everything).
        device: where the model lives; the files are read there (`StagedReader`), then cast.
        precision: "bf16" (as stored, cast to `dtype`), or "fp8": each block is quantised
            (`pan2cli.dit.quantize.quantize_block`) as soon as its tensors are read, on `quantize_device`
            (default `device`; the GPU where `device` is the CPU, for `--offload`), then moved to `device`, so
            the whole bf16 model is never on the device.
        on_tensor: called after each tensor is on its device (progress; an exception raised there stops
            the load: `pan2cli.pipeline.background`).
        on_block: called with each block's index and module once it is on `device` (and quantised), before the
            next one is: a block streamer's `stage`, which moves the blocks that stream to host memory as
            they come, so that the whole model is never on the device. With it the blocks load one at a time
            in bf16 too.

    Returns:
        The model in eval mode without gradients.

    Raises:
        CheckpointError: missing, unexpected or mis-shaped keys (named), unreadable files.
    """
    ckpt = resolve_pan2_checkpoint(path_or_repo, subfolder, revision)
    model = model_on_meta(ckpt.arguments)
    check_tensor_shapes(ckpt.shapes, ckpt.arguments, str(ckpt.folder))
    where = torch.device(quantize_device or device) if precision == "fp8" else torch.device(device)
    with StagedReader(ckpt.files, where) as reader:
        for key, span in reader.spans.items():  # every dtype checked before a byte is read
            if not span.dtype.is_floating_point:
                raise CheckpointError(f"{span.path}: tensor {key} has dtype {span.dtype}, expected a float")

        def cast(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            for key, tensor in tensors.items():
                target = dtype or tensor.dtype
                if keep_fp32_modules and keeps_fp32(key) and target != torch.float64:
                    target = torch.float32
                tensors[key] = tensor.to(dtype=target)  # on the device it was read to
            return tensors

        keys = list(model.state_dict())
        if precision == "bf16" and on_block is None:
            model.load_state_dict(cast(reader.read(keys, on_tensor)), strict=True, assign=True)
            return model.eval().requires_grad_(False)
        from pan2cli.dit.quantize import quantize_block

        # Block by block, the next block's reads running while this one is quantised (or handed on).
        prefixes = [f"transformer_blocks.{index}." for index in range(len(model.transformer_blocks))]
        groups = [[key for key in keys if key.startswith(prefix)] for prefix in prefixes]
        groups.append([key for key in keys if not key.startswith("transformer_blocks.")])
        for index, tensors in enumerate(reader.read_each(groups, on_tensor)):
            if index == len(prefixes):  # the parts outside the blocks, last
                rest = {key: tensor.to(device) for key, tensor in cast(tensors).items()}
                continue
            block, prefix = model.transformer_blocks[index], prefixes[index]
            block.load_state_dict(
                {key[len(prefix) :]: tensor for key, tensor in cast(tensors).items()},
                strict=True,
                assign=True,
            )
            if precision == "fp8":
                quantize_block(block)
            block.to(device)
            if on_block is not None:
                on_block(index, block)
    model.load_state_dict(rest, strict=False, assign=True)  # the keys were checked whole, above
    model.precision = precision
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
        model: the model to save (its parameters as they are: dtype and names).
        folder: created if missing.
        max_shard_bytes: start a new shard when the current one would pass this size.
        stem: file name stem, `diffusion_pytorch_model` or `model`.

    Returns:
        The folder.
    """
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / CONFIG_NAME).write_text(json.dumps(model.config.to_dict(), indent=2) + "\n")
    state = model.state_dict()

    def on_host(keys) -> dict[str, torch.Tensor]:
        # One shard at a time on the host: a 67 GB model on a GPU never needs 67 GB of host memory here.
        return {key: state[key].detach().cpu().contiguous() for key in keys}

    if max_shard_bytes is None:
        save_file(on_host(state), str(folder / f"{stem}.safetensors"))
        return folder
    shards: list[list[str]] = [[]]
    size = 0
    for key, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
    weight_map = {}
    for i, keys in enumerate(shards, start=1):
        name = f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(on_host(keys), str(folder / name))
        weight_map.update({key: name for key in keys})
    total = sum(t.numel() * t.element_size() for t in state.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / f"{stem}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return folder
