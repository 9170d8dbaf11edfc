"""pan2's CUDA fp8 attention (kernels/fp8_attention, pan2cli/dit/cuda_fp8_attention.py).

Without a GPU: its index math against CuTe's definitions of the wgmma fragments (a host program built with
nvcc), its compile for sm_90a (fourteen instantiations, no spills, wgmma not serialised by ptxas) and sm_100a
(empty kernels there), its extension apart from the decode kernel's, and the table that picks an
instantiation. On an H100/H200 (`gpu` marker): its output against the emulation of the fp8 attention and
float64 in every instantiation and at every tile edge (fewer tokens than a tile, one tile, partial tiles,
batches, the 121-frame token count with the table's pick), and a quantised model running it.
"""

from __future__ import annotations

import math
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from pan2cli.dit import cuda_fp8_attention as cuda
from pan2cli.dit.cuda_fp8_attention import INSTANTIATIONS, Instantiation, choose_instantiation
from pan2cli.errors import KernelBuildError
from pan2cli.vae.kernel.build import cutlass_include_dirs, kernel_spec

REPO = Path(__file__).resolve().parents[2]
SOURCES = REPO / "kernels" / "fp8_attention"
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc (no GPU needed)")
TOKENS_121_FRAMES = 26_598 + 300  # 704x1248 video tokens of 121 frames and the text of a prompt
TOKENS_481_FRAMES = 103_818 + 300


@needs_nvcc
def test_the_index_math_agrees_with_cutes_wgmma_fragments(tmp_path):
    """K's row order (`key_of_row`) makes S's accumulator fragment P's A fragment without a shuffle, byte for
    byte (`p_source`), and the tiles' swizzle is CuTe's Swizzle<3, 4, 3> (fp8_attention_layout_check.cu)."""
    includes = cutlass_include_dirs()
    if not includes:
        pytest.skip("nvidia-cutlass is not installed (CuTe's headers)")
    program = tmp_path / "layout_check"
    source = Path(__file__).with_name("fp8_attention_layout_check.cu")
    command = ["nvcc", "-std=c++17", "-x", "cu", f"-I{SOURCES}", *(f"-I{d}" for d in includes)]
    built = subprocess.run([*command, str(source), "-o", str(program)], capture_output=True, text=True)
    assert built.returncode == 0, built.stdout + built.stderr
    ran = subprocess.run([str(program)], capture_output=True, text=True)
    assert ran.returncode == 0 and ran.stdout.strip() == "ok", ran.stdout


@needs_nvcc
@pytest.mark.parametrize("arch", ["sm_90a", "sm_100a"])
def test_the_kernel_compiles_without_spills_or_serialised_wgmma(tmp_path, arch):
    """With its extension's flags (and torch's): sm_90a gets the fourteen instantiations (3-5 stages x ping-pong
    x cp.async or TMA copies with 128-key tiles, and ping-pong or not with 224-key tiles) in registers with the
    wgmma pipeline intact; sm_100a, which has no wgmma, compiles the empty kernels."""
    torch_flags = ["-D__CUDA_NO_HALF_OPERATORS__", "-D__CUDA_NO_HALF_CONVERSIONS__",
                   "-D__CUDA_NO_BFLOAT16_CONVERSIONS__", "-D__CUDA_NO_HALF2_OPERATORS__"]  # fmt: skip
    command = ["nvcc", *cuda.extension_spec(arch).cuda_flags, *torch_flags, "--resource-usage"]
    command += ["-c", str(SOURCES / "fp8_attention.cu"), "-o", str(tmp_path / "fp8_attention.o")]
    built = subprocess.run(command, capture_output=True, text=True)
    output = built.stdout + built.stderr
    assert built.returncode == 0, output[-4000:]
    entries = [line for line in output.splitlines() if "Compiling entry function" in line]
    assert len(entries) == len(INSTANTIATIONS) == 14, output[-2000:]
    assert all("fp8_attention_kernel" in e for e in entries), output[-2000:]
    if arch == "sm_90a":
        assert output.count(" 0 bytes spill stores") == 14, output[-4000:]
        for warning in ("C7510", "C7512", "C7514", "C7517"):  # wgmma serialised, or a wait injected by ptxas
            assert warning not in output, output[-4000:]


