"""Reference Wan2.2 (TI2V-5B) VAE decoder in PyTorch: the exact semantics, any device and dtype.

Parameter paths equal diffusers' `AutoencoderKLWan` keys (`post_quant_conv.*`, `decoder.conv_in.*`,
`decoder.mid_block.*`, `decoder.up_blocks.*`, `decoder.norm_out.*`, `decoder.conv_out.*`); original
Wan keys are mapped by `pan2cli.vae.checkpoint`. The math follows docs/wan22_vae.md:

* causal 3x3x3 convolutions over time: each one keeps the last two frames of its own input as
  history, which starts as two zero frames (the reference's "pad 2 zero frames in front");
* RMS norm: `x / max(‖x‖₂ over channels, 1e-12) · √C · γ`, no bias, computed in fp32 for 16-bit inputs;
* the first chunk is exactly one latent frame: the temporal upsamplers ("Rep") skip `time_conv` on it
  and their `time_conv` never sees frame 0 as history; `DupUp3D` keeps one of its two frames;
* later chunks may hold any number of latent frames: the output does not depend on the split.

Several processes can decode one video together, each holding a band of rows of every frame: the
forwards then take `rows` (a `pan2cli.vae.parallel.RowSplit`), which supplies the halo rows of the
3x3 convolutions and the whole frame's keys/values in the attention. `rows=None` is one process.

Numerics: every op runs in the model's dtype (fp32, bf16, float64); the norms normalise in fp32 when the
input is 16-bit, as diffusers 0.42.1 does; fp32 on CUDA is IEEE fp32 (TF32 off while decoding). The nearest
upsampling goes through fp32 like the original
(`WanUpsample`), which is exact for fp32/bf16 and rounds float64 inputs to fp32 — kept, so that float64
runs match diffusers to the last bit.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import TYPE_CHECKING, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pan2cli.config import DEFAULT_CHUNK_LATENT_FRAMES
from pan2cli.vae.config import WanVAEConfig

if TYPE_CHECKING:
    from pan2cli.vae.parallel import RowSplit

# History frames a causal 3-tap temporal conv keeps in front of each chunk.
CACHE_T = 2

# Per-decode state: the causal history of every conv that has a temporal kernel, by module path.
CausalCache = dict


class WanCausalConv3d(nn.Conv3d):
    """3-D convolution, causal in time: zero padding in H and W, `kernel_t − 1` frames of history in front.

    The history is the previous chunk's last input frames (kept in `cache[self.cache_key]`), two zero
    frames at the start. Without a cache the conv pads zeros in front (a whole sequence in one call).
    With `rows` (a band of rows of a frame split across processes) the H padding is the neighbours'
    halo rows instead of zeros; the history keeps this band's rows only.
    """

    def __init__(self, in_channels: int, out_channels: int, kernel_size, padding=0):
        super().__init__(in_channels, out_channels, kernel_size, padding=padding)
        # The conv runs unpadded; H/W padding is explicit and T padding comes from the history.
        self._spatial_pad = (self.padding[2], self.padding[2], self.padding[1], self.padding[1])
        self._history = 2 * self.padding[0]
        self.padding = (0, 0, 0)
        self.cache_key: str | None = None  # set by WanVAEDecoder to the module's path

    def forward(
        self, x: torch.Tensor, cache: CausalCache | None = None, rows: RowSplit | None = None
    ) -> torch.Tensor:
        # x: (B, C, t, H, W)
        if self._history:
            if cache is None:
                history = x.new_zeros(*x.shape[:2], self._history, *x.shape[3:])
            else:
                history = cache.get(self.cache_key)
                if history is None:
                    history = x.new_zeros(*x.shape[:2], self._history, *x.shape[3:])
            x = torch.cat([history, x], dim=2)
            if cache is not None:
                cache[self.cache_key] = x[:, :, -self._history :].clone()
        if rows is not None and self._spatial_pad[2]:
            # One halo row above and below from the neighbours (zeros at the frame's edges), W padded
            # with zeros in the same copy: the same conv call as below, on H + 2 rows.
            return super().forward(rows.halo(x, pad_w=self._spatial_pad[0]))
        if any(self._spatial_pad):
            x = F.pad(x, (*self._spatial_pad, 0, 0))
        return super().forward(x)


class WanRMSNorm(nn.Module):
    """RMS norm over the channel axis (dim 1): `x / max(‖x‖₂, 1e-12) · √C · γ`, no mean, no bias."""

    def __init__(self, dim: int, images: bool = True):
        super().__init__()
        # γ broadcasts over (H, W) for images (B·T, C, H, W), over (T, H, W) for videos.
        self.gamma = nn.Parameter(torch.ones(dim, *((1, 1) if images else (1, 1, 1))))
        self.scale = dim**0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # The L2 norm of a 16-bit vector of 1024 channels loses bits; diffusers normalises in fp32.
        low_precision = x.dtype in (torch.float16, torch.bfloat16)
        y = F.normalize(x.float() if low_precision else x, dim=1).to(x.dtype)
        return y * self.scale * self.gamma


class WanResidualBlock(nn.Module):
    """`conv2(SiLU(RMS(conv1(SiLU(RMS(x)))))) + shortcut(x)`; the shortcut is a 1x1x1 conv when widths differ."""

    def __init__(self, in_dim: int, out_dim: int):
        super().__init__()
        self.norm1 = WanRMSNorm(in_dim, images=False)
        self.conv1 = WanCausalConv3d(in_dim, out_dim, 3, padding=1)
        self.norm2 = WanRMSNorm(out_dim, images=False)
        self.conv2 = WanCausalConv3d(out_dim, out_dim, 3, padding=1)
        self.conv_shortcut = WanCausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else None

    def forward(self, x: torch.Tensor, cache: CausalCache, rows: RowSplit | None = None) -> torch.Tensor:
        h = x if self.conv_shortcut is None else self.conv_shortcut(x)
        x = self.conv1(F.silu(self.norm1(x)), cache, rows)
        x = self.conv2(F.silu(self.norm2(x)), cache, rows)
        return x + h


class WanAttentionBlock(nn.Module):
    """Single-head self-attention over the pixels of each frame (no temporal mixing), pre-norm, residual.

    With `rows`, the whole frame is gathered and every process runs the one-process attention on it
    (0.1 % of the decode's FLOPs), keeping its rows: the same GEMM shapes, hence the same rounding.
    """

    def __init__(self, dim: int):
        super().__init__()
        self.norm = WanRMSNorm(dim, images=True)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x: torch.Tensor, rows: RowSplit | None = None) -> torch.Tensor:
        if rows is not None:
            return rows.take(self.forward(rows.gather_rows(x, dim=-2)))
        identity = x
        b, c, t, h, w = x.shape
        x = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        qkv = self.to_qkv(self.norm(x))
        # (B·T, 3C, H, W) -> (B·T, 1 head, H·W tokens, 3C) -> q, k, v of C channels each
        qkv = qkv.reshape(b * t, 1, c * 3, h * w).permute(0, 1, 3, 2).contiguous()
        q, k, v = qkv.chunk(3, dim=-1)
        x = F.scaled_dot_product_attention(q, k, v)  # scale 1/√C
        x = x.squeeze(1).permute(0, 2, 1).reshape(b * t, c, h, w)
        x = self.proj(x)
        return x.view(b, t, c, h, w).permute(0, 2, 1, 3, 4) + identity


class WanUpsample(nn.Upsample):
    """Nearest ×2 in H and W, computed in fp32 as the original does (exact duplication)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x.float()).to(x.dtype)


