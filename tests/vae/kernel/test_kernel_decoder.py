"""The kernel decode path's orchestration (history buffers, pending sums, four-phase resamplers, head).

On CPU the three CUDA kernels are replaced by PyTorch emulations of their documented math, so the
Python side of the kernel path is checked against the reference decoder in CI; the GPU test runs the
compiled kernels themselves.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pan2cli.frames import frames_to_uint8
from pan2cli.testing.random_weights import random_vae_state_dict
from pan2cli.vae.config import WanVAEConfig
from pan2cli.vae.kernel.decoder import WanKernelDecoder
from pan2cli.vae.kernel.layout import phase_weights
from pan2cli.vae.model import WanVAEDecoder
from tests.vae.kernel.emulated_ops import EMULATED_OPS, fixed_order_conv

# TRITON_INTERPRET=1 without CUDA, set for each test of this module only (conftest.py).
pytestmark = pytest.mark.usefixtures("triton_interpreter_without_cuda")


def test_phase_weights_equal_upsample_then_conv():
    w = torch.randn(3, 2, 3, 3, dtype=torch.float64)
    x = torch.randn(1, 2, 4, 5, dtype=torch.float64)
    expected = F.conv2d(F.interpolate(x, scale_factor=2, mode="nearest"), w, padding=1)
    phases = F.conv2d(x, phase_weights(w).double(), padding=1)  # (1, 4·3, 5, 6)
    got = torch.empty_like(expected)
    for a in (0, 1):
        for b in (0, 1):
            k = 2 * a + b
            got[:, :, a::2, b::2] = phases[:, 3 * k : 3 * k + 3, a : a + 4, b : b + 5]
    assert (got - expected).abs().max().item() < 1e-12


@pytest.fixture(scope="module")
def reference():
    config = WanVAEConfig(base_dim=16, decoder_base_dim=16)
    state = random_vae_state_dict(config, seed=2, encoder=False)
    model = WanVAEDecoder(config)
    model.load_state_dict(state)
    return model


def _uint8(decoder, z, n: int = 2) -> torch.Tensor:
    """uint8 frames of either path, in chunks of `n` latent frames (2: more than one chunk in these short latents)."""
    if isinstance(decoder, WanKernelDecoder):
        return torch.cat([f[0].cpu() for f in decoder.decode_uint8_chunks(z, n)]).int()
    return torch.cat([frames_to_uint8(v[0]).cpu() for v in decoder.decode_chunks(z, n)]).int()


def _bf16(reference: WanVAEDecoder) -> WanVAEDecoder:
    model = WanVAEDecoder(reference.config).to(torch.bfloat16)
    model.load_state_dict(reference.state_dict())
    return model


@pytest.mark.parametrize("latent_frames", [1, 2, 5])
def test_kernel_path_is_as_accurate_as_the_bf16_reference(reference, latent_frames):
    """Against the fp32 decode, the kernel path's error is no worse than the bf16 reference's."""
    z = torch.randn(1, 48, latent_frames, 3, 5)
    truth = _uint8(reference, z)
    reference_bf16 = _uint8(_bf16(reference), z)
    kernel = _uint8(WanKernelDecoder(_bf16(reference), EMULATED_OPS), z)
    assert kernel.shape == truth.shape == (1 + 4 * (latent_frames - 1), 48, 80, 3)
    kernel_error = (kernel - truth).abs().float().mean().item()
    reference_error = (reference_bf16 - truth).abs().float().mean().item()
    assert reference_error > 0  # bf16 does round
    assert kernel_error <= 1.25 * reference_error


def test_fixed_order_convs_are_as_accurate_as_pytorch_convs(reference, monkeypatch):
    """The low-resolution convs and post_quant_conv in `pan2cli.vae.kernel.conv` (the Triton interpreter on
    CPU) give the kernel path the accuracy it has with PyTorch's convs, whatever the chunking."""
    pytest.importorskip("triton")
    from pan2cli.vae.kernel import conv

    widths, partial_widths = [], []
    original = conv.conv_channels_last

    def counting(x, weight, bias=None, pad_w=0, **options):
        fp32 = options.get("out_dtype") == torch.float32  # conv_out's time partials, at full resolution
        (partial_widths if fp32 else widths).append(x.shape[-2])
        return original(x, weight, bias, pad_w, **options)

    monkeypatch.setattr(conv, "conv_channels_last", counting)
    z = torch.randn(1, 48, 5, 3, 5, generator=torch.Generator().manual_seed(4))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    ops = EMULATED_OPS
    if device == "cuda":
        from pan2cli.vae.kernel.build import load_kernel

        ops = load_kernel()
    truth = _uint8(reference, z)
    # The Triton engine for every layer it takes (a build without CUTLASS): CUTLASS would take the
    # layers of 64k channels (tests/vae/kernel/test_conv_cutlass.py).
    fixed = WanKernelDecoder(_bf16(reference).to(device), ops, fixed_order_convs=True, cutlass_convs=False)
    got = _uint8(fixed, z.to(device), 2)
    pytorch = _uint8(
        WanKernelDecoder(_bf16(reference).to(device), ops, fixed_order_convs=False, cutlass_convs=False),
        z.to(device),
        2,
    )
    assert widths and max(widths) == 2 * z.shape[-1]  # latent and 2x-latent convs ran in the kernel, no wider
    assert set(partial_widths) == {8 * z.shape[-1]}  # and conv_out, one frame at a time
    fixed_error = (got - truth).abs().float().mean().item()
    pytorch_error = (pytorch - truth).abs().float().mean().item()
    assert fixed_error <= 1.25 * pytorch_error + 0.02
    chunk_1 = _uint8(fixed, z.to(device), 1)
    if device == "cuda":  # one summation order per layer: chunks of 1 and 2 round alike
        assert (chunk_1 - got).abs().max().item() <= 1
    else:
        # The interpreter's dot products go through numpy's BLAS and the high-resolution convs through
        # oneDNN, whose summation order depends on the CPU and the shape (3 levels apart with AVX2
        # kernels, 0 with AVX-512): only bf16-sized differences and the same accuracy are promised.
        assert (chunk_1 - got).abs().float().mean().item() <= 0.25  # measured ≤ 0.13
        assert (chunk_1 - truth).abs().float().mean().item() <= 1.1 * fixed_error + 0.02


