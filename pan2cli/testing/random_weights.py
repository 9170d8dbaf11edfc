"""Random-weight Wan2.2 VAE state dicts and checkpoint files in every real layout, for tests."""

from __future__ import annotations

import collections
import hashlib
import json
import math
from pathlib import Path
from typing import Iterable, Sequence

import torch
from safetensors.torch import save_file

from pan2cli.atomic import replace_into
from pan2cli.vae.checkpoint import DIFFUSERS_CONFIG, DIFFUSERS_WEIGHTS, original_to_diffusers_key
from pan2cli.vae.config import WanVAEConfig

# The key layout is written out by hand from the architecture (docs/wan22_vae.md §3, §7) in both namings,
# diffusers' `AutoencoderKLWan` and the original `Wan2.2_VAE.pth` (Wan-Video/Wan2.2 `wan/modules/vae2_2.py`),
# so that this module works without diffusers. Real files hold the whole VAE, so the encoder and
# `quant_conv` are laid out too, although pan2 has no encoder yet.

KEY_NAMES = ("diffusers", "original")
FORMATS = ("pth", "safetensors", "diffusers")
PTH_NAME = "Wan2.2_VAE.pth"  # the name in Wan-AI/Wan2.2-TI2V-5B
SAFETENSORS_NAME = "wan2.2_vae.safetensors"  # the name in Comfy-Org/Wan_2.2_ComfyUI_Repackaged

Shape = tuple[int, ...]
# (suffix in diffusers names, suffix in original names, shape) of one tensor of a block.
_Param = tuple[str, str, Shape]


# -- building blocks, in both namings --------------------------------------------------------------
def _conv(d_name: str, o_name: str, c_out: int, c_in: int, kernel: Sequence[int]) -> list[_Param]:
    """Weight `[c_out, c_in, *kernel]` and bias `[c_out]` of one convolution."""
    return [
        (f"{d_name}.weight", f"{o_name}.weight", (c_out, c_in, *kernel)),
        (f"{d_name}.bias", f"{o_name}.bias", (c_out,)),
    ]


def _residual_block(c_in: int, c_out: int) -> list[_Param]:
    """`WanResidualBlock` / `ResidualBlock`.

    The original keeps its layers in one `nn.Sequential` named `residual`
    (0 RMS norm, 1 SiLU, 2 conv, 3 RMS norm, 4 SiLU, 5 dropout, 6 conv), so only indices 0/2/3/6 hold
    tensors; diffusers names them norm1/conv1/norm2/conv2. The 1x1x1 shortcut exists only when the width
    changes. RMS norms of video tensors have γ of shape (C, 1, 1, 1) and no bias.
    """
    params = [
        ("norm1.gamma", "residual.0.gamma", (c_in, 1, 1, 1)),
        *_conv("conv1", "residual.2", c_out, c_in, (3, 3, 3)),
        ("norm2.gamma", "residual.3.gamma", (c_out, 1, 1, 1)),
        *_conv("conv2", "residual.6", c_out, c_out, (3, 3, 3)),
    ]
    if c_in != c_out:
        params += _conv("conv_shortcut", "shortcut", c_out, c_in, (1, 1, 1))
    return params


def _attention_block(c: int) -> list[_Param]:
    """`WanAttentionBlock` / `AttentionBlock`: same names in both layouts; its norm is per image, γ (C, 1, 1)."""
    return [
        ("norm.gamma", "norm.gamma", (c, 1, 1)),
        *_conv("to_qkv", "to_qkv", 3 * c, c, (1, 1)),
        *_conv("proj", "proj", c, c, (1, 1)),
    ]


def _resample(c: int, temporal: bool, up: bool) -> list[_Param]:
    """`WanResample` / `Resample` of the Wan2.2 VAE (both keep the width `c` in the spatial conv).

    `resample` is `Sequential(Upsample | ZeroPad2d, Conv2d 3x3)`, so the conv is index 1. The temporal
    conv (kernel (3, 1, 1)) doubles the channels when upsampling (depth-to-time) and keeps them when
    downsampling (stride 2 in time).
    """
    params = _conv("resample.1", "resample.1", c, c, (3, 3))
    if temporal:
        params += _conv("time_conv", "time_conv", 2 * c if up else c, c, (3, 1, 1))
    return params


def _prefixed(d_prefix: str, o_prefix: str, params: Iterable[_Param]) -> list[_Param]:
    return [(d_prefix + d, o_prefix + o, shape) for d, o, shape in params]