class WanResample(nn.Module):
    """Decoder upsampler: optional temporal ×2 (`time_conv`, depth-to-time), then nearest ×2 + 3x3 conv per frame."""

    def __init__(self, dim: int, mode: str):
        super().__init__()
        if mode not in ("upsample2d", "upsample3d"):
            raise ValueError(f"unsupported resample mode {mode!r}")
        self.mode = mode
        self.resample = nn.Sequential(
            WanUpsample(scale_factor=(2.0, 2.0), mode="nearest-exact"),
            nn.Conv2d(dim, dim, 3, padding=1),  # Wan2.2 keeps the width (Wan2.1 halved it)
        )
        if mode == "upsample3d":
            self.time_conv = WanCausalConv3d(dim, dim * 2, (3, 1, 1), padding=(1, 0, 0))

    def forward(
        self, x: torch.Tensor, cache: CausalCache, first_chunk: bool, rows: RowSplit | None = None
    ) -> torch.Tensor:
        b, c, t, h, w = x.shape
        # "Rep": the first latent frame is not doubled in time, and time_conv's history starts as
        # zeros at the second chunk (frame 0 is never its history).
        if self.mode == "upsample3d" and not first_chunk:
            x = self.time_conv(x, cache)  # (B, 2C, t, H, W)
            # channels [0, C) become frame 2t, [C, 2C) frame 2t+1
            x = x.reshape(b, 2, c, t, h, w)
            x = torch.stack((x[:, 0], x[:, 1]), 3).reshape(b, c, t * 2, h, w)
            t = t * 2
        x = x.permute(0, 2, 1, 3, 4).reshape(b * t, c, h, w)
        x = self._resample_rows(x, rows)
        return x.view(b, t, x.size(1), x.size(2), x.size(3)).permute(0, 2, 1, 3, 4)

    def _resample_rows(self, x: torch.Tensor, rows: RowSplit | None) -> torch.Tensor:
        """Nearest ×2 + 3x3 conv with explicit H padding: zero rows, or under a row split the halo rows
        (swapped after the ×2: one row, not two). One process and a split run the same conv problem."""
        upsample, conv = self.resample
        x = upsample(x)
        x = F.pad(x, (0, 0, 1, 1)) if rows is None else rows.halo(x)  # (N, C, 2h + 2, 2w)
        return F.conv2d(x, conv.weight, conv.bias, padding=(0, 1))


