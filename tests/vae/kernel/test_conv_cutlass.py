"""The CUTLASS implicit-GEMM conv: its build (sm_90a and sm_100a compile here, no GPU), the per-layer engine
choice, and on a GPU its outputs against PyTorch's conv and its fixed summation order."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pan2cli.vae.kernel import conv
from pan2cli.vae.kernel.build import CUTLASS_CONV_TARGETS, cuda_flags, cutlass_include_dirs

REPO = Path(__file__).resolve().parents[3]
SOURCES = REPO / "kernels" / "wan22_vae_decode"


def test_cutlass_runs_layers_of_64k_channels_only():
    configs = ("128x128", "128x256p")
    assert conv.cutlass_applies(1024, 1024, configs)
    assert conv.cutlass_applies(512, 2048, configs)  # a phase conv: 4 x 512 outputs
    assert not conv.cutlass_applies(48, 1024, configs)  # conv_in: 48 latent channels
    assert not conv.cutlass_applies(256, 12, configs)  # conv_out: 12 outputs
    assert not conv.cutlass_applies(1024, 1024, ())  # a build without CUTLASS


def test_every_layer_runs_one_tile_configuration():
    """256x128 tiles in clusters of two where the build has them (sm_90a), else the build's one (sm_100a);
    never a choice by problem size. `override` picks another (benchmarks)."""
    assert conv.cutlass_config(("128x128", "128x256p")) == 1
    assert conv.cutlass_config(("128x128",)) == 0
    assert conv.cutlass_config(("128x128", "128x256p"), override="128x128") == 0
    built = ("128x128", "128x256p", "256x128p", "256x128p-1x2")
    assert built[conv.cutlass_config(built, c_out=1024)] == "256x128p-1x2"
    # a cluster of two 128-channel tiles needs an even number of them: 384 outputs take 256x128p
    assert built[conv.cutlass_config(built, c_out=384)] == "256x128p"
    assert built[conv.cutlass_config(built, c_out=192)] == "256x128p-1x2"  # two tiles, the second partial
    with pytest.raises(ValueError):
        conv.cutlass_config(("128x128", "128x256p"), override="256x256")


def test_the_build_defines_the_cutlass_conv_only_where_it_has_a_collective():
    if not cutlass_include_dirs():
        pytest.skip("nvidia-cutlass is not installed")
    assert "-DPAN2_CUTLASS_CONV=90" in cuda_flags("sm_90a")
    assert "-DPAN2_CUTLASS_CONV=100" in cuda_flags("sm_100a")
    assert not any("PAN2_CUTLASS_CONV" in f for f in cuda_flags("sm_103a"))
    # NDEBUG everywhere: a device-side assert serialises the wgmma pipeline (ptxas warning C7510).
    assert "-DNDEBUG" in cuda_flags("sm_90a")


DECODE_SOURCES = {
    ("sm_90a", "decode"): SOURCES / "conv_cutlass_256x128p_1x2.cu",
    ("sm_100a", "decode"): SOURCES / "conv_cutlass_128x128.cu",
}
# The fused-norm prototype, its own extension (`pan2cli.vae.kernel.prototypes`): kept out of CI's time budget
# (two more CUTLASS units on two cores), compiled with `pytest -m slow`.
PROTOTYPE_SOURCES = {
    ("sm_90a", "prototype"): SOURCES.parent / "experimental" / "conv_cutlass_norm_256x128p_1x2.cu",
    ("sm_90a", "prototype-rms"): SOURCES.parent / "experimental" / "rms_inv.cu",
}


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU needed)")
@pytest.mark.parametrize(
    "sources",
    [DECODE_SOURCES, pytest.param(PROTOTYPE_SOURCES, marks=pytest.mark.slow)],
    ids=["decode", "prototype"],
)
def test_cutlass_conv_compiles_for_hopper_and_blackwell_without_a_gpu(tmp_path, sources):
    """The decode's persistent conv for sm_90a (TMA + wgmma, clusters of two sharing the activation tile by
    multicast) and CUTLASS's own conv for sm_100a (tcgen05), with the build's flags: what a H100/H200 or
    B200 user's first decode compiles (both at once, about a minute on two cores); or the fused-norm
    prototype (kernels/experimental)."""
    includes = cutlass_include_dirs()
    if not includes:
        pytest.skip("nvidia-cutlass is not installed")
    # torch's cpp_extension adds these to every .cu; CUTLASS must compile under them.
    torch_flags = [
        "-D__CUDA_NO_HALF_OPERATORS__",
        "-D__CUDA_NO_HALF_CONVERSIONS__",
        "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-D__CUDA_NO_HALF2_OPERATORS__",
        "--expt-relaxed-constexpr",
    ]
    if sources is DECODE_SOURCES:
        assert {arch for arch, _ in sources} == set(CUTLASS_CONV_TARGETS)
    jobs = {}
    for (arch, role), source in sources.items():
        flags = cuda_flags(arch)
        command = ["nvcc", *flags, *torch_flags, *(f"-I{d}" for d in includes)]
        command += ["-c", str(source), "-o", str(tmp_path / f"{arch}-{role}.o")]
        command += ["--resource-usage"]  # ptxas prints each kernel's registers: proof the kernel was built
        jobs[arch, role] = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
    for (arch, role), job in jobs.items():
        output = job.communicate()[0]
        assert job.returncode == 0, f"{arch} {role}:\n{output[-4000:]}"
        kernels = [line for line in output.splitlines() if "Compiling entry function" in line]
        if role == "prototype-rms":
            assert any("rms_inv_kernel" in k for k in kernels), output[-2000:]
            continue
        assert any("persistent_conv" in k or "ConvUniversal" in k for k in kernels), (
            f"{arch}: no conv kernel:\n{output[-2000:]}"
        )
        if arch == "sm_90a":  # the activation tile's im2col load is multicast to the cluster
            assert any("TMA_LOAD_IM2COL_MULTICAST" in k for k in kernels), output[-2000:]
        if role == "prototype":
            assert any("NormSiluOperand" in k for k in kernels), output[-2000:]
        assert "spill stores" not in output or " 0 bytes spill stores" in output, output[-2000:]
        assert "C7510" not in output, f"{arch}: ptxas serialised the wgmma pipeline:\n{output[-2000:]}"


# ---------------------------------------------------------------- on a GPU
@pytest.fixture(scope="module")
def ops():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from pan2cli.vae.kernel.build import load_kernel

    loaded = load_kernel()
    if not loaded.cutlass_conv_configs:
        pytest.skip("this GPU's build has no CUTLASS conv")
    return loaded


def _inputs(shape, c_out, kernel, seed=0, bias=False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(torch.bfloat16).cuda()
    c_in = shape[-1]
    scale = (c_in * torch.tensor(kernel).prod()).sqrt()
    w = (torch.randn(c_out, c_in, *kernel, generator=gen) / scale).to(torch.bfloat16).cuda()
    w = w.contiguous(memory_format=torch.channels_last_3d if len(kernel) == 3 else torch.channels_last)
    b = torch.randn(c_out, generator=gen).cuda() if bias else None
    return x, w, b


def _reference(x, w, b, pad_w):
    """fp32 conv of the same bf16 values, channels-last out, rounded once to bf16."""
    if x.dim() == 5:
        out = F.conv3d(x.float().permute(0, 4, 1, 2, 3), w.float(), b, padding=(0, 0, pad_w))
        return out.permute(0, 2, 3, 4, 1).to(torch.bfloat16)
    out = F.conv2d(x.float().permute(0, 3, 1, 2), w.float(), b, padding=(0, pad_w))
    return out.permute(0, 2, 3, 1).to(torch.bfloat16)


CONFIGS = ["128x128", "128x256p", "256x128p", "256x128p-1x2", "256x128p-2x1", "128x256p-2x1"]


@pytest.mark.parametrize(
    "shape, c_out, kernel, pad_w, bias",
    [
        ((1, 6, 12, 20, 1024), 1024, (3, 3, 3), 1, False),  # 1024-channel causal 3x3x3 with halo rows
        ((2, 4, 9, 17, 128), 192, (3, 3, 3), 1, False),  # batch, odd sizes, N tail of a tile
        ((1, 4, 7, 9, 256), 512, (3, 1, 1), 0, True),  # the upsampler's time conv, with bias
        ((3, 10, 14, 512), 2048, (2, 2), 1, False),  # a four-phase resampler conv: frames as batch
        ((1, 1, 8, 10, 256), 256, (1, 3, 3), 1, False),  # one tap in time (the first chunk)
    ],
    ids=["3x3x3-1024", "batch-odd", "time-conv", "phase-2x2", "one-tap"],
)
@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.gpu
def test_matches_pytorch_conv(ops, shape, c_out, kernel, pad_w, bias, config):
    if config not in ops.cutlass_conv_configs:
        pytest.skip(f"{config} is not in this build")
    torch.backends.cudnn.allow_tf32 = False
    x, w, b = _inputs(shape, c_out, kernel, bias=bias)
    got = conv.conv_cutlass(ops, x, w, b, pad_w=pad_w, config=config)
    expected = _reference(x, w, b, pad_w)
    assert got.shape == expected.shape and got.dtype == torch.bfloat16
    # fp32 sums in another order, then one bf16 rounding each: at most about one bf16 ulp apart.
    err = (got.float() - expected.float()).abs().max().item()
    assert err <= 2**-7 * expected.float().abs().max().item(), err
    # and no better or worse than the Triton engine's fixed order (the previous engine)
    triton_err = (conv.conv_channels_last(x, w, b, pad_w=pad_w).float() - expected.float()).abs().max().item()
    assert err <= 2 * triton_err + 1e-6


@pytest.mark.gpu
def test_strided_frames_are_read_where_they_are(ops):
    """A conv input may be a prefix of a longer history buffer (batch stride > T x frame stride)."""
    x, w, _ = _inputs((2, 7, 10, 12, 128), 128, (3, 3, 3), seed=2)
    view = x[:, :5]
    assert not view.is_contiguous()
    assert torch.equal(
        conv.conv_cutlass(ops, view, w, None, pad_w=1),
        conv.conv_cutlass(ops, view.contiguous(), w, None, pad_w=1),
    )


@pytest.mark.gpu
@pytest.mark.parametrize("c", [1024, 256])
def test_bands_and_frame_counts_give_bit_identical_outputs(ops, c):
    """A band of rows (one rank's share) and one output frame (a shorter chunk) equal the whole problem's rows
    and frame bit for bit: the summation order is the layer's, not the problem's."""
    h, w_ = (46, 78) if c == 1024 else (90, 156)
    x, w, _ = _inputs((1, 6, h, w_, c), c, (3, 3, 3), seed=1)
    whole = conv.conv_cutlass(ops, x, w, None, pad_w=1)
    split = (h - 2) // 2
    top = conv.conv_cutlass(ops, x[:, :, : split + 2].contiguous(), w, None, pad_w=1)
    bottom = conv.conv_cutlass(ops, x[:, :, split:].contiguous(), w, None, pad_w=1)
    one_frame = conv.conv_cutlass(ops, x[:, :3].contiguous(), w, None, pad_w=1)
    assert torch.equal(top, whole[:, :, :split])
    assert torch.equal(bottom, whole[:, :, split:])
    assert torch.equal(one_frame, whole[:, :1])


@pytest.mark.gpu
@pytest.mark.parametrize("config", CONFIGS)
def test_every_tile_configuration_sums_in_the_same_order(ops, config):
    """Tiles and clusters decide which CTA computes an output, never how it is summed (64-channel steps
    in the collective's K order): every configuration gives the default's bits."""
    if config not in ops.cutlass_conv_configs:
        pytest.skip(f"{config} is not in this build")
    x, w, b = _inputs((1, 5, 20, 36, 512), 1024, (3, 3, 3), seed=3, bias=True)
    default = conv.conv_cutlass(ops, x, w, b, pad_w=1)
    assert torch.equal(conv.conv_cutlass(ops, x, w, b, pad_w=1, config=config), default)
