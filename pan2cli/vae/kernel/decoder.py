"""The kernel decode path: the reference decoder's function, channels-last bf16, fused bandwidth-bound ops.

Same function as `WanVAEDecoder` (docs/wan22_vae.md), organised so that the time goes to convolutions.
One job per module:

* `layout`: the weights in the kernels' layout (`KernelWeights`), made once from the reference;
* `buffers`: what a decode keeps (`FrameBuffers`): every causal conv's input buffer with its two history
  frames and halo rows, the rings of three frames of the full-resolution convs, conv_out's time
  partials; and the pending sums (`Pending`) whose bias and residual the next norm adds as it reads;
* `layers`: the fused RMS norm + SiLU kernel writing a conv's buffer, and each conv in its engine
  (`KernelLayers`);
* `resample`: the resamplers as four 2x2 phase convs and one interleave kernel (`KernelResamplers`);
* this module: the walk through the decoder's stages (`WanKernelDecoder`), as `WanDecoder3d.forward`
  walks them: conv_in, the mid block, the up-blocks, the head. At full resolution (the last up-block
  and the head) it goes one frame at a time; the head is conv_out as three fp32 time partials of one
  2-D conv per frame, then one kernel that adds them (frame f's last tap, f - 1's middle one, f - 2's
  first) and the bias, unpatchifies, clamps and rounds to uint8.

Numerics: bf16 storage, fp32 accumulation in the convolutions and fp32 math in every norm and epilogue,
one bf16 rounding per stored tensor (`layers`). Frames leave as uint8 `(B, f, 16h, 16w, 3)`.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F

from pan2cli.config import DEFAULT_CHUNK_LATENT_FRAMES
from pan2cli.vae.kernel.buffers import Pending, interior_rows
from pan2cli.vae.kernel.resample import KernelResamplers
from pan2cli.vae.model import WanVAEDecoder, chunk_bounds
from pan2cli.vae.parallel import RowSplit


class WanKernelDecoder(KernelResamplers):
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
        self.dtype = torch.bfloat16
        self.tail_frames = tail_frames
        super().__init__(reference, ops, fixed_order_convs, cutlass_convs, cutlass_config)
        self._up_blocks = self.weights.up_blocks

    # -- the stages, as `pan2cli.vae.model` has them -----------------------------------------------
    def _resblock(self, prefix: str, has_shortcut: bool, x: Pending, input_kept: bool = False) -> Pending:
        """One residual block; consumes `x` (its input is freed once the first norm has read it).

        `input_kept`: the caller keeps the block's input alive anyway (an up-block's input, its upsampler's
        shortcut), so the 1x1 shortcut conv runs after the two 3x3x3 convs rather than before: its output
        is then not alive beside conv1's input buffer, where up_blocks.2's memory peaks (113 MB at 704x1248).
        """
        gamma1, bias1 = self._w(prefix + ".norm1.gamma"), self._w(prefix + ".conv1.bias")
        if has_shortcut:
            x_in = x.take()
            h = None if input_kept else self._shortcut(prefix, x_in)
            x = Pending(x_in)
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
        return Pending(z.z, self._w(prefix + ".conv2.bias"), h)

    def _attention(self, x: Pending) -> Pending:
        x = x.take()
        # Under a row split every rank attends over the whole gathered frame (0.1 % of the decode's
        # FLOPs) and keeps its rows: the same GEMM shapes as one process, hence the same rounding.
        rows = self.buffers.rows
        frame = x if rows is None else rows.gather_rows(x, dim=2)
        b, t, h, w, c = frame.shape
        u = torch.empty_like(frame)
        self._norm_into(frame, self._w("decoder.mid_block.attentions.0.norm.gamma"), u, silu=False)
        qkv = F.linear(u.reshape(b * t, 1, h * w, c), self._w("attn.qkv.weight"), self._w("attn.qkv.bias"))
        q, k, v = qkv.chunk(3, dim=-1)
        o = F.scaled_dot_product_attention(q, k, v)
        o = F.linear(o, self._w("attn.proj.weight"), self._w("attn.proj.bias")).reshape(b, t, h, w, c)
        if rows is not None:
            o = rows.take(o.permute(0, 1, 4, 2, 3)).permute(0, 1, 3, 4, 2)  # this rank's rows
        return Pending(x.add_(o))

    def _up_block(
        self, i: int, x: Pending, first_chunk: bool, upsample: bool = True
    ) -> tuple[Pending, torch.Tensor | None]:
        """Residual blocks of up-block `i` (and its upsampler if `upsample`); consumes `x`.

        Returns the output and the block input (kept for the upsampler's DupUp3D shortcut).
        """
        shortcuts, mode = self._up_blocks[i]
        prefix = f"decoder.up_blocks.{i}"
        x_in = None
        if mode is not None:
            x_in = x.take().contiguous()
            x = Pending(x_in)
        for j, has_shortcut in enumerate(shortcuts):
            x = self._resblock(
                f"{prefix}.resnets.{j}", has_shortcut, x, input_kept=j == 0 and x_in is not None
            )
        if mode is not None and upsample:
            x = Pending(self._upsample(f"{prefix}.upsampler", mode, x, x_in, first_chunk))
        return x, x_in

    def _head(self, x: Pending) -> torch.Tensor:
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
        self._norm_into(source, gamma, interior_rows(frame), bias=x.bias, residual=x.residual)
        x.z = x.bias = x.residual = None
        del source
        self.buffers.halo(frame)
        partials = self._conv_out_partials(frame[:, 0])
        del frame
        history = self.buffers.head_partials
        previous = history[-1] if history else None
        before = history[-2] if len(history) == 2 else None
        frames = torch.empty(b, 2 * h, 2 * w, 3, dtype=torch.uint8, device=partials.device)
        self.ops.head_to_uint8(partials, previous, before, self._w("decoder.conv_out.bias"), frames)
        self.buffers.head_partials = (history + [partials])[-2:]
        return frames.view(b, 1, 2 * h, 2 * w, 3)

    # -- the walk -----------------------------------------------------------------------------------
    def _conv_in(self, x: torch.Tensor) -> Pending:
        """conv_in of the chunk's post-quant latents `(B, t, h, w, z_dim)`, its bias pending."""
        buffers = self.buffers
        buf, fresh = buffers.buffer("decoder.conv_in", x, x.shape[-1])
        buffers.interior(buf).copy_(x)
        buffers.halo(buf[:, 2:])
        y = self._conv(buf, self._w("decoder.conv_in.weight"), fresh=fresh)
        buffers.keep_history("decoder.conv_in", buf)
        del buf, x
        return Pending(y, self._w("decoder.conv_in.bias"))

    def _mid_block(self, x: Pending) -> Pending:
        x = self._resblock("decoder.mid_block.resnets.0", False, x)
        x = self._attention(x)
        return self._resblock("decoder.mid_block.resnets.1", False, x)

    def _decoder_chunk(self, x: torch.Tensor, first_chunk: bool) -> Iterator[torch.Tensor]:
        """(B, t, h, w, z_dim) post-quant latents -> uint8 frames (B, f, 16h, 16w, 3), a few frames at a time.

        The low-resolution stages (up to up_blocks.1's residual blocks) take the whole chunk; from
        up_blocks.1's upsampler on, the chunk is walked depth first. Every stage is causal per frame with
        its own history, so any such walk gives the same frames.
        """
        x = self._mid_block(self._conv_in(x))
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
                f"decoder.up_blocks.{n_up - 3}.upsampler", mode, Pending(block_out), block_in, first_chunk
            )
            del block_out, block_in
            # Each piece is owned by its pending sum only: freed as soon as up_blocks.2 has read it.
            pieces = [Pending(piece) for piece in up.split(self.tail_frames, dim=1)]
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

    def _frames_of(self, x: Pending, shortcut: list[torch.Tensor], first_chunk: bool) -> Iterator[Pending]:
        """up_blocks[-2]'s output `x`, its upsampler run (with the block input in `shortcut`, taken from the
        list), as one-frame pending inputs of the last up-block."""
        _, mode = self._up_blocks[-2]
        if mode is None:
            shortcut.clear()
            yield from (Pending(frame) for frame in x.take().split(1, dim=1))
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

    # -- public -------------------------------------------------------------------------------------
    @torch.inference_mode()
    def warm_up(self) -> None:
        """Decode a tiny latent once, so that the first real decode runs as fast as later ones.

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
        self.buffers.forget()
        self.buffers.rows = rows
        self._fixed_order_width = 2 * z.shape[-1]
        if rows is not None:
            z = rows.take(z)
        try:
            for start, stop in chunk_bounds(z.shape[2], chunk_latent_frames):
                x = self._post_quant_conv(z[:, :, start:stop])
                yield from self._decoder_chunk(x, first_chunk=start == 0)
        finally:
            self.buffers.forget()
            self.buffers.rows = None