# -- the encoder (diffusers name, original name, shape) ---------------------------------------------
def _encoder_params(config: WanVAEConfig) -> list[_Param]:
    """Every tensor of the encoder and `quant_conv`, in the order of the original file.

    Original names follow diffusers' `convert_vae_22` rules read backwards: `encoder.conv1` ↔ `conv_in`;
    `downsamples.i.downsamples.j` (j < num_res_blocks) ↔ `down_blocks.i.resnets.j`; the block's last
    Sequential entry, `downsamples.i.downsamples.{num_res_blocks}`, is the Resample ↔ `down_blocks.i.downsampler`;
    `middle.0/1/2` ↔ `mid_block.resnets.0`/`attentions.0`/`resnets.1`; `head.0`/`head.2` ↔ `norm_out`/`conv_out`;
    top-level `conv1` ↔ `quant_conv`. The `AvgDown3D` shortcut has no tensors.
    """
    dims = [config.base_dim * m for m in (1, *config.dim_mult)]
    n_blocks = len(config.dim_mult)
    params = _prefixed(
        "encoder.", "encoder.", _conv("conv_in", "conv1", dims[0], config.in_channels, (3, 3, 3))
    )
    for i in range(n_blocks):
        c_in, c_out = dims[i], dims[i + 1]
        d_block, o_block = f"encoder.down_blocks.{i}.", f"encoder.downsamples.{i}.downsamples."
        for j in range(config.num_res_blocks):
            block = _residual_block(c_in if j == 0 else c_out, c_out)
            params += _prefixed(f"{d_block}resnets.{j}.", f"{o_block}{j}.", block)
        if i != n_blocks - 1:  # the last block keeps the resolution
            down = _resample(c_out, temporal=config.temperal_downsample[i], up=False)
            params += _prefixed(f"{d_block}downsampler.", f"{o_block}{config.num_res_blocks}.", down)
    c = dims[-1]
    params += _prefixed("encoder.mid_block.resnets.0.", "encoder.middle.0.", _residual_block(c, c))
    params += _prefixed("encoder.mid_block.attentions.0.", "encoder.middle.1.", _attention_block(c))
    params += _prefixed("encoder.mid_block.resnets.1.", "encoder.middle.2.", _residual_block(c, c))
    params.append(("encoder.norm_out.gamma", "encoder.head.0.gamma", (c, 1, 1, 1)))
    # The encoder emits mean and log-variance: 2·z_dim channels, then the 1x1x1 quant conv.
    params += _prefixed("encoder.", "encoder.", _conv("conv_out", "head.2", 2 * config.z_dim, c, (3, 3, 3)))
    params += _conv("quant_conv", "conv1", 2 * config.z_dim, 2 * config.z_dim, (1, 1, 1))
    return params


def encoder_key_shapes(config: WanVAEConfig) -> dict[str, Shape]:
    """Shapes of the encoder's and `quant_conv`'s tensors, by diffusers name.

    Args:
        config: the VAE architecture (`base_dim` is the encoder width).

    Returns:
        `{"encoder.conv_in.weight": (base_dim, in_channels, 3, 3, 3), ..., "quant_conv.bias": (2·z_dim,)}`.
    """
    return {d: shape for d, _, shape in _encoder_params(config)}


def encoder_key_map(config: WanVAEConfig) -> dict[str, str]:
    """Diffusers name → original (`Wan2.2_VAE.pth`) name of every encoder and `quant_conv` tensor.

    Args:
        config: the VAE architecture.

    Returns:
        e.g. `"encoder.down_blocks.1.downsampler.time_conv.weight"` →
        `"encoder.downsamples.1.downsamples.2.time_conv.weight"`.
    """
    return {d: o for d, o, _ in _encoder_params(config)}


# -- the decoder (original name, shape); diffusers names come from the loader's mapping ------------
def original_decoder_key_shapes(config: WanVAEConfig) -> dict[str, Shape]:
    """Shapes of `conv2` (post-quant conv) and every decoder tensor, by original name (docs/wan22_vae.md §7.2).

    Built from the original layout: `decoder.conv1`, `middle.{0,1,2}`, `upsamples.i.upsamples.j` with
    `num_res_blocks + 1` residual blocks then the Resample (absent in the last up-block), `head.{0,2}`.

    Args:
        config: the VAE architecture (`decoder_base_dim` is the decoder width unit).

    Returns:
        `{"conv2.weight": (z_dim, z_dim, 1, 1, 1), ..., "decoder.head.2.bias": (out_channels,)}`.
    """
    dims = config.decoder_dims
    z = config.z_dim
    params = [(o, shape) for _, o, shape in _conv("", "conv2", z, z, (1, 1, 1))]
    params += [(f"decoder.{o}", shape) for _, o, shape in _conv("", "conv1", dims[0], z, (3, 3, 3))]
    middle = (_residual_block(dims[0], dims[0]), _attention_block(dims[0]), _residual_block(dims[0], dims[0]))
    for k, block in enumerate(middle):
        params += [(f"decoder.middle.{k}.{o}", shape) for _, o, shape in block]
    n_up = len(dims) - 1
    for i in range(n_up):
        c_in, c_out = dims[i], dims[i + 1]
        prefix = f"decoder.upsamples.{i}.upsamples."
        for j in range(config.num_res_blocks + 1):
            block = _residual_block(c_in if j == 0 else c_out, c_out)
            params += [(f"{prefix}{j}.{o}", shape) for _, o, shape in block]
        if i != n_up - 1:  # the last up-block keeps the resolution
            up = _resample(c_out, temporal=config.temperal_upsample[i], up=True)
            params += [(f"{prefix}{config.num_res_blocks + 1}.{o}", shape) for _, o, shape in up]
    params.append(("decoder.head.0.gamma", (dims[-1], 1, 1, 1)))
    head = _conv("", "head.2", config.out_channels, dims[-1], (3, 3, 3))
    params += [(f"decoder.{o}", shape) for _, o, shape in head]
    return dict(params)


