"""Find, read, check and load Wan2.2 VAE checkpoints into the reference decoder.

Accepted (docs/wan22_vae.md §7):
* the original `Wan2.2_VAE.pth` (torch pickle of a flat state dict, original key names), read with
  `weights_only=True`;
* a single safetensors file with original key names (ComfyUI's `wan2.2_vae.safetensors`) or with
  diffusers key names;
* a diffusers folder (`config.json` + `diffusion_pytorch_model.safetensors`), given as the folder or as a
  repository root holding it in `vae/`;
* a Hugging Face repo id (default `Wan-AI/Wan2.2-TI2V-5B-Diffusers`, its `vae/` folder), fetched through
  huggingface_hub's cache (tokens, `HF_HOME`, `HF_HUB_OFFLINE` as usual).

Single files are the TI2V-5B architecture (their widths are read from the tensors, so reduced-width test
files load too); a diffusers folder's `config.json` is read (widths may differ).
Every decoder and post-quant key must be present with the right shape; encoder and quant-conv keys are
accepted (real files hold the whole VAE); any other key is an error that names it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import torch

from pan2cli.checkpoints.files import ReadErrors, TensorFile, float_tensor, read_tensor_file
from pan2cli.checkpoints.hub import hub_errors, hub_file
from pan2cli.checkpoints.json_files import read_json_object
from pan2cli.checkpoints.keys import check_keys, listing
from pan2cli.errors import CheckpointError, InputError
from pan2cli.paths import looks_like_path
from pan2cli.vae.config import DEFAULT_VAE_REPO, WanVAEConfig
from pan2cli.vae.model import WanVAEDecoder

DIFFUSERS_CONFIG = "config.json"
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
_VAE_HINT = "pass --vae with Wan2.2_VAE.pth, wan2.2_vae.safetensors, a diffusers vae/ folder or a Hugging Face repo id"
_READ_ERRORS = ReadErrors(hint=_VAE_HINT)  # unreadable files are CheckpointErrors with this hint

# Keys the decoder does not use but a whole-VAE file carries (the encoder will use them for image-to-video).
_ACCEPTED_EXTRA_PREFIXES = ("encoder.", "quant_conv.")
_DECODER_PREFIXES = ("decoder.", "post_quant_conv.")


# -- original → diffusers key names (the one mapping table) ---------------------------------------
# Top-level structure, first match wins. `{up}` and `{down}` are resolved in `original_to_diffusers_key`.
_ORIGINAL_STRUCTURE = (
    (re.compile(r"^conv1\."), "quant_conv."),
    (re.compile(r"^conv2\."), "post_quant_conv."),
    (re.compile(r"^decoder\.conv1\."), "decoder.conv_in."),
    (re.compile(r"^decoder\.middle\.0\."), "decoder.mid_block.resnets.0."),
    (re.compile(r"^decoder\.middle\.1\."), "decoder.mid_block.attentions.0."),
    (re.compile(r"^decoder\.middle\.2\."), "decoder.mid_block.resnets.1."),
    (re.compile(r"^decoder\.upsamples\.(\d+)\.upsamples\.(\d+)\."), "{up}"),
    (re.compile(r"^decoder\.head\.0\."), "decoder.norm_out."),
    (re.compile(r"^decoder\.head\.2\."), "decoder.conv_out."),
    (re.compile(r"^encoder\.conv1\."), "encoder.conv_in."),
    (re.compile(r"^encoder\.middle\.0\."), "encoder.mid_block.resnets.0."),
    (re.compile(r"^encoder\.middle\.1\."), "encoder.mid_block.attentions.0."),
    (re.compile(r"^encoder\.middle\.2\."), "encoder.mid_block.resnets.1."),
    (re.compile(r"^encoder\.downsamples\.(\d+)\.downsamples\.(\d+)\."), "{down}"),
    (re.compile(r"^encoder\.head\.0\."), "encoder.norm_out."),
    (re.compile(r"^encoder\.head\.2\."), "encoder.conv_out."),
)
# Inside a residual block: Sequential indices of `residual` and the shortcut.
_ORIGINAL_RESBLOCK = (
    (re.compile(r"\.residual\.0\."), ".norm1."),
    (re.compile(r"\.residual\.2\."), ".conv1."),
    (re.compile(r"\.residual\.3\."), ".norm2."),
    (re.compile(r"\.residual\.6\."), ".conv2."),
    (re.compile(r"\.shortcut\."), ".conv_shortcut."),
)


def original_to_diffusers_key(key: str, num_res_blocks: int = 2) -> str:
    """Map one original Wan2.2 VAE key (`Wan2.2_VAE.pth`, ComfyUI) to its diffusers name.

    Encoder keys map the same way (`encoder.downsamples.i.downsamples.j` → `encoder.down_blocks.i.resnets.j`
    for j < num_res_blocks, else `.downsampler`). Keys that match no rule are returned unchanged, so that
    validation reports them as unexpected.
    """
    for pattern, replacement in _ORIGINAL_STRUCTURE:
        match = pattern.match(key)
        if not match:
            continue
        if replacement == "{up}":
            i, j = int(match.group(1)), int(match.group(2))
            # Up_ResidualBlock.upsamples = [ResBlock × (num_res_blocks + 1), Resample]
            part = f"resnets.{j}." if j <= num_res_blocks else "upsampler."
            replacement = f"decoder.up_blocks.{i}.{part}"
        elif replacement == "{down}":
            i, j = int(match.group(1)), int(match.group(2))
            # Down_ResidualBlock.downsamples = [ResBlock × num_res_blocks, Resample]
            part = f"resnets.{j}." if j < num_res_blocks else "downsampler."
            replacement = f"encoder.down_blocks.{i}.{part}"
        key = replacement + key[match.end() :]
        break
    if ".resnets." in key:
        for pattern, replacement in _ORIGINAL_RESBLOCK:
            key = pattern.sub(replacement, key, count=1)
    return key


def _key_names(keys: list[str]) -> str:
    """'diffusers' or 'original', from marker keys; raises if neither (a checkpoint of another model)."""
    if any(k.startswith(("post_quant_conv.", "decoder.conv_in.", "decoder.mid_block.")) for k in keys):
        return "diffusers"
    if any(k.startswith(("conv2.", "decoder.conv1.", "decoder.middle.", "decoder.upsamples.")) for k in keys):
        return "original"
    sample = ", ".join(sorted(keys)[:5]) or "no tensors"
    raise CheckpointError(f"this is not a Wan VAE checkpoint (it holds {sample}, ...)", hint=_VAE_HINT)


# -- locating a checkpoint ------------------------------------------------------------------------
@dataclass(frozen=True)
class VAECheckpoint:
    """A located checkpoint: its weights file, architecture and where it came from."""

    weights: Path
    config: WanVAEConfig | None  # None for single files: TI2V-5B structure, widths read from the tensors
    source: str  # for messages and sidecars: a path, or `repo@revision`
    layout: str  # "diffusers folder", "single file"


# Single-file checkpoints (and a config file): a spec ending in one is a path, never a repo id.
_FILE_SUFFIXES = (".pth", ".pt", ".ckpt", ".safetensors", ".bin", ".json")


def _diffusers_folder(folder: Path) -> Path | None:
    """The folder holding config.json + weights: `folder` itself or its `vae/` subfolder."""
    for candidate in (folder, folder / "vae"):
        if (candidate / DIFFUSERS_CONFIG).is_file() and (candidate / DIFFUSERS_WEIGHTS).is_file():
            return candidate
    return None


def _read_config_json(path: Path) -> WanVAEConfig:
    return WanVAEConfig.from_diffusers_config(read_json_object(path), source=str(path))


def _local_checkpoint(path: Path) -> VAECheckpoint:
    if path.is_dir():
        folder = _diffusers_folder(path)
        if folder is None:
            raise CheckpointError(
                f"{path} is a folder without {DIFFUSERS_CONFIG} and {DIFFUSERS_WEIGHTS} (looked in it and in vae/)",
                hint=_VAE_HINT,
            )
        return VAECheckpoint(
            folder / DIFFUSERS_WEIGHTS,
            _read_config_json(folder / DIFFUSERS_CONFIG),
            str(path),
            "diffusers folder",
        )
    return VAECheckpoint(path, None, str(path), "single file")


def _hub_checkpoint(repo_id: str, revision: str | None) -> VAECheckpoint:
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    def fetch(subfolder: str | None) -> tuple[Path, Path]:
        config, weights = (
            hub_file(repo_id, name, subfolder=subfolder, revision=revision)
            for name in (DIFFUSERS_CONFIG, DIFFUSERS_WEIGHTS)
        )
        return config, weights

    local_hint = "pass --vae PATH to a local Wan2.2_VAE.pth, wan2.2_vae.safetensors or diffusers vae/ folder"
    with hub_errors(repo_id, revision, what="the VAE", local_hint=local_hint) as where:
        # LocalEntryNotFoundError (offline, nothing cached) is a subclass of EntryNotFoundError in
        # huggingface_hub >= 1.0: let it through to hub_errors.
        try:
            config_path, weights = fetch("vae")
        except EntryNotFoundError as exc:  # a VAE-only repository keeps the files at its root
            if isinstance(exc, LocalEntryNotFoundError):
                raise
            try:
                config_path, weights = fetch(None)
            except EntryNotFoundError as exc2:
                if isinstance(exc2, LocalEntryNotFoundError):
                    raise
                raise CheckpointError(
                    f"{where} has no {DIFFUSERS_CONFIG} + {DIFFUSERS_WEIGHTS} in vae/ or at its root",
                    hint=_VAE_HINT,
                ) from exc2
    return VAECheckpoint(weights, _read_config_json(config_path), where, "diffusers folder")


def resolve_vae_checkpoint(spec: str | Path | None = None, revision: str | None = None) -> VAECheckpoint:
    """Locate a VAE checkpoint from a local path or a Hugging Face repo id (downloading it if needed).

    Args:
        spec: a `.pth`/`.safetensors` file, a diffusers folder (or a repo root with `vae/`), or a repo id;
            `None` means `DEFAULT_VAE_REPO`.
        revision: branch, tag or commit for a repo id (ignored for local paths).

    Raises:
        InputError / CheckpointError: no such path, not a VAE checkpoint, bad config (exit 2).
        DownloadError: the hub could not be reached and nothing is cached (exit 1).
    """
    spec = str(spec) if spec is not None else DEFAULT_VAE_REPO
    path = Path(spec).expanduser()
    if path.exists():
        return _local_checkpoint(path)
    if looks_like_path(spec, file_suffixes=_FILE_SUFFIXES):
        raise InputError(f"no such file or folder: {spec}", hint=_VAE_HINT)
    return _hub_checkpoint(spec, revision)


# -- checking and loading -----------------------------------------------------------------------
def check_decoder_keys(
    shapes: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], source: str
) -> None:
    """Every expected key present with its shape; encoder/quant-conv keys accepted; anything else an error.

    Args:
        shapes: checkpoint key (diffusers names) -> shape.
        expected: the decoder's own key -> shape.

    Raises:
        CheckpointError: naming the missing, unexpected and mis-shaped keys.
    """
    if expected and not set(shapes) & set(expected):
        raise CheckpointError(
            f"{source} is not a Wan2.2 VAE checkpoint: none of the decoder's keys are in it "
            f"(it holds {listing(shapes, 5)})",
            hint=_VAE_HINT,
        )
    check_keys(
        shapes,
        expected,
        f"{source} does not match the Wan2.2 VAE decoder",
        accepted_prefixes=_ACCEPTED_EXTRA_PREFIXES,
        hint="is it a Wan2.1 VAE or another model? " + _VAE_HINT,
    )


def check_encoder_keys(
    shapes: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]], source: str
) -> None:
    """Every key of the encoder (`encoder.*`, `quant_conv.*`) present with its shape, and no other.

    Args:
        shapes: the checkpoint's encoder keys (diffusers names) -> shape.
        expected: the encoder's own key -> shape.

    Raises:
        CheckpointError: naming the missing, unexpected and mis-shaped keys.
    """
    check_keys(shapes, expected, f"{source} does not match the Wan2.2 VAE encoder", hint=_VAE_HINT)


def load_vae_decoder(
    spec: str | Path | None = None,
    revision: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> WanVAEDecoder:
    """Locate, check and load a Wan2.2 VAE decoder.

    Args:
        spec, revision: see `resolve_vae_checkpoint`.
        dtype: parameter dtype (`torch.float32`, `torch.bfloat16`, `torch.float64`).
        device: where the decoder runs.

    Returns:
        The reference decoder in eval mode, on `device`, in `dtype`.
    """
    ckpt = resolve_vae_checkpoint(spec, revision)
    return load_decoder_weights(ckpt.weights, ckpt.config, dtype=dtype, device=device, source=ckpt.source)


def _single_file_config(shapes: Mapping[str, tuple[int, ...]]) -> WanVAEConfig:
    """TI2V-5B structure; the widths come from the tensors (256 in real files, smaller in test files)."""
    config = WanVAEConfig()
    conv_out = shapes.get("decoder.conv_out.weight")
    if conv_out is not None and len(conv_out) == 5:
        config = config.replace(decoder_base_dim=conv_out[1])
    encoder_in = shapes.get("encoder.conv1.weight") or shapes.get("encoder.conv_in.weight")
    if encoder_in is not None and len(encoder_in) == 5:
        config = config.replace(base_dim=encoder_in[0])
    return config


def load_decoder_weights(
    weights: Path,
    config: WanVAEConfig | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    source: str | None = None,
) -> WanVAEDecoder:
    """Build the decoder and load its tensors from one weights file (any accepted key names).

    Args:
        config: the architecture (from a diffusers config.json); `None` for single files, which are
            the TI2V-5B architecture with widths read from the tensors.
    """
    source = source or str(weights)
    tensors = read_tensor_file(Path(weights), _READ_ERRORS)
    renamed = _our_names(tensors, config)
    if len(renamed) != len(tensors.shapes):
        raise CheckpointError(f"{source} holds the same tensor under two key names", hint=_VAE_HINT)
    if config is None:
        config = _single_file_config({ours: tensors.shapes[orig] for ours, orig in renamed.items()})
    with torch.device("meta"):
        model = WanVAEDecoder(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    check_decoder_keys({ours: tensors.shapes[orig] for ours, orig in renamed.items()}, expected, source)
    return _load_into(model, tensors, renamed, dtype=dtype, device=device, source=source)


@dataclass(frozen=True)
class DecoderTensors:
    """A located checkpoint's decoder, not loaded: its architecture (read from the tensors for a single file), the
    shapes of its decoder tensors by our (diffusers) names, and a reader of any tensor by our name (in the file's
    dtype, on the CPU)."""

    config: WanVAEConfig
    shapes: Mapping[str, tuple[int, ...]]
    load: Callable[[str], torch.Tensor]


def read_decoder_tensors(checkpoint: VAECheckpoint) -> DecoderTensors:
    """`DecoderTensors` of a located checkpoint: its header (and a config file) read, no tensor yet."""
    tensors = read_tensor_file(Path(checkpoint.weights), _READ_ERRORS)
    renamed = _our_names(tensors, checkpoint.config)
    shapes = {ours: tensors.shapes[orig] for ours, orig in renamed.items()}
    config = checkpoint.config or _single_file_config(shapes)
    decoder = {
        key: shape for key, shape in shapes.items() if key.startswith(("decoder.", "post_quant_conv."))
    }
    return DecoderTensors(config, decoder, lambda key: tensors.load(renamed[key]))


def _our_names(tensors: TensorFile, config: WanVAEConfig | None) -> dict[str, str]:
    """Our (diffusers) key -> the file's key, whichever naming the file uses."""
    num_res_blocks = (config or WanVAEConfig()).num_res_blocks
    if _key_names(list(tensors.shapes)) == "original":
        return {original_to_diffusers_key(k, num_res_blocks): k for k in tensors.shapes}
    return {k: k for k in tensors.shapes}


