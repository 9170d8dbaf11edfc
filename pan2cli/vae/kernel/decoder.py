"""The kernel decode path: the reference decoder's function, channels-last bf16, fused bandwidth-bound ops.

Same function as `WanVAEDecoder` (docs/wan22_vae.md), organised so that the time goes to convolutions:

* activations are channels-last bf16 `(B, T, H, W, C)` end to end; convolutions run in the fixed-order
  engines of `conv.py` (CUTLASS for every layer of 64k channels where the build has it; Triton for the
  48-channel inputs and conv_out, and at low resolution where it has not) or in cuDNN through ATen on
  channels-last views (the high resolutions without CUTLASS), with zero width padding implicit in the conv
  and explicit halo rows;
* every causal conv reads one buffer `(B, 2 + t, H, W, C)` whose first two frames are its history: the
  fused RMS norm + SiLU kernel writes the chunk straight behind them (no `cat`, no `pad`); conv biases,
  residual adds and the next norm are one kernel (`rms_norm_silu` with `bias`, `residual`, `sum_out`);
* at full resolution (the last up-block and the head) the decode walks one frame at a time and each conv
  of the last up-block keeps its input in a ring of three frames: the norm writes frame f into slot f mod 3, and the conv reads
  the three slots in memory order with its time taps rotated to match (`_ring_conv`), so no history is
  ever copied (on an H200 the copies of a 5 s decode went from 0.092 to 0.039 s and the norms wrote 81 GB less);
* resamplers are four 2x2 "phase" convolutions on the low-resolution input, stacked into one conv of
  4C output channels; one interleave kernel adds the bias and the DupUp3D shortcut while writing the
  upsampled frame;
* the head is conv_out as three fp32 time partials of one 2-D conv per frame (`_head`), then one kernel that
  adds them (frame f's last tap, f - 1's middle one, f - 2's first) and the bias, unpatchifies, clamps and
  rounds to uint8.

Numerics: bf16 storage, fp32 accumulation in the convolutions (the fixed-order engines of `conv.py`,
whose sums do not depend on the problem's shape; cuDNN where they do not apply) and fp32 math in every
norm and epilogue, one bf16 rounding per stored tensor (conv_out's partials are not rounded: its output's
one rounding is to uint8). Frames leave as uint8 `(B, f, 16h, 16w, 3)`.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pan2cli.config import DEFAULT_CHUNK_LATENT_FRAMES
from pan2cli.triton_support import triton_available
from pan2cli.vae.kernel import conv
from pan2cli.vae.model import WanResample, WanVAEDecoder, chunk_bounds
from pan2cli.vae.parallel import RowSplit

# (row or column parity, tap of the 2x2 phase kernel) -> taps of the 3x3 kernel that land on it after a
# nearest x2 upsampling (wan22_vae.md §2.6).
_PHASE_TAPS = {(0, 0): (0,), (0, 1): (1, 2), (1, 0): (0, 1), (1, 1): (2,)}


def phase_weights(weight: torch.Tensor) -> torch.Tensor:
    """(C_out, C_in, 3, 3) conv after nearest x2 -> (4·C_out, C_in, 2, 2) phase kernels, phase = 2a + b.

    Summed in fp32 (float64 stays float64); the caller casts.
    """
    w = weight if weight.dtype == torch.float64 else weight.float()
    phases = []
    for a in (0, 1):
        for b in (0, 1):
            kernel = torch.zeros(w.shape[0], w.shape[1], 2, 2, dtype=w.dtype, device=w.device)
            for u in (0, 1):
                for v in (0, 1):
                    for ky in _PHASE_TAPS[(a, u)]:
                        for kx in _PHASE_TAPS[(b, v)]:
                            kernel[:, :, u, v] += w[:, :, ky, kx]
            phases.append(kernel)
    return torch.cat(phases, dim=0)


def _conv3d_weight(weight: torch.Tensor) -> torch.Tensor:
    return weight.to(torch.bfloat16).contiguous(memory_format=torch.channels_last_3d)


def _last_tap(weight: torch.Tensor) -> torch.Tensor:
    """A causal conv's weight `(C_out, C_in, 3, kh, kw)` cut to its last time tap (the current frame's)."""
    return weight[:, :, 2:].contiguous(memory_format=torch.channels_last_3d)


def _ring_weight(weight: torch.Tensor, phase: int) -> torch.Tensor:
    """A causal conv's weight `(C_out, C_in, 3, kh, kw)` for a ring of three input frames in which the current
    frame f (f mod 3 = `phase`) sits in slot f mod 3: slot s holds frame f - ((f - s) mod 3), so it takes time
    tap 2 - ((phase - s) mod 3) (tap 0 multiplies frame f - 2). Phase 2 is the weight itself."""
    if phase == 2:
        return weight
    # Slot s takes tap (s + 1 - phase) mod 3, a cyclic shift of the taps. torch.roll, not a gather by a
    # list of taps: indexing with a host list copies it to the GPU and waits for the stream (measured: the
    # GPU idled 0.17 s per 5 s decode).
    return torch.roll(weight, shifts=phase + 1, dims=2).contiguous(memory_format=torch.channels_last_3d)


def _f32(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().float().reshape(-1).contiguous()


@dataclass
class _Pending:
    """`z + bias + residual`, not yet materialised: the next norm kernel adds it as it reads.

    Also the unit of ownership between stages: a stage that consumes its input clears the fields it no
    longer needs, so a tensor is freed after its last read rather than when the caller's frame ends
    (the high-resolution activations are 112-225 MB per frame).
    """

    z: torch.Tensor | None  # (B, t, H, W, C) bf16
    bias: torch.Tensor | None = None  # (C,) fp32
    residual: torch.Tensor | None = None  # like z

    def take(self) -> torch.Tensor:
        """The materialised sum; the pending object gives up its references."""
        z = self.z
        if self.residual is not None:
            z.add_(self.residual)
        if self.bias is not None:
            z.add_(self.bias.to(z.dtype))
        self.z = self.bias = self.residual = None
        return z


class WanKernelDecoder:
    """Decode Wan2.2 latents with the compiled kernels; built from a loaded reference decoder's weights.

    Args:
        reference: a `WanVAEDecoder` on a CUDA device (any dtype; weights are re-laid out in bf16 and the
            reference is not kept).
        ops: the loaded kernel ops (`pan2cli.vae.kernel.build.load_kernel`).
        tail_frames: video frames per pass through up_blocks.2. Within a chunk the decode goes depth
            first: up_blocks.1's upsampler and up_blocks.2 walk the chunk `tail_frames` frames at a time,
            and the full-resolution stages after them (up_blocks.3, head) one frame at a time through
            their history rings, which bounds the memory of the largest activations (225 MB per frame
            at 512 x 352 x 624) without changing the output. 2 keeps the decode of 704x1248 under 5.9 GiB.
        fixed_order_convs: run the convs at the latent and 2x-latent resolutions (and post_quant_conv) in
            the fixed-order Triton kernel (`pan2cli.vae.kernel.conv`), so that chunk sizes and row splits
            round alike; cuDNN otherwise (~7 % faster on an H200, but chunk sizes and splits then differ by
            a few uint8 levels with random weights). Default: on for CUDA where Triton is installed.
            Layers that run in CUTLASS (below) are fixed-order either way.
        cutlass_convs: run every conv of 64k input and output channels in the extension's CUTLASS conv
            (fixed order at every resolution). Default: where the build has it (`ops.cutlass_conv_configs`).
        cutlass_config: one tile configuration for every CUTLASS layer instead of each layer's own
            (benchmarks; any fixed choice keeps the summation order per layer).
    """

    # A resampler's stacked phase output is 4x its output frame at the input resolution (227 MB per
    # frame in up_blocks.2): the phase conv and interleave run on groups of frames below this size.
    phase_bytes_per_pass = 256 * 2**20

    def __init__(
        self,
        reference: WanVAEDecoder,
        ops,
        tail_frames: int = 2,
        fixed_order_convs: bool | None = None,
        cutlass_convs: bool | None = None,
        cutlass_config: str | None = None,
    ):
        self.config = reference.config
        self.device = reference.device
        self.dtype = torch.bfloat16
        self.ops = ops
        self.tail_frames = tail_frames
        # On CUDA with Triton by default; elsewhere only when asked (tests, under the Triton interpreter).
        if fixed_order_convs is None:
            fixed_order_convs = self.device.type == "cuda" and triton_available()
        self.fixed_order_convs = fixed_order_convs
        configs = tuple(getattr(ops, "cutlass_conv_configs", ()))
        if cutlass_convs is False:
            configs = ()
        elif cutlass_convs and not configs:
            raise ValueError("cutlass_convs=True, but the loaded kernel build has no CUTLASS convolution")
        self._cutlass_configs = configs
        self.cutlass_config = cutlass_config
        self._fixed_order_width = 0  # set per decode: twice the latent width
        # The structure we walk; the weights are copied below in the kernel's layout, so the caller can
        # drop the reference (and its copy of the weights).
        self._up_blocks = [
            (
                [resnet.conv_shortcut is not None for resnet in block.resnets],
                None if block.upsampler is None else block.upsampler.mode,
            )
            for block in reference.decoder.up_blocks
        ]
        self._weights: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, module in reference.named_modules():
                if isinstance(module, torch.nn.Conv3d):
                    self._weights[name + ".weight"] = _conv3d_weight(module.weight)
                    self._weights[name + ".bias"] = _f32(module.bias)
                elif isinstance(module, WanResample):
                    resample_conv = module.resample[1]
                    self._weights[name + ".phases"] = (
                        phase_weights(resample_conv.weight)
                        .to(torch.bfloat16)
                        .contiguous(memory_format=torch.channels_last)
                    )
                    self._weights[name + ".bias"] = _f32(resample_conv.bias)
                elif hasattr(module, "gamma"):
                    self._weights[name + ".gamma"] = _f32(module.gamma * module.scale)
            attention = reference.decoder.mid_block.attentions[0]
            c = attention.proj.weight.shape[0]
            self._weights["attn.qkv.weight"] = (
                attention.to_qkv.weight.reshape(3 * c, c).to(torch.bfloat16).contiguous()
            )
            self._weights["attn.qkv.bias"] = attention.to_qkv.bias.to(torch.bfloat16)
            self._weights["attn.proj.weight"] = (
                attention.proj.weight.reshape(c, c).to(torch.bfloat16).contiguous()
            )
            self._weights["attn.proj.bias"] = attention.proj.bias.to(torch.bfloat16)
            # conv_out as one 2-D conv by its three time taps stacked (`_conv_out_partials`): filter 12 k + n
            # is output channel n's tap k (tap 0 multiplies frame f - 2).
            conv_out = self._weights.pop("decoder.conv_out.weight")
            self._weights["decoder.conv_out.partials"] = torch.cat(
                [conv_out[:, :, k] for k in range(3)]
            ).contiguous(memory_format=torch.channels_last)
        self._history: dict[str, torch.Tensor] = {}
        self._rows: RowSplit | None = None
        # The full-resolution convs of the last up-block (112-225 MB per input frame) keep their input in
        # rings of three frames (`_ring_conv`); conv_out keeps the time partials of two frames (`_head`).
        last = f"decoder.up_blocks.{len(self._up_blocks) - 1}"
        self._ring_keys = {
            f"{last}.resnets.{j}.conv{k}" for j in range(len(self._up_blocks[-1][0])) for k in (1, 2)
        }
        self._rings: dict[str, torch.Tensor] = {}
        self._ring_frames: dict[str, int] = {}
        self._head_partials: list[torch.Tensor] = []  # conv_out's partials of frames f - 2, f - 1

    # -- building blocks ----------------------------------------------------------------------
    def _w(self, name: str) -> torch.Tensor:
        return self._weights[name]

    def _buffer(
        self, key: str, like: torch.Tensor, channels: int, halo: bool = True
    ) -> tuple[torch.Tensor, bool]:
        """(B, 2 + t, H', W, C) conv input buffer whose first two frames hold the conv's history.

        With `halo` (every 3x3 conv), H' = h + 2: rows 0 and h + 1 hold the neighbouring ranks' rows
        under a row split and zeros otherwise, and the conv pads only W. One process and a split thus
        run the same convolution problem on different heights (`_interior` is where the rows go).
        Returns the buffer and whether the history is fresh (all zeros: the decode's first chunk).
        """
        b, t, h, w, _ = like.shape
        rows = h + 2 if halo else h
        history = self._history.get(key)
        fresh = history is None
        if fresh:
            history = torch.zeros(b, 2, rows, w, channels, dtype=torch.bfloat16, device=like.device)
            self._history[key] = history
        buf = torch.empty(b, 2 + t, rows, w, channels, dtype=torch.bfloat16, device=like.device)
        if not (fresh and t == 1):  # a one-frame first chunk skips the zero history (`_conv`)
            buf[:, :2].copy_(history)
        return buf, fresh

    @staticmethod
    def _interior_rows(frames: torch.Tensor) -> torch.Tensor:
        """`(B, t, h + 2, W, C)` frames without their halo rows."""
        return frames[:, :, 1:-1]

    def _interior(self, buf: torch.Tensor) -> torch.Tensor:
        """The chunk's frames of a conv buffer without the halo rows: where the norm writes."""
        return self._interior_rows(buf[:, 2:])

    def _halo(self, frames: torch.Tensor) -> None:
        """Fill the halo rows of `(…, h + 2, W, C)` frames: the neighbours' rows, zeros at the frame's edges."""
        if self._rows is not None:
            self._rows.fill_halo_rows(frames)
        else:
            frames[..., :: frames.shape[-3] - 1, :, :].zero_()  # rows 0 and h + 1 in one kernel

    def _keep_history(self, key: str, buf: torch.Tensor) -> None:
        history, t = self._history[key], buf.shape[1] - 2
        if t == 1:  # the buffer's history frames may not have been filled (`_buffer`): shift, then append
            history[:, :1].copy_(history[:, 1:])
            history[:, 1:].copy_(buf[:, 2:])
        else:
            history.copy_(buf[:, t : t + 2])

    def _fixed_order(self, width: int, c_in: int) -> bool:
        """Whether a conv on frames `width` wide runs in the fixed-order Triton kernel (`conv.py`) or in cuDNN
        (layers that CUTLASS runs are decided before this, `_engine`).

        The latent and 2x-latent resolutions (1024 channels): there cuDNN's algorithm, hence its rounding,
        changes with the band height and the frame count. Decided by the width, which a row split leaves
        whole, so every rank and every chunk size decide alike.
        """
        return self.fixed_order_convs and width <= self._fixed_order_width and conv.applies(c_in)

    def _engine(self, width: int, c_in: int, c_out: int) -> str:
        """ "cutlass", "triton" or "cudnn" for a conv: by channels and width only (`_fixed_order`)."""
        if conv.cutlass_applies(c_in, c_out, self._cutlass_configs):
            return "cutlass"
        return "triton" if self._fixed_order(width, c_in) else "cudnn"

    def _fixed_order_conv(self, engine: str, x, weight, bias=None, pad_w: int = 0) -> torch.Tensor:
        if engine == "cutlass":
            return conv.conv_cutlass(self.ops, x, weight, bias, pad_w=pad_w, config=self.cutlass_config)
        return conv.conv_channels_last(x, weight, bias, pad_w=pad_w)

    def _conv(
        self, buf: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, fresh: bool = False
    ) -> torch.Tensor:
        """Causal conv over a history buffer: (B, 2 + t, H', W, Cin) -> (B, t, H, W, Cout); bias fp32.

        With a fresh (zero) history and one frame, only the kernel's last time tap sees non-zero input:
        the conv runs with that tap alone (a third of the FLOPs; the same sum without the zero terms).
        """
        if fresh and buf.shape[1] == 3:
            buf, weight = buf[:, 2:], _last_tap(weight)
        # 3x3 convs read halo rows from the buffer (padding W only); (3, 1, 1) convs need none.
        pad_w = weight.shape[4] // 2
        engine = self._engine(buf.shape[3], buf.shape[4], weight.shape[0])
        if engine != "cudnn":
            return self._fixed_order_conv(engine, buf, weight, bias, pad_w=pad_w)
        bias = None if bias is None else bias.to(torch.bfloat16)
        out = F.conv3d(buf.permute(0, 4, 1, 2, 3), weight, bias, padding=(0, 0, pad_w))
        return out.permute(0, 2, 3, 4, 1)

    def _norm_into(
        self,
        x,
        gamma,
        out,
        *,
        bias=None,
        residual=None,
        sum_out=None,
        silu=True,
        history=None,
        normalize=True,
    ) -> None:
        self.ops.rms_norm_silu(x, gamma, bias, residual, sum_out, out, silu, history, normalize)

    def _sum_into(self, x: _Pending, out: torch.Tensor) -> None:
        """Write `x` (bias and residual added, one bf16 rounding) into `out`; `x` gives up its tensors."""
        c = x.z.shape[-1]
        gamma = self._weights.get(f"ones.{c}")  # unused without normalize; the op wants a [C] vector
        if gamma is None:
            gamma = self._weights[f"ones.{c}"] = torch.ones(c, dtype=torch.float32, device=x.z.device)
        self._norm_into(x.z, gamma, out, bias=x.bias, residual=x.residual, silu=False, normalize=False)
        x.z = x.bias = x.residual = None

    def _norm_conv(
        self,
        key: str,
        x: _Pending,
        gamma: torch.Tensor,
        keep_sum: bool = True,
        bias: torch.Tensor | None = None,
    ) -> _Pending:
        """SiLU(RMS(x)) written behind the history of conv `key`, then the conv; returns its output + `bias`.

        CUTLASS adds the fp32 bias before its one rounding (one rounding fewer than adding it in the next
        norm: PSNR 48.49 -> 48.61 dB on an H200); after the other engines it stays pending for the next
        norm (cuDNN's bias is bf16; the Triton engine, measured only on CPU there, is left as it was).
        `x` is consumed: with `keep_sum` the sum is stored in place of `x.z`, which stays (it is the next
        block's residual input); its other tensors are released.
        """
        source = x.z
        weight = self._w(key + ".weight")
        in_epilogue = (
            bias is not None and self._engine(source.shape[3], weight.shape[1], weight.shape[0]) == "cutlass"
        )
        conv_bias, pending_bias = (bias, None) if in_epilogue else (None, bias)
        sum_out = source if keep_sum and (x.bias is not None or x.residual is not None) else None
        if key in self._ring_keys:
            ring, frame = self._ring(key, source)
            slot = ring[:, frame % 3 : frame % 3 + 1]
            self._norm_into(
                source, gamma, self._interior_rows(slot), bias=x.bias, residual=x.residual, sum_out=sum_out
            )
        else:
            buf, fresh = self._buffer(key, source, source.shape[-1])
            # The norm also writes the chunk's last two frames into the history (no copy after the conv),
            # unless the chunk has one frame or the history carries halo rows that the swap fills.
            direct = source.shape[1] >= 2 and self._rows is None
            history = self._history[key][:, :, 1:-1] if direct else None  # its halo rows stay zero
            self._norm_into(
                source,
                gamma,
                self._interior(buf),
                bias=x.bias,
                residual=x.residual,
                sum_out=sum_out,
                history=history,
            )
        x.bias = x.residual = None
        if not keep_sum:
            x.z = None
        del source
        if key in self._ring_keys:
            if self._rows is not None:  # without a split the ring's halo rows stay zero
                self._halo(slot)
            return _Pending(self._ring_conv(key, ring, frame, conv_bias), pending_bias)
        self._halo(buf[:, 2:])
        out = self._conv(buf, weight, conv_bias, fresh=fresh)
        if not direct:
            self._keep_history(key, buf)
        return _Pending(out, pending_bias)

    def _ring(self, key: str, like: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The ring `(B, 3, h + 2, W, C)` of conv `key` (zeros at the decode's start: the history before frame
        0 and, without a split, the halo rows) and the index of the frame about to enter it."""
        b, t, h, w, c = like.shape
        if t != 1:
            raise ValueError(f"{key}: the full-resolution stages take one frame at a time, got {t}")
        ring = self._rings.get(key)
        if ring is None:
            ring = torch.zeros(b, 3, h + 2, w, c, dtype=torch.bfloat16, device=like.device)
            self._rings[key] = ring
        frame = self._ring_frames.get(key, 0)
        self._ring_frames[key] = frame + 1
        return ring, frame

    def _ring_conv(
        self, key: str, ring: torch.Tensor, frame: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal conv of frame `frame`, whose input and history sit in slots frame mod 3, (frame - 1) mod 3
        and (frame - 2) mod 3 of `ring`: the three slots in memory order with the time taps rotated to
        match (`_ring_weight`). Per frame one fixed summation order (by frame mod 3), whatever the
        chunking or the row split."""
        if frame == 0:  # the other slots hold zeros: only the last time tap sees input (`_conv`)
            return self._conv(ring[:, :1], _last_tap(self._w(key + ".weight")), bias)
        return self._conv(ring, _ring_weight(self._w(key + ".weight"), frame % 3), bias)

    def _resblock(self, prefix: str, has_shortcut: bool, x: _Pending, input_kept: bool = False) -> _Pending:
        """One residual block; consumes `x` (its input is freed once the first norm has read it).

        `input_kept`: the caller keeps the block's input alive anyway (an up-block's input, its upsampler's
        shortcut), so the 1x1 shortcut conv runs after the two 3x3x3 convs rather than before: its output
        is then not alive beside conv1's input buffer, where up_blocks.2's memory peaks (113 MB at 704x1248).
        """
        gamma1, bias1 = self._w(prefix + ".norm1.gamma"), self._w(prefix + ".conv1.bias")
        if has_shortcut:
            x_in = x.take()
            h = None if input_kept else self._shortcut(prefix, x_in)
            x = _Pending(x_in)
            if not input_kept:
                del x_in  # the norm below is its last reader: freed before conv1 runs
            y = self._norm_conv(prefix + ".conv1", x, gamma1, keep_sum=False, bias=bias1)
        else:
            y = self._norm_conv(prefix + ".conv1", x, gamma1, bias=bias1)
            h = x.z  # the materialised sum is the residual
            x.z = None
        z = self._norm_conv(prefix + ".conv2", y, self._w(prefix + ".norm2.gamma"), keep_sum=False)
        if h is None:
            h = self._shortcut(prefix, x_in)
            del x_in
        # conv2's bias joins the residual in the next norm's one rounding of the block output.
        return _Pending(z.z, self._w(prefix + ".conv2.bias"), h)

    def _shortcut(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        """A residual block's 1x1x1 shortcut conv (cuBLAS, bf16 bias)."""
        w = self._w(prefix + ".conv_shortcut.weight")
        bias = self._w(prefix + ".conv_shortcut.bias").to(torch.bfloat16)
        return F.linear(x, w.reshape(w.shape[0], w.shape[1]), bias)

    def _attention(self, x: _Pending) -> _Pending:
        x = x.take()
        # Under a row split every rank attends over the whole gathered frame (0.1 % of the decode's
        # FLOPs) and keeps its rows: the same GEMM shapes as one process, hence the same rounding.
        frame = x if self._rows is None else self._rows.gather_rows(x, dim=2)
        b, t, h, w, c = frame.shape
        u = torch.empty_like(frame)
        self._norm_into(frame, self._w("decoder.mid_block.attentions.0.norm.gamma"), u, silu=False)
        qkv = F.linear(u.reshape(b * t, 1, h * w, c), self._w("attn.qkv.weight"), self._w("attn.qkv.bias"))
        q, k, v = qkv.chunk(3, dim=-1)
        o = F.scaled_dot_product_attention(q, k, v)
        o = F.linear(o, self._w("attn.proj.weight"), self._w("attn.proj.bias")).reshape(b, t, h, w, c)
        if self._rows is not None:
            o = self._rows.take(o.permute(0, 1, 4, 2, 3)).permute(0, 1, 3, 4, 2)  # this rank's rows
        return _Pending(x.add_(o))

    def _resampler_input(
        self, prefix: str, mode: str, x: _Pending, first_chunk: bool, per_frame: bool = False
    ) -> tuple[list[torch.Tensor], tuple[int, int, int, int, int], int]:
        """The resampler's phase-conv input: the block output `x` (consumed) summed, for upsample3d through
        its time conv and depth-to-time, with halo rows, as a list of `(B·t', h + 2, w, C)` tensors (one,
        or with `per_frame` one a frame: each freed once its phase conv has read it); also (B, t, h, w, C)
        and factor_t."""
        b, t, h, w, c = x.z.shape
        factor_t = 2 if mode == "upsample3d" else 1
        if mode == "upsample3d" and not first_chunk:
            key = prefix + ".time_conv"
            # Kernel (3, 1, 1): no spatial neighbours. Fresh on the second chunk (the first skips it).
            buf, fresh = self._buffer(key, x.z, c, halo=False)
            self._sum_into(x, buf[:, 2:])
            y = self._conv(buf, self._w(key + ".weight"), self._w(key + ".bias"), fresh=fresh)
            self._keep_history(key, buf)
            del buf
            # depth-to-time: channels [0, C) -> frame 2t, [C, 2C) -> frame 2t+1; written with halo rows
            frames = torch.empty(b, 2 * t, h + 2, w, c, dtype=torch.bfloat16, device=y.device)
            interior = frames[:, :, 1:-1].view(b, t, 2, h, w, c)
            interior.copy_(y.reshape(b, t, h, w, 2, c).permute(0, 1, 4, 2, 3, 5))
            del y
            t = 2 * t
            inputs = [frames]
        elif per_frame:  # (one video: `_upsample_frames`)
            inputs = [
                torch.empty(b, 1, h + 2, w, c, dtype=torch.bfloat16, device=x.z.device) for _ in range(t)
            ]
            for f, frame in enumerate(inputs):
                one = _Pending(
                    x.z[:, f : f + 1], x.bias, None if x.residual is None else x.residual[:, f : f + 1]
                )
                self._sum_into(one, frame[:, :, 1:-1])
            x.z = x.bias = x.residual = None
        else:
            frames = torch.empty(b, t, h + 2, w, c, dtype=torch.bfloat16, device=x.z.device)
            self._sum_into(x, frames[:, :, 1:-1])
            inputs = [frames]
        # The 2x2 phase convs read one row above and below: halo rows as in `_buffer`.
        for frames in inputs:
            self._halo(frames)
        return [frames.view(-1, h + 2, w, c) for frames in inputs], (b, t, h, w, c), factor_t

    def _upsample(
        self, prefix: str, mode: str, x: _Pending, x_in: torch.Tensor, first_chunk: bool
    ) -> torch.Tensor:
        """Resampler on the block output `x` (consumed) with the DupUp3D shortcut of the block input `x_in`."""
        [frames], (b, t, h, w, c), factor_t = self._resampler_input(prefix, mode, x, first_chunk)
        out = torch.empty(b, t, 2 * h, 2 * w, c, dtype=torch.bfloat16, device=frames.device)
        frame_offset = factor_t - 1 if first_chunk else 0
        # Frames per phase conv, from the whole frame's height: a row split must not change the conv's
        # batch (cuDNN's algorithm, hence its rounding, depends on it).
        full_h = h if self._rows is None else self._rows.total_rows(h)
        group = max(1, self.phase_bytes_per_pass // ((full_h + 1) * (w + 1) * 4 * c * 2)) if b == 1 else t
        phase_weight = self._w(prefix + ".phases")
        engine = self._engine(w, c, phase_weight.shape[0])
        for f in range(0, t, group):
            # `frames` is (B·t, ...): groups of frames for one video, every frame of a batch at once (group = t)
            rows = frames[f : f + group] if b == 1 else frames
            if engine != "cudnn":
                phases = self._fixed_order_conv(engine, rows, phase_weight, pad_w=1)
            else:
                phases = F.conv2d(
                    rows.permute(0, 3, 1, 2),
                    phase_weight,
                    None,
                    padding=(0, 1),
                )
                phases = phases.permute(0, 2, 3, 1).contiguous()
            self.ops.phase_interleave(
                phases, self._w(prefix + ".bias"), x_in, out[:, f : f + group], factor_t, frame_offset + f
            )
            del phases  # before the next group's conv allocates its own
        return out

    def _upsample_frames(
        self, prefix: str, mode: str, x: _Pending, shortcut: list[torch.Tensor], first_chunk: bool
    ) -> Iterator[_Pending]:
        """`_upsample`, one output frame at a time and each made only when asked for: what waits meanwhile
        is the resampler's low-resolution input of the frames still to come, not full-resolution outputs
        (226 MB a frame at 704x1248).

        `shortcut` holds the block input (the DupUp3D shortcut); it is taken from the list, so that its
        frames can be freed as they are used. Each frame is owned by the pending sum yielded (this
        generator keeps no reference to it). Another resampler, a batch or the cuDNN engine take
        `_upsample` (all frames at once) instead.
        """
        x_in = shortcut.pop()
        b, t, _, w, c = x.z.shape
        phase_weight = self._w(prefix + ".phases")
        engine = self._engine(w, c, phase_weight.shape[0])
        if mode == "upsample3d" or b != 1 or x_in.shape[1] != t or engine == "cudnn":
            pieces = [
                _Pending(frame)
                for frame in self._upsample(prefix, mode, x, x_in, first_chunk).split(1, dim=1)
            ]
            del x_in
            while pieces:
                yield pieces.pop(0)
            return
        # upsample2d of one video: frame f from input frame f and shortcut frame f alone, in two bands of rows
        # (the fixed-order conv sums a band as it sums the whole frame): the phases of half a frame are what
        # is alive beside the frame's output, and once frame 0 is out only the shortcut frames still to
        # come are kept.
        inputs, (_, _, h, w, c), _ = self._resampler_input(prefix, mode, x, first_chunk, per_frame=True)
        later = [x_in[:, :1]]
        bands = [(0, h // 2), (h // 2, h)] if h >= 2 else [(0, h)]
        for _ in range(t):
            frame, short = inputs.pop(0), later.pop(0)
            out = torch.empty(1, 1, 2 * h, 2 * w, c, dtype=torch.bfloat16, device=frame.device)
            for r0, r1 in bands:
                phases = self._fixed_order_conv(engine, frame[:, r0 : r1 + 2], phase_weight, pad_w=1)
                self.ops.phase_interleave(
                    phases, self._w(prefix + ".bias"), short[:, :, r0:r1], out[:, :, 2 * r0 : 2 * r1], 1, 0
                )
                del phases
            del frame, short
            if x_in is not None:  # frame 0 is out: keep the shortcut's other frames apart, free the rest
                later = [x_in[:, g : g + 1].clone() for g in range(1, t)]
                x_in = None
            pending = _Pending(out)
            del out  # the consumer's pending sum is the frame's only owner
            yield pending

    def _up_block(
        self, i: int, x: _Pending, first_chunk: bool, upsample: bool = True
    ) -> tuple[_Pending, torch.Tensor | None]:
        """Residual blocks of up-block `i` (and its upsampler if `upsample`); consumes `x`.

        Returns the output and the block input (kept for the upsampler's DupUp3D shortcut).
        """
        shortcuts, mode = self._up_blocks[i]
        prefix = f"decoder.up_blocks.{i}"
        x_in = None
        if mode is not None:
            x_in = x.take().contiguous()
            x = _Pending(x_in)
        for j, has_shortcut in enumerate(shortcuts):
            x = self._resblock(
                f"{prefix}.resnets.{j}", has_shortcut, x, input_kept=j == 0 and x_in is not None
            )
        if mode is not None and upsample:
            x = _Pending(self._upsample(f"{prefix}.upsampler", mode, x, x_in, first_chunk))
        return x, x_in

    def _head(self, x: _Pending) -> torch.Tensor:
        """norm_out + SiLU, conv_out, unpatchify and uint8 of one frame (`x` is consumed): `(B, 1, 2h, 2w, 3)`.

        conv_out is causal in time; instead of convolving three frames of its 256-channel input (as a ring
        would, reading each frame three times), each frame is convolved once by the three time taps' filters
        stacked (`_conv_out_partials`: 36 fp32 partial sums a pixel), and the head kernel adds frame f's
        tap-2 partial, frame f - 1's tap-1 and frame f - 2's tap-0 (zeros before the decode's first frame)
        in fp32, then the bias, with one rounding, to uint8. What is kept between frames is two frames of
        partials (63 MB at 704x1248), not a history of inputs (226 MB). Fixed order per output, whatever the
        row split or chunk: each partial is the fixed-order engine's sum and the three are added in one order.
        """
        source = x.z
        b, t, h, w, c = source.shape
        if t != 1:
            raise ValueError(f"the head takes one frame at a time, got {t}")
        frame = torch.empty(b, 1, h + 2, w, c, dtype=torch.bfloat16, device=source.device)
        gamma = self._w("decoder.norm_out.gamma")
        self._norm_into(source, gamma, self._interior_rows(frame), bias=x.bias, residual=x.residual)
        x.z = x.bias = x.residual = None
        del source
        self._halo(frame)
        partials = self._conv_out_partials(frame[:, 0])
        del frame
        history = self._head_partials
        previous = history[-1] if history else None
        before = history[-2] if len(history) == 2 else None
        frames = torch.empty(b, 2 * h, 2 * w, 3, dtype=torch.uint8, device=partials.device)
        self.ops.head_to_uint8(partials, previous, before, self._w("decoder.conv_out.bias"), frames)
        self._head_partials = (history + [partials])[-2:]
        return frames.view(b, 1, 2 * h, 2 * w, 3)

    def _conv_out_partials(self, frame: torch.Tensor) -> torch.Tensor:
        """`(B, h + 2, W, C)` normed frame with halo rows -> `(B, h, W, 36)` fp32: its 2-D convs by conv_out's
        three time taps (channel 12 k + n: tap k of output channel n), not rounded.

        In the fixed-order Triton engine (fp32 out); without it in cuDNN (bf16, each partial rounded once)
        or, on the CPU, in fp32."""
        weight = self._w("decoder.conv_out.partials")
        if self.fixed_order_convs and conv.applies(frame.shape[-1]):
            return conv.conv_channels_last(frame, weight, pad_w=1, out_dtype=torch.float32)
        x = frame.permute(0, 3, 1, 2)
        if frame.device.type == "cpu":
            out = F.conv2d(x.float(), weight.float(), padding=(0, 1))
        else:
            out = F.conv2d(x, weight, padding=(0, 1)).float()
        return out.permute(0, 2, 3, 1).contiguous()

    def _decoder_chunk(self, x: torch.Tensor, first_chunk: bool) -> Iterator[torch.Tensor]:
        """(B, t, h, w, z_dim) post-quant latents -> uint8 frames (B, f, 16h, 16w, 3), a few frames at a time.

        The low-resolution stages (up to up_blocks.1's residual blocks) take the whole chunk; from
        up_blocks.1's upsampler on, the chunk is walked depth first. Every stage is causal per frame with
        its own history, so any such walk gives the same frames.
        """
        buf, fresh = self._buffer("decoder.conv_in", x, x.shape[-1])
        self._interior(buf).copy_(x)
        self._halo(buf[:, 2:])
        y = self._conv(buf, self._w("decoder.conv_in.weight"), fresh=fresh)
        self._keep_history("decoder.conv_in", buf)
        del buf, x
        x = _Pending(y, self._w("decoder.conv_in.bias"))
        x = self._resblock("decoder.mid_block.resnets.0", False, x)
        x = self._attention(x)
        x = self._resblock("decoder.mid_block.resnets.1", False, x)
        n_up = len(self._up_blocks)
        for i in range(n_up - 3):  # blocks before the last upsampler that doubles time
            x = self._up_block(i, x, first_chunk)[0]
        # up_blocks[-3] (up_blocks.1 in TI2V-5B): residual blocks on the chunk, upsampler per slice
        x, x_in = self._up_block(n_up - 3, x, first_chunk, upsample=False)
        x = x.take()
        _, mode = self._up_blocks[n_up - 3]
        step = max(1, self.tail_frames // 2) if mode == "upsample3d" and not first_chunk else self.tail_frames
        # Each slice (of the block output and of its input, the shortcut) a tensor of its own, freed once its
        # upsampler has read it: what waits beside up_blocks.2 is the slices still to come (at 704x1248 a
        # chunk of 4 latent frames is 8 frames of 28 MB each, in both).
        starts = range(0, x.shape[1], step)
        slices = [(x[:, a : a + step], x_in[:, a : a + step]) for a in starts]
        if len(slices) > 1:
            slices = [(block_out.clone(), block_in.clone()) for block_out, block_in in slices]
        else:
            slices = [(block_out, block_in.contiguous()) for block_out, block_in in slices]
        del x, x_in
        while slices:
            block_out, block_in = slices.pop(0)
            up = self._upsample(
                f"decoder.up_blocks.{n_up - 3}.upsampler", mode, _Pending(block_out), block_in, first_chunk
            )
            del block_out, block_in
            # Each piece is owned by its pending sum only: freed as soon as up_blocks.2 has read it.
            pieces = [_Pending(piece) for piece in up.split(self.tail_frames, dim=1)]
            del up
            while pieces:
                tail, tail_in = self._up_block(n_up - 2, pieces.pop(0), first_chunk, upsample=False)
                frames = self._frames_of(tail, [tail_in], first_chunk)
                del tail, tail_in  # the generator owns them now
                video = [  # the full-resolution stages, one frame at a time (their rings)
                    self._head(self._up_block(n_up - 1, frame, first_chunk)[0]) for frame in frames
                ]
                del frames
                yield video[0] if len(video) == 1 else torch.cat(video, dim=1)

    def _frames_of(self, x: _Pending, shortcut: list[torch.Tensor], first_chunk: bool) -> Iterator[_Pending]:
        """up_blocks[-2]'s output `x`, its upsampler run (with the block input in `shortcut`, taken from the
        list), as one-frame pending inputs of the last up-block."""
        _, mode = self._up_blocks[-2]
        if mode is None:
            shortcut.clear()
            yield from (_Pending(frame) for frame in x.take().split(1, dim=1))
            return
        prefix = f"decoder.up_blocks.{len(self._up_blocks) - 2}.upsampler"
        yield from self._upsample_frames(prefix, mode, x, shortcut, first_chunk)

    def _post_quant_conv(self, z: torch.Tensor) -> torch.Tensor:
        """Latent frames `(B, z_dim, t, h, w)` -> the decoder's channels-last bf16 input, one chunk at a time
        (a 1x1x1 conv: per chunk is the same function, and nothing of the size of the video is kept)."""
        x = z.to(self.device, torch.bfloat16).permute(0, 2, 3, 4, 1).contiguous()  # (B, t, h, w, z)
        w = self._w("post_quant_conv.weight")
        engine = self._engine(x.shape[3], x.shape[4], w.shape[0])
        if engine != "cudnn":  # the row split and chunk size must not change its GEMM
            return self._fixed_order_conv(engine, x, w, self._w("post_quant_conv.bias"))
        return F.linear(
            x, w.reshape(w.shape[0], w.shape[1]), self._w("post_quant_conv.bias").to(torch.bfloat16)
        )

    def _forget_frames(self) -> None:
        """Drop what a decode keeps between its frames: histories, rings and conv_out's partials."""
        self._history, self._rings, self._ring_frames, self._head_partials = {}, {}, {}, []

    # -- public -----------------------------------------------------------------------------
    @torch.inference_mode()
    def warm_up(self) -> None:
        """Decode a tiny latent once, so that the first real decode runs as fast as later ones (issue 14).

        It compiles (first use on a machine) or loads from Triton's cache every fixed-order conv this
        decoder launches, one kernel per layer whatever the video's size (`conv_triton`), and
        pays cuDNN's and cuBLAS's start-up in this process. Two latent frames, one per chunk: the first
        chunk's layers and the later chunks' (the temporal convs) both run. About 0.1 s when cached.
        """
        z = torch.zeros(1, self.config.z_dim, 2, 6, 10, device=self.device)
        for _ in self.decode_uint8_chunks(z, chunk_latent_frames=1):
            pass
        torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def decode_uint8_chunks(
        self,
        z: torch.Tensor,
        chunk_latent_frames: int = DEFAULT_CHUNK_LATENT_FRAMES,
        rows: RowSplit | None = None,
    ) -> Iterator[torch.Tensor]:
        """Decode un-normalised latents `(B, z_dim, T, h, w)`; yields uint8 `(B, f, 16h, 16w, 3)` on the GPU.

        With `rows` (a `pan2cli.vae.parallel.RowSplit`) this rank decodes its band of rows, exchanging
        halo rows before every 3x3 convolution and the whole frame's keys/values in the attention;
        the frames it yields are its band (`rows.gather_rows` puts them together).
        """
        self._forget_frames()
        self._rows = rows
        self._fixed_order_width = 2 * z.shape[-1]
        if rows is not None:
            z = rows.take(z)
        try:
            for start, stop in chunk_bounds(z.shape[2], chunk_latent_frames):
                x = self._post_quant_conv(z[:, :, start:stop])
                yield from self._decoder_chunk(x, first_chunk=start == 0)
        finally:
            self._forget_frames()
            self._rows = None