def test_the_fp8_attention_is_its_own_extension_with_its_own_sources():
    spec, decode = cuda.extension_spec(), kernel_spec("sm_90a")
    assert spec.name != decode.name and spec.build_dir != decode.build_dir
    assert {p.parent for p in spec.sources} == {SOURCES} and not spec.headers
    assert {p.name for p in spec.sources if p.suffix in (".cu", ".cpp")} == {
        "fp8_attention.cu",
        "binding.cpp",
    }
    assert not any(p.parent == SOURCES for p in decode.sources)
    assert "fp8_attention" not in (REPO / "kernels" / "wan22_vae_decode" / "binding.cpp").read_text()


def test_the_table_picks_the_fastest_measured_instantiation_for_each_gpu_and_length():
    """The rows filled from the H100 measurements (the module's comment): the wide tiles without ping-pong, the
    fastest at 121 and 481 frames, with V smoothed; other sm_90 GPUs take the H100's rows until measured; every
    row is a compiled instantiation and every GPU's rows cover any count."""
    h100 = "NVIDIA H100 80GB HBM3"
    for tokens in (100, TOKENS_121_FRAMES, TOKENS_481_FRAMES):
        assert choose_instantiation(h100, tokens) == Instantiation(3, False, "tma", 224)
        assert choose_instantiation(h100, tokens).smooth_v
    for gpu in ("NVIDIA H200", "NVIDIA GH200 480GB", "NVIDIA H800"):
        for tokens in (100, TOKENS_121_FRAMES, TOKENS_481_FRAMES):
            assert choose_instantiation(gpu, tokens) == choose_instantiation(h100, tokens)
    for rows in cuda.CHOICE_TABLE.values():
        assert rows[-1][0] is None and all(i in INSTANTIATIONS for _, i in rows)
        limits = [limit for limit, _ in rows[:-1]]
        assert limits == sorted(limits)
    assert Instantiation(3, True, "tma").v_key_order == "wgmma"
    assert Instantiation(4, True, "cp.async").v_key_order == "natural"
    assert Instantiation(3, False, "tma", 224).v_key_order == "wgmma"
    with pytest.raises(ValueError):
        Instantiation(2, True, "tma")
    for stages, producer in ((4, "tma"), (3, "cp.async")):  # wide tiles: TMA, three stages only
        with pytest.raises(ValueError, match="224-key tiles"):
            Instantiation(stages, True, producer, 224)
    with pytest.raises(ValueError):
        Instantiation(3, True, "tma", 256)
    assert Instantiation(3, True, "tma", 224).name == "s3-pingpong-tma-k224"
    assert Instantiation(3, True, "tma").name == "s3-pingpong-tma"


def test_it_runs_on_sm90_with_head_dim_128_only(monkeypatch):
    assert "head dim is 128" in cuda.why_not_runnable(torch.device("cuda"), 64)
    assert "sm_90 GPU" in cuda.why_not_runnable(torch.device("cpu"), 128)
    monkeypatch.setattr(cuda, "_loaded", [])  # not loaded in this process (on a GPU host it may be)
    with pytest.raises(KernelBuildError, match="cannot run here: it needs an sm_90 GPU"):
        cuda.extension_ops(torch.device("cpu"))


# ---------------------------------------------------------------- on a GPU
@pytest.fixture(scope="module")
def on_sm90():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    reason = cuda.why_not_runnable(torch.device("cuda"), cuda.HEAD_DIM)
    if reason is not None:
        pytest.skip(reason)
    cuda.extension_ops(torch.device("cuda"))  # built once for the module (a failed build fails here)


