"""The kernel decode path's resamplers (`WanResample` with the DupUp3D shortcut of the reference).

A resampler's 3x3 conv after a nearest x2 upsampling is four 2x2 "phase" convolutions on the
low-resolution input, stacked into one conv of 4C output channels (`layout.phase_weights`); one
interleave kernel adds the bias and the DupUp3D shortcut while writing the upsampled frame.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from pan2cli.vae.kernel.buffers import Pending
from pan2cli.vae.kernel.layers import KernelLayers


class KernelResamplers(KernelLayers):
    """The resamplers, on all of a chunk's frames at once (`_upsample`) or one output frame at a time
    (`_upsample_frames`)."""

    # A resampler's stacked phase output is 4x its output frame at the input resolution (227 MB per
    # frame in up_blocks.2): the phase conv and interleave run on groups of frames below this size.
    phase_bytes_per_pass = 256 * 2**20

    def _resampler_input(
        self, prefix: str, mode: str, x: Pending, first_chunk: bool, per_frame: bool = False
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
            buf, fresh = self.buffers.buffer(key, x.z, c, halo=False)
            self._sum_into(x, buf[:, 2:])
            y = self._conv(buf, self._w(key + ".weight"), self._w(key + ".bias"), fresh=fresh)
            self.buffers.keep_history(key, buf)
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
                one = Pending(
                    x.z[:, f : f + 1], x.bias, None if x.residual is None else x.residual[:, f : f + 1]
                )
                self._sum_into(one, frame[:, :, 1:-1])
            x.z = x.bias = x.residual = None
        else:
            frames = torch.empty(b, t, h + 2, w, c, dtype=torch.bfloat16, device=x.z.device)
            self._sum_into(x, frames[:, :, 1:-1])
            inputs = [frames]
        # The 2x2 phase convs read one row above and below: halo rows as in `FrameBuffers.buffer`.
        for frames in inputs:
            self.buffers.halo(frames)
        return [frames.view(-1, h + 2, w, c) for frames in inputs], (b, t, h, w, c), factor_t

    def _upsample(
        self, prefix: str, mode: str, x: Pending, x_in: torch.Tensor, first_chunk: bool
    ) -> torch.Tensor:
        """Resampler on the block output `x` (consumed) with the DupUp3D shortcut of the block input `x_in`."""
        [frames], (b, t, h, w, c), factor_t = self._resampler_input(prefix, mode, x, first_chunk)
        out = torch.empty(b, t, 2 * h, 2 * w, c, dtype=torch.bfloat16, device=frames.device)
        frame_offset = factor_t - 1 if first_chunk else 0
        # Frames per phase conv, from the whole frame's height: a row split must not change the conv's
        # batch (cuDNN's algorithm, hence its rounding, depends on it).
        split = self.buffers.rows
        full_h = h if split is None else split.total_rows(h)
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
        self, prefix: str, mode: str, x: Pending, shortcut: list[torch.Tensor], first_chunk: bool
    ) -> Iterator[Pending]:
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
                Pending(frame) for frame in self._upsample(prefix, mode, x, x_in, first_chunk).split(1, dim=1)
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
            pending = Pending(out)
            del out  # the consumer's pending sum is the frame's only owner
            yield pending
