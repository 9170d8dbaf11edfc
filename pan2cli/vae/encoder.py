"""Reference Wan2.2 (TI2V-5B) VAE encoder in PyTorch: video or image → latent mean, chunk by chunk, causal in time.

The mirror of the decoder (`pan2cli.vae.model`), with the same building blocks (causal 3x3x3 convs
that keep two frames of history, RMS norms, residual blocks, the mid-block attention). Parameter
paths equal diffusers' `AutoencoderKLWan` keys (`encoder.conv_in.*`, `encoder.down_blocks.{i}.resnets.{j}.*`,
`encoder.down_blocks.{i}.downsampler.*`, `encoder.mid_block.*`, `encoder.norm_out.*`, `encoder.conv_out.*`,
`quant_conv.*`); original Wan keys map through `pan2cli.vae.checkpoint`'s table.

The math (diffusers' `WanEncoder3d` and `WanResidualDownBlock`, paraphrased):

* patchify 2x2 (3 → 12 channels), then conv_in (12 → base_dim);
* per down block: `num_res_blocks` residual blocks, then (except in the last block) a downsampler,
  plus the parameter-free `AvgDown3D` shortcut of the block input (mean over groups of channels
  after a space/time-to-channel shuffle; time is zero-padded in front to a multiple of its factor);
* downsamplers: zero pad right/bottom by 1, 3x3 conv stride 2 per frame; the temporal ones then run a
  (3, 1, 1) conv with stride 2 in time whose history is the previous chunk's last frame — on the
  first chunk it is skipped (the single first frame passes through);
* mid block (ResBlock, per-frame attention, ResBlock), RMS norm, SiLU, conv_out (→ 2·z_dim: mean and
  log-variance), then `quant_conv` (1x1x1). Only the mean is used (no sampling).

Chunks: the first is one video frame, later ones four (one latent frame each), as the reference does;
F frames (F = 1 + 4k) give 1 + (F − 1)/4 latent frames.
"""

from __future__ import annotations

from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pan2cli.vae.config import WanVAEConfig
from pan2cli.vae.model import (
    CausalCache,
    WanCausalConv3d,
    WanMidBlock,
    WanResidualBlock,
    WanRMSNorm,
    _ieee_fp32,
)


