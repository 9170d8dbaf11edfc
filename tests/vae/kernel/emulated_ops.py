"""PyTorch emulations of the decode kernel's three fused ops, from their documented math (`pan2cli/vae/kernel/ops.py`),
and of the fixed-order convolution (`pan2cli/vae/kernel/conv.py`).

They stand in for the compiled ops on CPU (the kernel decoder's orchestration tests) and are the oracle of
the compiled ops' own GPU tests.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.nn.functional as F


def rms_norm_silu(x, gamma, bias, residual, sum_out, out, silu, history=None, normalize=True):
    v = x.float()
    if bias is not None:
        v = v + bias
    if residual is not None:
        v = v + residual.float()
    if bias is not None or residual is not None:
        v = v.to(torch.bfloat16).float()
        if sum_out is not None:
            sum_out.copy_(v)
    if normalize:
        y = v / v.norm(dim=-1, keepdim=True).clamp_min(1e-12) * gamma
        v = F.silu(y) if silu else y
    out.copy_(v)
    if history is not None:
        history.copy_(out[:, -2:])


def phase_interleave(phases, bias, shortcut, out, factor_t, frame_offset):
    b, t, hh, ww, c = out.shape
    p = phases.float().view(b, t, hh // 2 + 1, ww // 2 + 1, 2, 2, c)
    full = torch.empty(b, t, hh, ww, c)
    for a in (0, 1):
        for c2 in (0, 1):
            full[:, :, a::2, c2::2] = p[:, :, a : a + hh // 2, c2 : c2 + ww // 2, a, c2]
    full += bias
    if shortcut is not None:
        c_in = shortcut.shape[-1]
        repeats = c * factor_t * 4 // c_in
        for f in range(t):
            g = f + frame_offset
            src = shortcut[:, g // factor_t].float()
            for a in (0, 1):
                for c2 in (0, 1):
                    index = ((torch.arange(c) * factor_t + g % factor_t) * 2 + a) * 2 + c2
                    full[:, f, a::2, c2::2] += src[..., index // repeats]
    out.copy_(full)


def head_to_uint8(current, previous, before, bias, out):
    y = current[..., 24:]
    if previous is not None:
        y = y + previous[..., 12:24]
    if before is not None:
        y = y + before[..., :12]
    v = (y + bias).clamp(-1, 1)
    n, h, w, _ = y.shape
    video = (
        v.view(n, h, w, 3, 2, 2).permute(0, 3, 1, 5, 2, 4).reshape(n, 3, 2 * h, 2 * w)
    )  # c r q -> c (h q) (w r)
    out.copy_(torch.round((video + 1) * 127.5).clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1))


def fixed_order_conv(x, weight, bias=None, pad_w=0, tiles=None, out_dtype=torch.bfloat16):
    """`pan2cli.vae.kernel.conv.conv_channels_last`'s math in PyTorch: fp32 sums of the bf16 values, the bias
    added in fp32, one rounding to `out_dtype`; channels-last in and out (`tiles` changes no value)."""
    two_d = x.dim() == 4
    if two_d:
        x, weight = x.unsqueeze(1), weight.unsqueeze(2)
    out = F.conv3d(x.float().permute(0, 4, 1, 2, 3), weight.float(), padding=(0, 0, pad_w))
    if bias is not None:
        out = out + bias.float().view(-1, 1, 1, 1)
    out = out.permute(0, 2, 3, 4, 1).to(out_dtype).contiguous()
    return out.squeeze(1) if two_d else out


EMULATED_OPS = SimpleNamespace(
    rms_norm_silu=rms_norm_silu, phase_interleave=phase_interleave, head_to_uint8=head_to_uint8
)
