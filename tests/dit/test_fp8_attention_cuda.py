"""pan2's CUDA fp8 attention prototype (kernels/experimental/fp8_attention.cu, pan2cli/dit/cuda_fp8_attention.py).

Without a GPU: its index math against CuTe's definitions of the wgmma fragments (a host program built with
nvcc), its compile for sm_90a (no spills, wgmma not serialised by ptxas) and sm_100a (an empty kernel there),
and how `PAN2_FP8_ATTENTION` picks it. On an H100/H200 (`gpu` marker), with the experimental build
(`PAN2_KERNEL_EXPERIMENTAL=1 python -m pytest -m gpu tests/dit/test_fp8_attention_cuda.py`), its output
against the emulation of the fp8 attention and float64, in every instantiation.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pan2cli.errors import InputError, KernelBuildError
from pan2cli.vae.kernel.build import KernelSpec, cutlass_include_dirs

REPO = Path(__file__).resolve().parents[2]
EXPERIMENTAL = REPO / "kernels" / "experimental"
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU needed)")


@needs_nvcc
def test_the_index_math_agrees_with_cutes_wgmma_fragments(tmp_path):
    """K's row order (`key_of_row`) makes S's accumulator fragment P's A fragment without a shuffle, byte for
    byte (`p_source`), and the tiles' swizzle is CuTe's Swizzle<3, 4, 3> (fp8_attention_layout_check.cu)."""
    includes = cutlass_include_dirs()
    if not includes:
        pytest.skip("nvidia-cutlass is not installed (CuTe's headers)")
    program = tmp_path / "layout_check"
    source = Path(__file__).with_name("fp8_attention_layout_check.cu")
    command = ["nvcc", "-std=c++17", "-x", "cu", f"-I{EXPERIMENTAL}", *(f"-I{d}" for d in includes)]
    built = subprocess.run([*command, str(source), "-o", str(program)], capture_output=True, text=True)
    assert built.returncode == 0, built.stdout + built.stderr
    ran = subprocess.run([str(program)], capture_output=True, text=True)
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stdout


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_the_prototype_compiles_without_spills_or_serialised_wgmma(tmp_path, arch):
    """With the build's flags (and torch's): sm_90a gets the twelve instantiations (3-5 stages x ping-pong x
    cp.async or TMA copies) in registers with the wgmma pipeline intact; sm_100a, which has no wgmma, compiles
    the empty kernels."""
    torch_flags = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                   "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]  # fmt: skip
    command = ["nvcc", *KernelSpec(arch, (), "").cuda_flags, *torch_flags, "--resource-usage"]
    command += ["-c", str(EXPERIMENTAL / "fp8_attention.cu"), "-o", str(tmp_path / "fp8_attention.o")]
    built = subprocess.run(command, capture_output=True, text=True)
    output = built.stdout + built.stderr
    assert built.returncode == 0, output[-4000:]
    entries = [line for line in output.splitlines() if "Compiling entry function" in line]
    assert len(entries) == 12 and all("fp8_attention_kernel" in e for e in entries), output[-2000:]
    if arch == "sm_90a":
        assert output.count(" 0 bytes spill stores") == 12, output[-4000:]
        for warning in ("C7510", "C7514", "C7517"):  # wgmma serialised, or a wait injected by ptxas
            assert warning not in output, output[-4000:]


@pytest.mark.parametrize("value, backend", [("cuda", "cuda"), ("CUDA ", "cuda"), ("triton", "triton")])
def test_pan2_fp8_attention_picks_a_kernel_and_says_why(monkeypatch, value, backend):
    from pan2cli.dit.fp8_attention import ENV_FP8_ATTENTION, fp8_attention_backend

    monkeypatch.setenv(ENV_FP8_ATTENTION, value)
    assert fp8_attention_backend() == (backend, f"{ENV_FP8_ATTENTION}={backend}")
    monkeypatch.setenv(ENV_FP8_ATTENTION, "flash")
    with pytest.raises(InputError, match="'flash' is not an fp8 attention") as error:
        fp8_attention_backend()
    assert "cudnn, triton or cuda" in error.value.hint


def test_the_prototype_needs_the_experimental_build_and_an_sm90_gpu(monkeypatch):
    from pan2cli.dit.cuda_fp8_attention import prototype_ops

    monkeypatch.delenv("PAN2_KERNEL_EXPERIMENTAL", raising=False)
    with pytest.raises(KernelBuildError, match="experimental") as error:
        prototype_ops(torch.device("cpu"))
    assert "PAN2_KERNEL_EXPERIMENTAL=1" in error.value.hint
    monkeypatch.setenv("PAN2_KERNEL_EXPERIMENTAL", "1")
    with pytest.raises(KernelBuildError, match="sm_90"):
        prototype_ops(torch.device("cpu"))


# ---------------------------------------------------------------- on a GPU
@pytest.fixture(scope="module")
def attention():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from pan2cli.dit.cuda_fp8_attention import cuda_fp8_attention, prototype_ops

    try:
        prototype_ops(torch.device("cuda"))
    except KernelBuildError as error:
        pytest.skip(str(error))
    return cuda_fp8_attention


@pytest.mark.gpu
@pytest.mark.parametrize("tma", [False, True], ids=["cp.async", "tma"])
@pytest.mark.parametrize("stages", [3, 4, 5])
@pytest.mark.parametrize("ping_pong", [True, False], ids=["ping-pong", "free"])
@pytest.mark.parametrize(
    "batch, tokens, heads",
    # under one tile (TMA boxes larger than the tensor); one tile; partial tiles; batches; 35 tiles
    [(1, 100, 2), (1, 128, 1), (1, 1000, 2), (2, 777, 3), (1, 4396, 4)],
)
def test_cuda_fp8_attention_matches_the_emulation_and_float64(
    attention, tma, stages, ping_pong, batch, tokens, heads
):
    from pan2cli.dit.fp8 import E4M3_MAX, FP8
    from pan2cli.dit.fp8_attention import attention_reference
    from pan2cli.dit.fp8_attention_kernel import padded_keys
    from pan2cli.dit.fp8_values_kernel import values_fp8

    gen = torch.Generator("cuda").manual_seed(tokens + heads)
    shape = (batch, tokens, heads, 128)
    q, k = (
        torch.nn.functional.rms_norm(torch.randn(shape, generator=gen, device="cuda"), (128,)) for _ in "qk"
    )
    v = torch.randn(shape, generator=gen, device="cuda") * 3
    bound = math.sqrt(128)  # unit RMSNorm weights bound every element by √D
    q8, k8 = ((t * (E4M3_MAX / bound)).to(FP8) for t in (q, k))
    qk = torch.tensor([(bound / E4M3_MAX) ** 2], device="cuda")
    v_t = torch.empty(batch, heads, 128, padded_keys(tokens), dtype=FP8, device="cuda")
    v_descale = torch.empty(heads, device="cuda")
    values_fp8([v.reshape(batch, tokens, heads * 128)], heads, v_t, v_descale)
    v8 = v_t[..., :tokens].permute(0, 3, 1, 2).clone()
    if tma:  # the TMA producer reads V with its keys in the wgmma order
        values_fp8([v.reshape(batch, tokens, heads * 128)], heads, v_t, v_descale, key_order="wgmma")
    out = attention(q8, k8, v_t, qk, v_descale, stages=stages, ping_pong=ping_pong, tma=tma)
    emulated = attention_reference(q8, k8, v8, float(qk), v_descale).double()
    exact = torch.nn.functional.scaled_dot_product_attention(
        *(t.double().transpose(1, 2) for t in (q, k, v))
    ).transpose(1, 2)
    rel = lambda a, b: float((a.double() - b).norm() / b.norm())  # noqa: E731
    assert out.dtype == torch.bfloat16 and out.shape == shape and torch.isfinite(out).all()
    assert rel(out, emulated) < 0.03  # P rounded against a running maximum there, the final one here
    assert rel(out, exact) < 0.08  # e4m3 Q, K, V and P (3 mantissa bits each)
    # Every row and head is its own: a mixed-up batch, head or tile would not be within the bound row by row.
    rows = (out.double() - emulated).norm(dim=-1) / emulated.norm(dim=-1)
    assert float(rows.max()) < 0.1, float(rows.max())


@pytest.mark.gpu
def test_a_quantised_model_runs_the_cuda_attention_like_the_triton_one(attention, monkeypatch):
    """PAN2_FP8_ATTENTION=cuda in a model (head dim 128): the same quantised inputs and 128-key tiles as the
    Triton kernel, so the same running maxima and P; only the MMAs' summation order differs."""
    from pan2cli.dit.fp8_attention import ENV_FP8_ATTENTION
    from pan2cli.dit.quantize import quantize_transformer
    from tests.dit.small_models import random_small_pan2

    fp8 = quantize_transformer(random_small_pan2(head_dim=128).cuda().bfloat16())
    x, t, ctx = torch.randn(1, 97, 5, 16, 16), torch.tensor([500.0]), torch.randn(1, 7, 32)  # 327 tokens
    outputs = {}
    for backend in ("triton", "cuda"):
        monkeypatch.setenv(ENV_FP8_ATTENTION, backend)
        with torch.no_grad():
            outputs[backend] = fp8(x.cuda(), t.cuda(), ctx.cuda()).double()
    assert torch.isfinite(outputs["cuda"]).all()
    difference = float((outputs["cuda"] - outputs["triton"]).norm() / outputs["triton"].norm())
    assert difference < 0.01, difference