def test_kernel_path_decodes_a_batch_as_its_videos(reference):
    """Latents of two videos decode as each video alone, as accurately (the resamplers' phase convs take the
    batch's frames together: they once took only the first video's)."""
    z = torch.randn(2, 48, 3, 2, 3, generator=torch.Generator().manual_seed(8))
    kernel = WanKernelDecoder(_bf16(reference), EMULATED_OPS)
    both = torch.cat([f.cpu() for f in kernel.decode_uint8_chunks(z, 2)], dim=1).int()
    assert both.shape == (2, 9, 32, 48, 3)
    for i in range(2):
        alone = _uint8(kernel, z[i : i + 1])
        truth = _uint8(reference, z[i : i + 1])
        # CPU convolutions sum a batch in another order than one video: bf16-sized differences (measured:
        # mean 0.21, max 2 levels), the same accuracy
        assert (both[i] - alone).abs().max().item() <= 4
        alone_error = (alone - truth).abs().float().mean().item()
        assert (both[i] - truth).abs().float().mean().item() <= 1.1 * alone_error + 0.02


def test_kernel_path_chunk_size_invariance(reference):
    z = torch.randn(1, 48, 6, 2, 3)
    kernel = WanKernelDecoder(_bf16(reference), EMULATED_OPS)
    outputs = [_uint8(kernel, z, n) for n in (1, 2, 5)]
    for tail_frames in (1, 3, 8):  # the depth-first walk of the high-resolution stages
        outputs.append(_uint8(WanKernelDecoder(_bf16(reference), EMULATED_OPS, tail_frames), z, 2))
    for out in outputs[1:]:
        assert (out - outputs[0]).abs().max().item() <= 1


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(1, 48, 1, 6, 10), (1, 48, 2, 6, 10), (1, 48, 5, 4, 6), (1, 48, 9, 3, 5)])
def test_compiled_kernels_are_as_accurate_as_the_bf16_reference(reference, shape):
    from pan2cli.vae.kernel.build import load_kernel

    z = torch.randn(shape)
    truth = _uint8(reference, z)
    gpu_bf16 = _bf16(reference).cuda()
    reference_error = (_uint8(gpu_bf16, z.cuda()) - truth).abs().float().mean().item()
    compiled = _uint8(WanKernelDecoder(gpu_bf16, load_kernel()), z.cuda())
    assert compiled.shape == truth.shape
    assert (compiled - truth).abs().float().mean().item() <= 1.25 * reference_error


@pytest.mark.gpu
@pytest.mark.parametrize("cutlass", [True, False], ids=["cutlass-convs", "triton-cudnn-convs"])
def test_compiled_kernel_chunk_size_invariance(reference, cutlass):
    from pan2cli.vae.kernel.build import load_kernel

    ops = load_kernel()
    if cutlass and not ops.cutlass_conv_configs:
        pytest.skip("this GPU's build has no CUTLASS conv")
    kernel = WanKernelDecoder(_bf16(reference).cuda(), ops, cutlass_convs=cutlass)
    z = torch.randn(1, 48, 9, 4, 6, device="cuda")
    outputs = [_uint8(kernel, z, n) for n in (1, 2, 4, 8)]
    for out in outputs[1:]:
        assert (out - outputs[0]).abs().max().item() <= 1