def _check_against_emulation_and_float64(batch, tokens, heads, instantiation, rows=None, seed=0):
    """The kernel on RMS-normed Q, K (as PAN 2's) and N(0, 9) V against the fp8 emulation (same e4m3 inputs)
    and float64 attention of the unquantised inputs, over the first `rows` query rows (all by default)."""
    from pan2cli.dit.fp8 import E4M3_MAX, FP8
    from pan2cli.dit.fp8_attention import attention_reference
    from pan2cli.dit.fp8_attention_kernel import padded_keys
    from pan2cli.dit.fp8_values_kernel import values_fp8

    gen = torch.Generator("cuda").manual_seed(seed + tokens + heads)
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
    # The wide tiles take V less its mean over the tokens (added back to the output): the emulation too.
    v_mean = torch.empty(batch, heads * 128, device="cuda") if instantiation.smooth_v else None
    values_fp8([v.reshape(batch, tokens, heads * 128)], heads, v_t, v_descale, mean=v_mean)
    v8 = v_t[..., :tokens].permute(0, 3, 1, 2).clone()
    if instantiation.tma:  # the TMA producer reads V with its keys in the wgmma order
        values_fp8(
            [v.reshape(batch, tokens, heads * 128)], heads, v_t, v_descale, key_order="wgmma", mean=v_mean
        )
    out = cuda.cuda_fp8_attention(q8, k8, v_t, qk, v_descale, instantiation=instantiation, v_mean=v_mean)
    assert out.dtype == torch.bfloat16 and out.shape == shape and torch.isfinite(out).all()
    rows = rows or tokens
    emulated = attention_reference(q8[:, :rows], k8, v8, float(qk), v_descale).double()
    if v_mean is not None:
        emulated += v_mean.double().view(batch, 1, heads, 128)
    exact = torch.nn.functional.scaled_dot_product_attention(
        *(t.double().transpose(1, 2) for t in (q[:, :rows], k, v))
    ).transpose(1, 2)
    got = out[:, :rows].double()
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(got, emulated) < 0.03  # P rounded against a running maximum there, the final one here
    assert rel(got, exact) < 0.08  # e4m3 Q, K, V and P (3 mantissa bits each)
    # Every row and head is its own: a mixed-up batch, head or tile would not be within the bound row by row.
    row_errors = (got - emulated).norm(dim=-1) / emulated.norm(dim=-1)
    assert float(row_errors.max()) < 0.1, float(row_errors.max())


@pytest.mark.gpu
@pytest.mark.parametrize("instantiation", INSTANTIATIONS, ids=[i.name for i in INSTANTIATIONS])
@pytest.mark.parametrize(
    "batch, tokens, heads",
    # under one tile (TMA boxes larger than the tensor); one tile; partial tiles; batches; 35 tiles
    [(1, 100, 2), (1, 128, 1), (1, 1000, 2), (2, 777, 3), (1, 4396, 4)],
)
def test_every_instantiation_matches_the_emulation_and_float64(on_sm90, instantiation, batch, tokens, heads):
    _check_against_emulation_and_float64(batch, tokens, heads, instantiation)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [TOKENS_121_FRAMES, 65_537], ids=["121-frames", "past-the-first-row"])
def test_the_tables_pick_at_real_lengths(on_sm90, tokens):
    """The instantiation the table picks on this GPU at the 121-frame token count (210 tiles, the last partial)
    and just past its first row's limit; 256 query rows of 2 heads checked against float64 over every key."""
    instantiation = choose_instantiation(torch.cuda.get_device_name(), tokens)
    _check_against_emulation_and_float64(1, tokens, 2, instantiation, rows=256)


