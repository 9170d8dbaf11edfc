"""The fused-norm conv prototype (kernels/experimental): conv(SiLU(RMS(x) · γ)) with the norm applied to the
activation tile in shared memory, against the decode's two passes (rms_norm_silu, then the conv).

Its own extension (`pan2cli.vae.kernel.prototypes`), never the decode's, another CUTLASS build that nothing
else needs, so the GPU tests run only when asked:
`PAN2_KERNEL_EXPERIMENTAL=1 python -m pytest tests/vae/kernel/test_conv_cutlass_norm.py`.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from pan2cli.vae.kernel import build, conv, prototypes

DECODE_BINDING = Path(__file__).resolve().parents[3] / "kernels" / "wan22_vae_decode" / "binding.cpp"


def test_the_prototype_is_its_own_extension_never_the_decodes(monkeypatch):
    monkeypatch.setenv("PAN2_KERNEL_EXPERIMENTAL", "1")  # the switch that once compiled it into the decode's
    decode = build.kernel_spec("sm_90a")
    assert {p.parent.name for p in decode.sources} == {"wan22_vae_decode"}
    assert not any("EXPERIMENTAL" in flag for flag in (*decode.cuda_flags, *decode.cxx_flags))
    assert (
        "conv_cutlass_norm" not in DECODE_BINDING.read_text() and "rms_inv" not in DECODE_BINDING.read_text()
    )
    prototype = prototypes.prototype_spec("sm_90a")
    assert prototype.name != decode.name and prototype.build_dir != decode.build_dir
    compiled = {p.name for p in prototype.sources if p.suffix in (".cu", ".cpp")}
    assert compiled == {"conv_cutlass_norm_256x128p_1x2.cu", "rms_inv.cu", "binding.cpp"}
    assert prototype.headers and all(p.suffix in (".h", ".cuh") for p in prototype.headers)


# ---------------------------------------------------------------- on a GPU
@pytest.fixture(scope="module")
def ops():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if os.environ.get("PAN2_KERNEL_EXPERIMENTAL", "") in ("", "0"):
        pytest.skip("the prototype is built only when asked for: PAN2_KERNEL_EXPERIMENTAL=1 runs these tests")
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the prototype is built for sm_90a only")
    decode, prototype = build.load_kernel(), prototypes.load_prototypes()
    return SimpleNamespace(
        decode=decode, rms_norm_silu=decode.rms_norm_silu,
        rms_inv=prototype.rms_inv, conv_cutlass_norm=prototype.conv_cutlass_norm,
    )  # fmt: skip


def _inputs(shape, c_out, kernel, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 3).to(torch.bfloat16).cuda()
    x[:, :, 0, 0] = 0  # a pixel of zeros: inv_rms = 1e12, and SiLU(0) stays 0
    c_in = shape[-1]
    scale = (c_in * torch.tensor(kernel).prod()).sqrt()
    w = (torch.randn(c_out, c_in, *kernel, generator=gen) / scale).to(torch.bfloat16).cuda()
    w = w.contiguous(memory_format=torch.channels_last_3d)
    gamma = (
        (1 + 0.1 * torch.randn(c_in, generator=gen)) * c_in**0.5
    ).cuda()  # γ · sqrt(C), as the decoder keeps it
    bias = torch.randn(c_out, generator=gen).cuda()
    return x, w, gamma, bias


def _fp32_reference(x, w, gamma, bias, pad_w):
    """SiLU(x / max(||x||, eps) · γ) and the conv in fp32 (TF32 off) of the same bf16 inputs."""
    xf = x.float()
    y = F.silu(xf / xf.norm(dim=-1, keepdim=True).clamp_min(1e-12) * gamma)
    out = F.conv3d(y.permute(0, 4, 1, 2, 3), w.float(), bias, padding=(0, 0, pad_w))
    return out.permute(0, 2, 3, 4, 1)


@pytest.mark.gpu
def test_rms_inv_is_the_inverse_norm_per_pixel(ops):
    x, *_ = _inputs((2, 3, 5, 7, 512), 64, (1, 1, 1))
    inv = torch.empty(x.shape[:-1], dtype=torch.float32, device="cuda")
    ops.rms_inv(x, inv)
    expected = 1 / x.float().norm(dim=-1).clamp_min(1e-12)
    torch.testing.assert_close(inv, expected, rtol=1e-5, atol=0)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape, c_out, kernel",
    [
        ((1, 4, 12, 20, 1024), 1024, (3, 3, 3)),  # a low-resolution 1024-channel layer
        ((1, 4, 9, 17, 512), 256, (3, 3, 3)),  # up3's conv1 shape class, odd sizes
        ((2, 3, 10, 18, 256), 256, (3, 3, 3)),  # batch
        ((1, 1, 8, 10, 256), 256, (1, 3, 3)),  # one tap in time (a first chunk)
    ],
    ids=["1024", "512-256-odd", "batch", "one-tap"],
)
def test_fused_norm_conv_matches_the_two_passes(ops, shape, c_out, kernel):
    torch.backends.cudnn.allow_tf32 = False
    x, w, gamma, bias = _inputs(shape, c_out, kernel)
    inv = torch.empty(x.shape[:-1], dtype=torch.float32, device="cuda")
    ops.rms_inv(x, inv)
    fused = conv._output(x, w, pad_w=1)
    ops.conv_cutlass_norm(x, inv, gamma, w, bias, fused, 1)
    normed = torch.empty_like(x)
    ops.rms_norm_silu(x, gamma, None, None, None, normed, True, None, True)
    two_pass = conv.conv_cutlass(ops.decode, normed, w, bias, pad_w=1)
    expected = _fp32_reference(x, w, gamma, bias, pad_w=1)
    scale = expected.abs().max().item()
    # the same bf16 operands up to SiLU's form (tanh.approx against exp): about one bf16 ulp apart
    assert (fused.float() - two_pass.float()).abs().max().item() <= 2**-6 * scale
    # and no less accurate than the two passes against fp32
    fused_err = (fused.float() - expected).abs().max().item()
    two_pass_err = (two_pass.float() - expected).abs().max().item()
    assert fused_err <= 1.5 * two_pass_err + 1e-6, (fused_err, two_pass_err)