class WanDupUp3D(nn.Module):
    """Parameter-free shortcut of the upsampling blocks: repeat channels, shuffle them into (t, h, w).

    `DupUp3D(1024, 1024, 2, 2)` is plain 2x2x2 duplication; `DupUp3D(1024, 512, 1, 2)` sends input
    channel 2c+i to row parity i of output channel c (the channel-to-row form of up_blocks.2).
    """

    def __init__(self, in_channels: int, out_channels: int, factor_t: int, factor_s: int):
        super().__init__()
        self.out_channels = out_channels
        self.factor_t = factor_t
        self.factor_s = factor_s
        self.repeats = out_channels * factor_t * factor_s**2 // in_channels

    def forward(self, x: torch.Tensor, first_chunk: bool) -> torch.Tensor:
        b, _, t, h, w = x.shape
        ft, fs = self.factor_t, self.factor_s
        x = x.repeat_interleave(self.repeats, dim=1)
        x = x.view(b, self.out_channels, ft, fs, fs, t, h, w)
        x = x.permute(0, 1, 5, 2, 6, 3, 7, 4).reshape(b, self.out_channels, t * ft, h * fs, w * fs)
        if first_chunk:
            x = x[:, :, ft - 1 :]  # the main path did not double the first frame
        return x


class WanResidualUpBlock(nn.Module):
    """`num_res_blocks + 1` residual blocks, then the upsampler, plus the `DupUp3D` shortcut of the block input."""

    def __init__(
        self, in_dim: int, out_dim: int, num_res_blocks: int, temperal_upsample: bool, up_flag: bool
    ):
        super().__init__()
        self.resnets = nn.ModuleList(
            WanResidualBlock(in_dim if i == 0 else out_dim, out_dim) for i in range(num_res_blocks + 1)
        )
        if up_flag:
            self.upsampler = WanResample(out_dim, "upsample3d" if temperal_upsample else "upsample2d")
            self.avg_shortcut = WanDupUp3D(in_dim, out_dim, 2 if temperal_upsample else 1, 2)
        else:  # the last block keeps the resolution and has no shortcut at all
            self.upsampler = None
            self.avg_shortcut = None

    def forward(
        self, x: torch.Tensor, cache: CausalCache, first_chunk: bool, rows: RowSplit | None = None
    ) -> torch.Tensor:
        x_in = x
        for resnet in self.resnets:
            x = resnet(x, cache, rows)
        if self.upsampler is not None:
            x = self.upsampler(x, cache, first_chunk, rows)
            x = x + self.avg_shortcut(x_in, first_chunk)
        return x