@pytest.mark.gpu
@pytest.mark.parametrize("key_tile", [128, 224])
def test_the_mean_of_v_is_added_to_the_output(on_sm90, key_tile):
    """`v_mean` (V smoothed) adds each batch item's channel means to its rows, to bf16 rounding."""
    from pan2cli.dit.fp8 import FP8

    instantiation = Instantiation(3, False, "tma", key_tile)
    gen = torch.Generator("cuda").manual_seed(3)
    q8, k8 = (torch.randn(2, 300, 2, 128, generator=gen, device="cuda").to(FP8) for _ in "qk")
    v_t = torch.randn(2, 2, 128, 304, generator=gen, device="cuda").to(FP8)
    scales = torch.tensor([0.05], device="cuda"), torch.full((2,), 0.1, device="cuda")
    mean = torch.randn(2, 256, generator=gen, device="cuda") * 4
    plain = cuda.cuda_fp8_attention(q8, k8, v_t, *scales, instantiation=instantiation)
    shifted = cuda.cuda_fp8_attention(q8, k8, v_t, *scales, instantiation=instantiation, v_mean=mean)
    want = plain.double() + mean.double().view(2, 1, 2, 128)
    torch.testing.assert_close(shifted.double(), want, rtol=2**-7, atol=2**-7)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "instantiation", [i for i in INSTANTIATIONS if i.tma and i.stages == 3], ids=lambda i: i.name
)
def test_values_that_every_token_shares_in_part_at_the_121_frame_length(on_sm90, instantiation):
    """V = a part every token shares (per head and channel, 10x the rest) + N(0, 1), as AdaLN's shift gives a
    DiT's V. The wide tiles sum O across tiles in the fp8 MMA's accumulator, which loses bits as that sum grows
    with the keys; with V smoothed (its mean out before the cast, added back after) they must be as close to
    float64 as the 128-key tiles, whose per-tile sums are added in float32. 256 query rows of 2 heads."""
    from pan2cli.dit.fp8 import E4M3_MAX, FP8
    from pan2cli.dit.fp8_attention_kernel import padded_keys
    from pan2cli.dit.fp8_values_kernel import values_fp8

    tokens, heads, rows = TOKENS_121_FRAMES, 2, 256
    gen = torch.Generator("cuda").manual_seed(11)
    shape = (1, tokens, heads, 128)
    q, k = (
        torch.nn.functional.rms_norm(torch.randn(shape, generator=gen, device="cuda"), (128,)) for _ in "qk"
    )
    v = torch.randn(shape, generator=gen, device="cuda") + 10 * torch.randn(
        1, 1, heads, 128, generator=gen, device="cuda"
    )
    bound = math.sqrt(128)
    q8, k8 = ((t * (E4M3_MAX / bound)).to(FP8) for t in (q, k))
    qk = torch.tensor([(bound / E4M3_MAX) ** 2], device="cuda")
    exact = torch.nn.functional.scaled_dot_product_attention(
        *(t.double().transpose(1, 2) for t in (q[:, :rows], k, v))
    ).transpose(1, 2)

    def error(inst):
        v_t = torch.empty(1, heads, 128, padded_keys(tokens), dtype=FP8, device="cuda")
        v_descale = torch.empty(heads, device="cuda")
        v_mean = torch.empty(1, heads * 128, device="cuda") if inst.smooth_v else None
        values_fp8([v.reshape(1, tokens, -1)], heads, v_t, v_descale, key_order=inst.v_key_order, mean=v_mean)
        out = cuda.cuda_fp8_attention(q8, k8, v_t, qk, v_descale, instantiation=inst, v_mean=v_mean)
        return float((out[:, :rows].double() - exact).norm() / exact.norm())

    narrow = error(Instantiation(4, False, "tma"))
    assert narrow < 0.02, narrow
    assert error(instantiation) < 1.25 * narrow + 2e-3, (error(instantiation), narrow)


@pytest.mark.gpu
def test_a_quantised_model_runs_the_cuda_attention_like_the_triton_one(on_sm90):
    """`fp8_attention="cuda"` in a model (head dim 128): the same quantised inputs and 128-key tiles as the
    Triton kernel, so the same running maxima and P; only the MMAs' summation order differs. What ran is
    recorded: the CUDA kernel with the table's instantiation, once per block and forward."""
    from pan2cli.dit.fp8_attention_choice import fp8_attention_ran, resolve_fp8_attention, use_fp8_attention
    from pan2cli.dit.quantize import quantize_transformer
    from tests.dit.small_models import random_small_pan2

    fp8 = quantize_transformer(random_small_pan2(head_dim=128).cuda().bfloat16())
    x, t, ctx = torch.randn(1, 97, 5, 16, 16), torch.tensor([500.0]), torch.randn(1, 7, 32)  # 327 tokens
    outputs = {}
    for kernel in ("triton", "cuda"):
        use_fp8_attention(fp8, resolve_fp8_attention(kernel, torch.device("cuda"), 128))
        with torch.no_grad():
            outputs[kernel] = fp8(x.cuda(), t.cuda(), ctx.cuda()).double()
    ran = fp8_attention_ran(fp8)
    assert ran["kernel"] == "cuda" and ran["calls"] == len(fp8.transformer_blocks)
    expected = choose_instantiation(torch.cuda.get_device_name(), 327).record()
    assert ran["instantiations"] == [{**expected, "calls": len(fp8.transformer_blocks)}]
    assert torch.isfinite(outputs["cuda"]).all()
    difference = float((outputs["cuda"] - outputs["triton"]).norm() / outputs["triton"].norm())
    assert difference < 0.01, difference