def decoder_key_map(config: WanVAEConfig) -> dict[str, str]:
    """Diffusers name → original name of `post_quant_conv` and every decoder tensor.

    The inverse of `pan2cli.vae.checkpoint.original_to_diffusers_key` over the decoder's original keys, so
    files written with it are read back through the loader's own table.

    Raises:
        RuntimeError: two original keys map to one diffusers name (the loader's table is not one-to-one).
    """
    mapping: dict[str, str] = {}
    for original in original_decoder_key_shapes(config):
        diffusers = original_to_diffusers_key(original, config.num_res_blocks)
        if diffusers in mapping:
            raise RuntimeError(f"{mapping[diffusers]} and {original} both map to {diffusers}")
        mapping[diffusers] = original
    return mapping


# -- the whole VAE ----------------------------------------------------------------------------------
def vae_key_shapes(config: WanVAEConfig, *, encoder: bool = True) -> dict[str, Shape]:
    """Shapes of every tensor of a whole-VAE file, by diffusers name, in file order.

    Args:
        config: the VAE architecture.
        encoder: include `encoder.*` and `quant_conv.*` (real files do).

    Returns:
        Diffusers name → shape; 196 tensors, 704,688,668 values for TI2V-5B with the encoder.
    """
    shapes = encoder_key_shapes(config) if encoder else {}
    original_shapes = original_decoder_key_shapes(config)
    shapes.update({d: original_shapes[o] for d, o in decoder_key_map(config).items()})
    return shapes


def vae_key_map(config: WanVAEConfig, *, encoder: bool = True) -> dict[str, str]:
    """Diffusers name → original name of every tensor of a whole-VAE file (see `vae_key_shapes`)."""
    mapping = encoder_key_map(config) if encoder else {}
    mapping.update(decoder_key_map(config))
    return mapping


# -- random values ----------------------------------------------------------------------------------
def _tensor_seed(seed: int, name: str) -> int:
    """A 63-bit seed from (seed, diffusers name), so a tensor's values depend on nothing else.

    Per-tensor seeds keep the decoder's values the same with or without the encoder and in any order.
    """
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def _random_tensor(name: str, shape: Shape, seed: int, generator: torch.Generator) -> torch.Tensor:
    """fp32 values for one tensor: weights `randn/√fan_in`, biases `0.02·randn`, RMS γ `1 + 0.1·randn`.

    1/√fan_in keeps activations of order one through the ~40 convolutions, so the decoded video is
    neither all clamped nor all zero; γ is perturbed so that a norm whose γ was dropped or misplaced
    changes the output.
    """
    generator.manual_seed(_tensor_seed(seed, name))
    values = torch.randn(shape, generator=generator, dtype=torch.float32)
    if name.endswith(".weight"):
        return values.mul_(1.0 / math.sqrt(math.prod(shape[1:])))
    if name.endswith(".bias"):
        return values.mul_(0.02)
    if name.endswith(".gamma"):
        return values.mul_(0.1).add_(1.0)
    raise ValueError(f"no initialisation rule for tensor {name}")


