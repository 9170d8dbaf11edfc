"""The kernel decode path's layers: the norm kernel that writes a conv's input buffer, and each conv in its engine.

Activations are channels-last bf16 `(B, T, H, W, C)`. Convolutions run in the fixed-order engines of
`conv.py` (CUTLASS for every layer of 64k channels where the build has it; Triton for the 48-channel
inputs and conv_out, and at low resolution where it has not) or in cuDNN through ATen on channels-last
views (the high resolutions without CUTLASS), with zero width padding implicit in the conv and explicit
halo rows (`buffers.py`). Conv biases, residual adds and the next norm are one kernel (`rms_norm_silu`
with `bias`, `residual`, `sum_out`).

Numerics: fp32 accumulation in the convolutions (the fixed-order engines, whose sums do not depend on
the problem's shape; cuDNN where they do not apply) and fp32 math in every norm, one bf16 rounding per
stored tensor (conv_out's partials are not rounded: its output's one rounding is to uint8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pan2cli.triton_support import triton_available
from pan2cli.vae.kernel import conv
from pan2cli.vae.kernel.buffers import FrameBuffers, Pending, interior_rows
from pan2cli.vae.kernel.layout import KernelWeights, last_tap, ring_weight
from pan2cli.vae.model import WanVAEDecoder


class KernelLayers:
    """The layers of the kernel decode path over a decoder's weights (`KernelWeights`) and a decode's
    buffers (`FrameBuffers`); `WanKernelDecoder` walks the stages with them (its docstring has the Args)."""

    def __init__(
        self,
        reference: WanVAEDecoder,
        ops,
        fixed_order_convs: bool | None,
        cutlass_convs: bool | None,
        cutlass_config: str | None,
    ):
        self.device = reference.device
        self.ops = ops
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
        # Copied in the kernel's layout, so the caller can drop the reference (and its copy of the weights).
        self.weights = KernelWeights(reference)
        # The full-resolution convs of the last up-block (112-225 MB per input frame) keep their input in
        # rings of three frames (`_ring_conv`); conv_out keeps the time partials of two frames (`_head`).
        up_blocks = self.weights.up_blocks
        last = f"decoder.up_blocks.{len(up_blocks) - 1}"
        self.buffers = FrameBuffers(
            {f"{last}.resnets.{j}.conv{k}" for j in range(len(up_blocks[-1][0])) for k in (1, 2)}
        )

    def _w(self, name: str) -> torch.Tensor:
        return self.weights[name]

    # -- engines --------------------------------------------------------------------------------
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

    # -- convolutions ---------------------------------------------------------------------------
    def _conv(
        self, buf: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, fresh: bool = False
    ) -> torch.Tensor:
        """Causal conv over a history buffer: (B, 2 + t, H', W, Cin) -> (B, t, H, W, Cout); bias fp32.

        With a fresh (zero) history and one frame, only the kernel's last time tap sees non-zero input:
        the conv runs with that tap alone (a third of the FLOPs; the same sum without the zero terms).
        """
        if fresh and buf.shape[1] == 3:
            buf, weight = buf[:, 2:], last_tap(weight)
        # 3x3 convs read halo rows from the buffer (padding W only); (3, 1, 1) convs need none.
        pad_w = weight.shape[4] // 2
        engine = self._engine(buf.shape[3], buf.shape[4], weight.shape[0])
        if engine != "cudnn":
            return self._fixed_order_conv(engine, buf, weight, bias, pad_w=pad_w)
        bias = None if bias is None else bias.to(torch.bfloat16)
        out = F.conv3d(buf.permute(0, 4, 1, 2, 3), weight, bias, padding=(0, 0, pad_w))
        return out.permute(0, 2, 3, 4, 1)

    def _ring_conv(
        self, key: str, ring: torch.Tensor, frame: int, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Causal conv of frame `frame`, whose input and history sit in slots frame mod 3, (frame - 1) mod 3
        and (frame - 2) mod 3 of `ring`: the three slots in memory order with the time taps rotated to
        match (`ring_weight`). Per frame one fixed summation order (by frame mod 3), whatever the
        chunking or the row split."""
        if frame == 0:  # the other slots hold zeros: only the last time tap sees input (`_conv`)
            return self._conv(ring[:, :1], last_tap(self._w(key + ".weight")), bias)
        return self._conv(ring, ring_weight(self._w(key + ".weight"), frame % 3), bias)

    def _shortcut(self, prefix: str, x: torch.Tensor) -> torch.Tensor:
        """A residual block's 1x1x1 shortcut conv (cuBLAS, bf16 bias)."""
        w = self._w(prefix + ".conv_shortcut.weight")
        bias = self._w(prefix + ".conv_shortcut.bias").to(torch.bfloat16)
        return F.linear(x, w.reshape(w.shape[0], w.shape[1]), bias)

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

    # -- norms ----------------------------------------------------------------------------------
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

    def _sum_into(self, x: Pending, out: torch.Tensor) -> None:
        """Write `x` (bias and residual added, one bf16 rounding) into `out`; `x` gives up its tensors."""
        # Without normalize the op still wants a [C] vector of γ: ones.
        gamma = self.weights.ones(x.z.shape[-1], x.z.device)
        self._norm_into(x.z, gamma, out, bias=x.bias, residual=x.residual, silu=False, normalize=False)
        x.z = x.bias = x.residual = None

    def _norm_conv(
        self,
        key: str,
        x: Pending,
        gamma: torch.Tensor,
        keep_sum: bool = True,
        bias: torch.Tensor | None = None,
    ) -> Pending:
        """SiLU(RMS(x)) written behind the history of conv `key`, then the conv; returns its output + `bias`.

        CUTLASS adds the fp32 bias before its one rounding (one rounding fewer than adding it in the next
        norm: PSNR 48.49 -> 48.61 dB on an H200); after the other engines it stays pending for the next
        norm (cuDNN's bias is bf16; the Triton engine, measured only on CPU there, is left as it was).
        `x` is consumed: with `keep_sum` the sum is stored in place of `x.z`, which stays (it is the next
        block's residual input); its other tensors are released.
        """
        buffers = self.buffers
        source = x.z
        weight = self._w(key + ".weight")
        in_epilogue = (
            bias is not None and self._engine(source.shape[3], weight.shape[1], weight.shape[0]) == "cutlass"
        )
        conv_bias, pending_bias = (bias, None) if in_epilogue else (None, bias)
        sum_out = source if keep_sum and (x.bias is not None or x.residual is not None) else None
        if key in buffers.ring_keys:
            ring, frame = buffers.ring(key, source)
            slot = ring[:, frame % 3 : frame % 3 + 1]
            self._norm_into(
                source, gamma, interior_rows(slot), bias=x.bias, residual=x.residual, sum_out=sum_out
            )
        else:
            buf, fresh = buffers.buffer(key, source, source.shape[-1])
            # The norm also writes the chunk's last two frames into the history (no copy after the conv),
            # unless the chunk has one frame or the history carries halo rows that the swap fills.
            direct = source.shape[1] >= 2 and buffers.rows is None
            history = buffers.history[key][:, :, 1:-1] if direct else None  # its halo rows stay zero
            self._norm_into(
                source,
                gamma,
                buffers.interior(buf),
                bias=x.bias,
                residual=x.residual,
                sum_out=sum_out,
                history=history,
            )
        x.bias = x.residual = None
        if not keep_sum:
            x.z = None
        del source
        if key in buffers.ring_keys:
            if buffers.rows is not None:  # without a split the ring's halo rows stay zero
                buffers.halo(slot)
            return Pending(self._ring_conv(key, ring, frame, conv_bias), pending_bias)
        buffers.halo(buf[:, 2:])
        out = self._conv(buf, weight, conv_bias, fresh=fresh)
        if not direct:
            buffers.keep_history(key, buf)
        return Pending(out, pending_bias)