class WanMidBlock(nn.Module):
    """ResBlock, per-frame attention, ResBlock at the lowest resolution."""

    def __init__(self, dim: int):
        super().__init__()
        self.resnets = nn.ModuleList([WanResidualBlock(dim, dim), WanResidualBlock(dim, dim)])
        self.attentions = nn.ModuleList([WanAttentionBlock(dim)])

    def forward(self, x: torch.Tensor, cache: CausalCache, rows: RowSplit | None = None) -> torch.Tensor:
        x = self.resnets[0](x, cache, rows)
        x = self.attentions[0](x, rows)
        return self.resnets[1](x, cache, rows)


class WanDecoder3d(nn.Module):
    """conv_in → mid block → up-blocks → RMS norm, SiLU, conv_out (12 channels before unpatchify)."""

    def __init__(self, config: WanVAEConfig):
        super().__init__()
        dims = config.decoder_dims
        self.conv_in = WanCausalConv3d(config.z_dim, dims[0], 3, padding=1)
        self.mid_block = WanMidBlock(dims[0])
        n_up = len(dims) - 1
        self.up_blocks = nn.ModuleList(
            WanResidualUpBlock(
                dims[i],
                dims[i + 1],
                config.num_res_blocks,
                temperal_upsample=config.temperal_upsample[i] if i < n_up - 1 else False,
                up_flag=i < n_up - 1,
            )
            for i in range(n_up)
        )
        self.norm_out = WanRMSNorm(dims[-1], images=False)
        self.conv_out = WanCausalConv3d(dims[-1], config.out_channels, 3, padding=1)

    def forward(
        self, x: torch.Tensor, cache: CausalCache, first_chunk: bool, rows: RowSplit | None = None
    ) -> torch.Tensor:
        # x: (B, z_dim, t, h, w) -> (B, 12, t_out, 8h, 8w); with `rows`, h is this process's band
        x = self.conv_in(x, cache, rows)
        x = self.mid_block(x, cache, rows)
        for up_block in self.up_blocks:
            x = up_block(x, cache, first_chunk, rows)
        return self.conv_out(F.silu(self.norm_out(x)), cache, rows)


@contextmanager
def _ieee_fp32() -> Iterator[None]:
    """fp32 means IEEE fp32 here: PyTorch's default runs fp32 cuDNN convolutions as TF32 (10-bit mantissa)."""
    matmul = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.backends.cudnn.flags(enabled=torch.backends.cudnn.enabled, allow_tf32=False):
            yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = matmul