def _kernel_split_decode(rank: int, world: int, init_file: str, shape, out_prefix: str) -> None:
    """One rank of a split kernel-path decode (gloo, emulated kernels): its band, all-gathered."""
    import torch.distributed as dist

    from pan2cli.vae.parallel import row_split_for

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        config = WanVAEConfig(base_dim=16, decoder_base_dim=16)
        reference = WanVAEDecoder(config)
        reference.load_state_dict(random_vae_state_dict(config, seed=2, encoder=False))
        kernel = WanKernelDecoder(_bf16(reference), EMULATED_OPS)
        z = torch.randn(shape, generator=torch.Generator().manual_seed(5))
        rows = row_split_for(shape[-2])
        frames = [rows.gather_rows(f[0], dim=1) for f in kernel.decode_uint8_chunks(z, 2, rows=rows)]
        torch.save(torch.cat(frames), f"{out_prefix}{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "world, shape", [(2, (1, 48, 3, 3, 4)), (3, (1, 48, 2, 5, 3))], ids=["2ranks", "3ranks"]
)
def test_kernel_path_split_across_processes_equals_one_process(tmp_path, reference, world, shape):
    import torch.multiprocessing as mp

    z = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    expected = _uint8(WanKernelDecoder(_bf16(reference), EMULATED_OPS), z)
    truth = _uint8(reference, z)
    prefix = str(tmp_path / "rank")
    mp.spawn(
        _kernel_split_decode, args=(world, str(tmp_path / "init"), shape, prefix), nprocs=world, join=True
    )
    expected_error = (expected - truth).abs().float().mean().item()
    for rank in range(world):
        got = torch.load(f"{prefix}{rank}.pt", weights_only=True).int()
        assert got.shape == expected.shape
        # On CPU the bands' bf16 convs run through oneDNN, whose summation order depends on the CPU and
        # the band height (AVX-512: bit-identical; AVX2: half the pixels 1 level apart, at most 5). The
        # split's arithmetic is exact (float64: tests/distributed/test_distributed.py); the GPU tests hold it to
        # bit-identical frames. Here: bf16-sized differences, no error of its own (a wrong halo row
        # gives tens of levels along the band edges).
        difference = (got - expected).abs()
        assert difference.max().item() <= 8, f"rank {rank}"
        assert difference.float().mean().item() <= 1.0, f"rank {rank}"  # measured ≤ 0.6
        assert (got - truth).abs().float().mean().item() <= 1.1 * expected_error + 0.05, f"rank {rank}"


def test_both_decode_paths_are_decoders(reference):
    """`decode_latents` takes either path through the `Decoder` protocol (config, device, dtype, decode_uint8_chunks)."""
    from pan2cli.vae.protocol import Decoder

    assert isinstance(reference, Decoder)
    assert isinstance(WanKernelDecoder(_bf16(reference), EMULATED_OPS), Decoder)


def test_full_resolution_stages_in_the_fixed_order_engine(reference, monkeypatch):
    """With the fixed-order conv at every resolution (as CUTLASS runs on a GPU), the last upsampler goes
    frame by frame in two bands of rows and the last up-block through its rings: as accurate as the bf16
    reference.

    The orchestration on CPU tensors, with the conv's math in PyTorch (`fixed_order_conv`) on every host:
    Triton's mode is one per process, and on a GPU host its compiled kernels cannot read CPU tensors.
    The Triton kernel itself: `test_fixed_order_convs_are_as_accurate_as_pytorch_convs`."""
    from pan2cli.vae.kernel import conv

    frames = []
    original = WanKernelDecoder._upsample_frames

    def counting(self, *args, **kwargs):
        for frame in original(self, *args, **kwargs):
            frames.append(frame.z.shape)
            yield frame

    monkeypatch.setattr(WanKernelDecoder, "_fixed_order", lambda self, width, c_in: conv.applies(c_in))
    monkeypatch.setattr(WanKernelDecoder, "_upsample_frames", counting)
    widths = []

    def fixed_order(x, *args, **kwargs):
        widths.append(x.shape[-2])
        return fixed_order_conv(x, *args, **kwargs)

    monkeypatch.setattr(conv, "conv_channels_last", fixed_order)
    z = torch.randn(1, 48, 2, 2, 3, generator=torch.Generator().manual_seed(6))
    truth = _uint8(reference, z)
    reference_error = (_uint8(_bf16(reference), z) - truth).abs().float().mean().item()
    got = _uint8(WanKernelDecoder(_bf16(reference), EMULATED_OPS, fixed_order_convs=True), z, 1)
    assert len(frames) == got.shape[0] == 5 and all(shape[1] == 1 for shape in frames)
    assert sorted(set(widths)) == [w * z.shape[-1] for w in (1, 2, 4, 8)]  # every resolution, conv_out's too
    # measured 0.76 against a bf16 reference's 0.71 (oneDNN's fp32 sums: bf16-sized differences only)
    assert (got - truth).abs().float().mean().item() <= 1.25 * reference_error + 0.05