def patchify(x: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, C, T, p·H, p·W) → (B, C·p², T, H, W), channel `c·p² + r·p + q` ← pixel (p·h + q, p·w + r); inverse of `unpatchify`."""
    if patch_size == 1:
        return x
    b, c, t, h, w = x.shape
    p = patch_size
    x = x.view(b, c, t, h // p, p, w // p, p)  # (b, c, t, h, q, w, r)
    return x.permute(0, 1, 6, 4, 2, 3, 5).reshape(b, c * p * p, t, h // p, w // p)


class WanAvgDown3D(nn.Module):
    """Parameter-free shortcut of the down blocks: (t, h, w) blocks into channels, then the mean over channel groups."""

    def __init__(self, in_channels: int, out_channels: int, factor_t: int, factor_s: int):
        super().__init__()
        self.out_channels = out_channels
        self.factor_t = factor_t
        self.factor_s = factor_s
        self.group_size = in_channels * factor_t * factor_s**2 // out_channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ft, fs = self.factor_t, self.factor_s
        pad_t = (ft - x.shape[2] % ft) % ft
        x = F.pad(x, (0, 0, 0, 0, pad_t, 0))  # zero frames in front
        b, c, t, h, w = x.shape
        x = x.view(b, c, t // ft, ft, h // fs, fs, w // fs, fs)
        x = x.permute(0, 1, 3, 5, 7, 2, 4, 6).reshape(
            b, self.out_channels, self.group_size, t // ft, h // fs, w // fs
        )
        return x.mean(dim=2)


class WanDownsample(nn.Module):
    """Encoder downsampler: zero pad right/bottom, 3x3 conv stride 2 per frame; optionally a stride-2 causal conv in time."""

    def __init__(self, dim: int, temporal: bool):
        super().__init__()
        self.resample = nn.Sequential(nn.ZeroPad2d((0, 1, 0, 1)), nn.Conv2d(dim, dim, 3, stride=(2, 2)))
        self.time_conv = nn.Conv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1)) if temporal else None
        self.cache_key: str | None = None  # set by WanVAEEncoder

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        b, c, t, h, w = x.shape
        x = self.resample(x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w))
        x = x.view(b, t, c, x.shape[-2], x.shape[-1]).permute(0, 2, 1, 3, 4)
        if self.time_conv is None:
            return x
        history = cache.get(self.cache_key)
        cache[self.cache_key] = x[:, :, -1:].clone()
        if history is None:  # first chunk: the single first frame is not downsampled in time
            return x
        return self.time_conv(torch.cat([history, x], dim=2))


class WanResidualDownBlock(nn.Module):
    """`num_res_blocks` residual blocks, then the downsampler, plus the `AvgDown3D` shortcut of the block input."""

    def __init__(
        self, in_dim: int, out_dim: int, num_res_blocks: int, temperal_downsample: bool, down_flag: bool
    ):
        super().__init__()
        self.resnets = nn.ModuleList(
            WanResidualBlock(in_dim if i == 0 else out_dim, out_dim) for i in range(num_res_blocks)
        )
        self.downsampler = WanDownsample(out_dim, temperal_downsample) if down_flag else None
        self.avg_shortcut = WanAvgDown3D(
            in_dim, out_dim, 2 if temperal_downsample else 1, 2 if down_flag else 1
        )

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        x_in = x
        for resnet in self.resnets:
            x = resnet(x, cache)
        if self.downsampler is not None:
            x = self.downsampler(x, cache)
        return x + self.avg_shortcut(x_in)


class WanEncoder3d(nn.Module):
    """conv_in → down blocks → mid block → RMS norm, SiLU, conv_out (2·z_dim channels: mean, log-variance)."""

    def __init__(self, config: WanVAEConfig):
        super().__init__()
        dims = [config.base_dim * m for m in (1, *config.dim_mult)]
        n_blocks = len(config.dim_mult)
        self.conv_in = WanCausalConv3d(config.in_channels, dims[0], 3, padding=1)
        self.down_blocks = nn.ModuleList(
            WanResidualDownBlock(
                dims[i],
                dims[i + 1],
                config.num_res_blocks,
                temperal_downsample=config.temperal_downsample[i] if i != n_blocks - 1 else False,
                down_flag=i != n_blocks - 1,
            )
            for i in range(n_blocks)
        )
        self.mid_block = WanMidBlock(dims[-1])
        self.norm_out = WanRMSNorm(dims[-1], images=False)
        self.conv_out = WanCausalConv3d(dims[-1], 2 * config.z_dim, 3, padding=1)

    def forward(self, x: torch.Tensor, cache: CausalCache) -> torch.Tensor:
        # x: (B, 12, f, H/2, W/2) patchified frames -> (B, 2·z_dim, t, H/16, W/16)
        x = self.conv_in(x, cache)
        for block in self.down_blocks:
            x = block(x, cache)
        x = self.mid_block(x, cache)
        return self.conv_out(F.silu(self.norm_out(x)), cache)


class WanVAEEncoder(nn.Module):
    """The encoder half of the Wan2.2 VAE (`encoder` + `quant_conv`), encoding chunk by chunk.

    Args:
        config (`WanVAEConfig`): the architecture (`base_dim` is the encoder width).
    """

    def __init__(self, config: WanVAEConfig):
        super().__init__()
        self.config = config
        self.encoder = WanEncoder3d(config)
        self.quant_conv = WanCausalConv3d(2 * config.z_dim, 2 * config.z_dim, 1)
        for name, module in self.named_modules():
            if isinstance(module, (WanCausalConv3d, WanDownsample)):
                module.cache_key = name

    @property
    def dtype(self) -> torch.dtype:
        return self.quant_conv.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.quant_conv.weight.device

    @torch.inference_mode()
    def encode_chunks(self, video: torch.Tensor) -> Iterator[torch.Tensor]:
        """Encode frames in [−1, 1] chunk by chunk (1 frame, then 4 at a time).

        Args:
            video: `(B, 3, F, H, W)` with F = 1 + 4k and H, W multiples of 16; moved to the model's
                device and dtype.

        Yields:
            `(B, z_dim, t, H/16, W/16)` raw latent means (not normalised): 1 latent frame per chunk.

        Raises:
            ValueError: a shape that does not fit.
        """
        cfg = self.config
        factor = cfg.scale_factor_spatial
        if video.dim() != 5 or video.shape[1] != 3:
            raise ValueError(f"expected frames of shape (B, 3, F, H, W), got {tuple(video.shape)}")
        frames, height, width = video.shape[2:]
        if (frames - 1) % cfg.scale_factor_temporal or height % factor or width % factor:
            raise ValueError(
                f"frames must be 1 + 4k and H, W multiples of {factor}, got {tuple(video.shape)}"
            )
        x = patchify(video.to(self.device, self.dtype), cfg.patch_size)
        cache: CausalCache = {}
        bounds = [(0, 1)] + [
            (s, s + cfg.scale_factor_temporal) for s in range(1, frames, cfg.scale_factor_temporal)
        ]
        for start, stop in bounds:
            with _ieee_fp32():
                out = self.quant_conv(self.encoder(x[:, :, start:stop], cache))
            yield out[:, : cfg.z_dim]

    def encode(self, video: torch.Tensor) -> torch.Tensor:
        """Raw latent means `(B, z_dim, 1 + (F − 1)/4, H/16, W/16)` of a whole video; see `encode_chunks`."""
        return torch.cat(list(self.encode_chunks(video)), dim=2)