def unpatchify(x: torch.Tensor, patch_size: int) -> torch.Tensor:
    """(B, 3·p², T, H, W) -> (B, 3, T, p·H, p·W) with `out[c, t, p·h+q, p·w+r] = in[c·p² + r·p + q, t, h, w]`."""
    if patch_size == 1:
        return x
    b, cp, t, h, w = x.shape
    p = patch_size
    x = x.view(b, cp // (p * p), p, p, t, h, w)  # (b, c, r, q, t, h, w)
    return x.permute(0, 1, 4, 5, 3, 6, 2).reshape(b, cp // (p * p), t, h * p, w * p)


def chunk_bounds(latent_frames: int, chunk_latent_frames: int) -> list[tuple[int, int]]:
    """Latent-frame ranges of the decoder passes: `[0, 1)` first (mandatory), then chunks of the given size."""
    if not isinstance(chunk_latent_frames, int) or chunk_latent_frames < 1:
        # a run-time argument (RuntimeConfig checks the CLI's); 0 would loop forever
        raise ValueError(f"chunk_latent_frames must be a whole number ≥ 1, got {chunk_latent_frames!r}")
    bounds = [(0, 1)] if latent_frames else []
    start = 1
    while start < latent_frames:
        stop = min(start + chunk_latent_frames, latent_frames)
        bounds.append((start, stop))
        start = stop
    return bounds


class WanVAEDecoder(nn.Module):
    """The decoder half of the Wan2.2 VAE (`post_quant_conv` + `decoder`), decoding chunk by chunk.

    Args:
        config (`WanVAEConfig`): the architecture.
    """

    def __init__(self, config: WanVAEConfig):
        super().__init__()
        self.config = config
        self.post_quant_conv = WanCausalConv3d(config.z_dim, config.z_dim, 1)
        self.decoder = WanDecoder3d(config)
        for name, module in self.named_modules():
            if isinstance(module, WanCausalConv3d):
                module.cache_key = name

    @property
    def dtype(self) -> torch.dtype:
        return self.post_quant_conv.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.post_quant_conv.weight.device

    @torch.inference_mode()
    def decode_chunks(
        self,
        z: torch.Tensor,
        chunk_latent_frames: int = DEFAULT_CHUNK_LATENT_FRAMES,
        rows: RowSplit | None = None,
    ) -> Iterator[torch.Tensor]:
        """Decode un-normalised latents chunk by chunk.

        Args:
            z: `(B, z_dim, T, h, w)` latents already un-normalised (`z·std + mean`); moved to the
                model's device and dtype.
            chunk_latent_frames: latent frames per pass after the first (the output does not depend on it;
                larger chunks use more memory and give larger GEMMs).
            rows: this process's band of latent rows when several decode the video together (every
                process of `rows`' group must call this with the same `z`); None decodes whole frames.

        Yields:
            `(B, 3, f, 16h, 16w)` video chunks in [−1, 1] of the model's dtype: first 1 frame, then
            4 frames per latent frame; 1 + 4·(T − 1) frames in all. With `rows`, `h` is the band's
            latent rows (`rows.gather_rows` puts the frames together).
        """
        if z.dim() != 5 or z.shape[1] != self.config.z_dim:
            raise ValueError(
                f"expected latents of shape (B, {self.config.z_dim}, T, H, W), got {tuple(z.shape)}"
            )
        if rows is not None:
            z = rows.take(z)  # every later op keeps the row mapping: band [a, b) → [2a, 2b) at ×2
        with _ieee_fp32():
            x = self.post_quant_conv(z.to(self.device, self.dtype))
        cache: CausalCache = {}
        for start, stop in chunk_bounds(x.shape[2], chunk_latent_frames):
            with _ieee_fp32():
                out = self.decoder(x[:, :, start:stop], cache, first_chunk=start == 0, rows=rows)
            yield unpatchify(out, self.config.patch_size).clamp_(-1.0, 1.0)

    def decode_uint8_chunks(
        self,
        z: torch.Tensor,
        chunk_latent_frames: int = DEFAULT_CHUNK_LATENT_FRAMES,
        rows: RowSplit | None = None,
    ) -> Iterator[torch.Tensor]:
        """`decode_chunks` as uint8 frames `(B, f, 16h, 16w, 3)` on the decoder's device (the kernel path's signature)."""
        from pan2cli.frames import frames_to_uint8

        for video in self.decode_chunks(z, chunk_latent_frames, rows=rows):
            yield torch.stack([frames_to_uint8(v) for v in video])

    def decode(self, z: torch.Tensor, chunk_latent_frames: int = DEFAULT_CHUNK_LATENT_FRAMES) -> torch.Tensor:
        """Decode a whole video at once: `(B, 3, 1 + 4·(T − 1), 16h, 16w)`; see `decode_chunks`."""
        return torch.cat(list(self.decode_chunks(z, chunk_latent_frames)), dim=2)
