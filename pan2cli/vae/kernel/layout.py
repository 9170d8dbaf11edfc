"""The reference decoder's weights laid out for the kernel decode path, and the up-blocks' structure.

Made once, when the kernel decoder is built (the reference can then be dropped): causal convs
channels-last bf16; biases and norm scales fp32; each resampler's 3x3 conv after a nearest x2
upsampling as four 2x2 phase kernels stacked into one conv of 4C output channels; the attention's
projections as GEMM matrices; conv_out as one 2-D conv by its three time taps stacked. Per frame, a
ring conv's taps rotated to its ring's slots (`ring_weight`) and a first frame's last tap alone
(`last_tap`).
"""

from __future__ import annotations

import torch

from pan2cli.vae.model import WanResample, WanVAEDecoder

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


def last_tap(weight: torch.Tensor) -> torch.Tensor:
    """A causal conv's weight `(C_out, C_in, 3, kh, kw)` cut to its last time tap (the current frame's)."""
    return weight[:, :, 2:].contiguous(memory_format=torch.channels_last_3d)


def ring_weight(weight: torch.Tensor, phase: int) -> torch.Tensor:
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


class KernelWeights:
    """A `WanVAEDecoder`'s weights in the kernel path's layout, by name, and the structure to walk.

    Names are the reference's parameter paths with the tensor's role: `<conv>.weight` / `.bias`,
    `<resampler>.phases` / `.bias`, `<norm>.gamma` (γ times the norm's scale), `attn.qkv.*` and
    `attn.proj.*`, `decoder.conv_out.partials` (and conv_out's `.bias`).

    Attributes:
        up_blocks: per up-block, whether each residual block has a shortcut conv, and the upsampler's
            mode (None without one).
    """

    def __init__(self, reference: WanVAEDecoder):
        self.up_blocks: list[tuple[list[bool], str | None]] = [
            (
                [resnet.conv_shortcut is not None for resnet in block.resnets],
                None if block.upsampler is None else block.upsampler.mode,
            )
            for block in reference.decoder.up_blocks
        ]
        self._tensors: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, module in reference.named_modules():
                if isinstance(module, torch.nn.Conv3d):
                    self._tensors[name + ".weight"] = _conv3d_weight(module.weight)
                    self._tensors[name + ".bias"] = _f32(module.bias)
                elif isinstance(module, WanResample):
                    resample_conv = module.resample[1]
                    self._tensors[name + ".phases"] = (
                        phase_weights(resample_conv.weight)
                        .to(torch.bfloat16)
                        .contiguous(memory_format=torch.channels_last)
                    )
                    self._tensors[name + ".bias"] = _f32(resample_conv.bias)
                elif hasattr(module, "gamma"):
                    self._tensors[name + ".gamma"] = _f32(module.gamma * module.scale)
            attention = reference.decoder.mid_block.attentions[0]
            c = attention.proj.weight.shape[0]
            self._tensors["attn.qkv.weight"] = (
                attention.to_qkv.weight.reshape(3 * c, c).to(torch.bfloat16).contiguous()
            )
            self._tensors["attn.qkv.bias"] = attention.to_qkv.bias.to(torch.bfloat16)
            self._tensors["attn.proj.weight"] = (
                attention.proj.weight.reshape(c, c).to(torch.bfloat16).contiguous()
            )
            self._tensors["attn.proj.bias"] = attention.proj.bias.to(torch.bfloat16)
            # conv_out as one 2-D conv by its three time taps stacked (`_conv_out_partials`): filter 12 k + n
            # is output channel n's tap k (tap 0 multiplies frame f - 2).
            conv_out = self._tensors.pop("decoder.conv_out.weight")
            self._tensors["decoder.conv_out.partials"] = torch.cat(
                [conv_out[:, :, k] for k in range(3)]
            ).contiguous(memory_format=torch.channels_last)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._tensors[name]

    def ones(self, channels: int, device: torch.device) -> torch.Tensor:
        """A `(C,)` fp32 vector of ones, made once per width: the γ of a norm kernel run without normalising."""
        key = f"ones.{channels}"
        if key not in self._tensors:
            self._tensors[key] = torch.ones(channels, dtype=torch.float32, device=device)
        return self._tensors[key]