def random_vae_state_dict(
    config: WanVAEConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    key_names: str = "diffusers",
    encoder: bool = True,
) -> dict[str, torch.Tensor]:
    """A whole Wan2.2 VAE state dict of random values.

    Values are drawn in fp32 on the CPU, tensor by tensor (full size is 2.8 GB in fp32), then cast to
    `dtype`; they depend only on `seed` and each tensor's diffusers name, so both namings, any `encoder`
    choice and every dtype carry the same values (up to the cast).

    Args:
        config: the VAE architecture.
        seed (`int`, defaults to 0): base seed.
        dtype (`torch.dtype`, defaults to `torch.float32`): dtype of the returned tensors.
        key_names (`str`, defaults to "diffusers"): "diffusers" (`AutoencoderKLWan`) or "original"
            (`Wan2.2_VAE.pth`, ComfyUI) key names.
        encoder (`bool`, defaults to True): include the encoder and `quant_conv` as real files do.

    Returns:
        Name → contiguous CPU tensor, in file order.

    Raises:
        ValueError: unknown `key_names`.
    """
    if key_names not in KEY_NAMES:
        raise ValueError(f"key_names must be one of {KEY_NAMES}, got {key_names!r}")
    rename = vae_key_map(config, encoder=encoder) if key_names == "original" else None
    generator = torch.Generator(device="cpu")
    state = {}
    for name, shape in vae_key_shapes(config, encoder=encoder).items():
        key = rename[name] if rename is not None else name
        state[key] = _random_tensor(name, shape, seed, generator).to(dtype)
    return state


def decoder_from_state(
    state: dict[str, torch.Tensor],
    config: WanVAEConfig | None = None,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
):
    """A `WanVAEDecoder` (default: TI2V-5B) holding `state`'s decoder tensors cast to `dtype`, on `device`.

    Built on the meta device and loaded in place, strictly; the encoder's tensors, if any, are skipped.
    """
    from pan2cli.vae.model import WanVAEDecoder

    with torch.device("meta"):
        decoder = WanVAEDecoder(config or WanVAEConfig())
    prefixes = ("decoder.", "post_quant_conv.")
    decoder.load_state_dict({k: v.to(dtype) for k, v in state.items() if k.startswith(prefixes)}, assign=True)
    return decoder.to(device).eval()


def random_decoder(
    config: WanVAEConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device = "cuda",
):
    """A `WanVAEDecoder` with random weights (`random_vae_state_dict`'s values), in `dtype` on `device`."""
    return decoder_from_state(
        random_vae_state_dict(config, seed=seed, encoder=False), config, dtype=dtype, device=device
    )


# -- files ------------------------------------------------------------------------------------------
def write_test_checkpoints(
    out_dir: Path,
    config: WanVAEConfig,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    formats: Sequence[str] = FORMATS,
    encoder: bool = True,
) -> dict[str, Path]:
    """Write one random-weight VAE in each requested layout, all with the same values.

    Layouts:
        * "pth": `out_dir/Wan2.2_VAE.pth`, `torch.save` of a flat state dict (an `OrderedDict`, as
          `state_dict()` returns), original names;
        * "safetensors": `out_dir/wan2.2_vae.safetensors`, a single file with original names (ComfyUI);
        * "diffusers": `out_dir/diffusers/vae/config.json` (`config.to_diffusers_config()`) and
          `diffusion_pytorch_model.safetensors` with diffusers names.

    Args:
        out_dir: folder to write into (created with its parents).
        config: the VAE architecture; single files carry no config, so only a TI2V-5B-sized one is
            readable from them alone.
        seed, dtype, encoder: see `random_vae_state_dict`.
        formats (`Sequence[str]`, defaults to all three): any of "pth", "safetensors", "diffusers".

    Returns:
        Format → path written (for "diffusers", the `vae` folder), in the order of `formats`.

    Raises:
        ValueError: an unknown format.
    """
    unknown = [f for f in formats if f not in FORMATS]
    if unknown:
        raise ValueError(f"unknown checkpoint format(s) {unknown}; choose from {list(FORMATS)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    state = random_vae_state_dict(config, seed=seed, dtype=dtype, encoder=encoder)
    # Renaming shares the tensors: one copy of the values in memory whatever the formats.
    original = (
        {o: state[d] for d, o in vae_key_map(config, encoder=encoder).items()}
        if {"pth", "safetensors"} & set(formats)
        else {}
    )
    written: dict[str, Path] = {}
    for fmt in dict.fromkeys(formats):
        if fmt == "pth":
            path = out_dir / PTH_NAME
            replace_into(path, lambda p: torch.save(collections.OrderedDict(original), p))
        elif fmt == "safetensors":
            path = out_dir / SAFETENSORS_NAME
            replace_into(path, lambda p: save_file(original, str(p)))
        else:
            path = out_dir / "diffusers" / "vae"
            path.mkdir(parents=True, exist_ok=True)
            text = json.dumps(config.to_diffusers_config(), indent=2) + "\n"
            replace_into(path / DIFFUSERS_CONFIG, lambda p, text=text: p.write_text(text))
            # diffusers' save_pretrained tags its files with format "pt".
            replace_into(
                path / DIFFUSERS_WEIGHTS, lambda p: save_file(state, str(p), metadata={"format": "pt"})
            )
        written[fmt] = path
    return written