def _load_into(model, tensors: TensorFile, renamed: Mapping[str, str], *, dtype, device, source: str):
    """Load the model's tensors (checked keys; `renamed` maps our names to the file's) in `dtype` on `device`."""
    state = {}
    for key in model.state_dict():
        # Copied in the file's dtype and cast on `device`: a GPU casts the 1.4 GB of float32 weights to
        # bf16 in milliseconds, the CPU took most of a second of the load.
        state[key] = float_tensor(tensors.load(renamed[key]), source, renamed[key]).to(
            device=device, dtype=dtype
        )
    model.load_state_dict(state, strict=True, assign=True)
    return model.to(device).eval().requires_grad_(False)


# -- the encoder (image-to-video) -----------------------------------------------------------------
_ENCODER_PREFIXES = ("encoder.", "quant_conv.")


def load_vae_encoder(
    spec: str | Path | None = None,
    revision: str | None = None,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
):
    """Locate, check and load the Wan2.2 VAE encoder (`encoder.*` + `quant_conv.*`) from a whole-VAE checkpoint.

    Args:
        spec, revision: see `resolve_vae_checkpoint` (the same files as the decoder).
        dtype: parameter dtype.
        device: where the encoder runs.

    Returns:
        A `pan2cli.vae.encoder.WanVAEEncoder` in eval mode, on `device`, in `dtype`.

    Raises:
        CheckpointError: the file holds no encoder (a decoder-only file), or its keys/shapes do not
            match (named).
    """
    from pan2cli.vae.encoder import WanVAEEncoder

    ckpt = resolve_vae_checkpoint(spec, revision)
    tensors = read_tensor_file(Path(ckpt.weights), _READ_ERRORS)
    renamed = {
        ours: theirs
        for ours, theirs in _our_names(tensors, ckpt.config).items()
        if ours.startswith(_ENCODER_PREFIXES)
    }
    if not renamed:
        raise CheckpointError(
            f"{ckpt.source} holds no VAE encoder (encoder.* / quant_conv.* keys); image-to-video needs one",
            hint="use a whole-VAE checkpoint (Wan2.2_VAE.pth or a diffusers vae/ folder)",
        )
    config = ckpt.config or _single_file_config(
        {ours: tensors.shapes[orig] for ours, orig in renamed.items()}
    )
    with torch.device("meta"):
        model = WanVAEEncoder(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    check_encoder_keys({ours: tensors.shapes[orig] for ours, orig in renamed.items()}, expected, ckpt.source)
    return _load_into(model, tensors, renamed, dtype=dtype, device=device, source=ckpt.source)
