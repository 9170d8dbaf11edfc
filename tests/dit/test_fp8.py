"""The fp8 tier: e4m3 quantisation math, the fp8 linear against float64, the fused fp8 kernels against their
PyTorch references (Triton's CPU interpreter without CUDA, the real kernels on a GPU), and a quantised model."""

from __future__ import annotations

import copy
import math

import pytest
import torch

triton = pytest.importorskip("triton")

from pan2cli.devices import fp8_unsupported_reason  # noqa: E402
from pan2cli.dit import fusions  # noqa: E402
from pan2cli.dit.fp8 import (  # noqa: E402
    E4M3_MAX,
    FP8,
    Fp8Activation,
    Fp8Linear,
    NonFiniteError,
    check_finite,
    qk_bound,
    quantize_rows,
    quantize_rows_reference,
    quantize_weight,
    quantize_with_scales,
    row_scales,
)
from pan2cli.dit.rope import rope_table  # noqa: E402

pytestmark = pytest.mark.usefixtures("triton_interpreter_without_cuda")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HALF_ULP = 2.0**-4  # e4m3 has 3 mantissa bits: rounding to nearest is within half of 2⁻³, relative
SUBNORMAL_STEP = 2.0**-9  # e4m3's smallest subnormal spacing (in units of the scale)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _within_rounding(dequantized: torch.Tensor, exact: torch.Tensor, scale: torch.Tensor, ulps: float = 1.0):
    """Each element within `ulps` roundings of e4m3 (relative half-ulp, or the subnormal half-step · scale)."""
    bound = ulps * torch.maximum(HALF_ULP * exact.abs(), SUBNORMAL_STEP / 2 * scale[..., None])
    return bool(((dequantized - exact).abs() <= bound * (1 + 1e-6)).all())


# -- quantisation math (CPU) ----------------------------------------------------------------------
def test_round_trip_is_within_one_rounding_and_the_row_maximum_is_exact():
    x = torch.randn(64, 96, dtype=torch.float64) * torch.logspace(-3, 3, 64, dtype=torch.float64)[:, None]
    q = quantize_rows_reference(x)
    assert q.data.dtype == FP8 and q.scale.shape == (64,)
    assert _within_rounding(q.dequantize(torch.float64), x, q.scale.double())
    # the largest magnitude of each row lands on ±448 exactly, so nothing saturates and the range is used
    assert torch.equal(q.data.float().abs().amax(dim=1), torch.full((64,), E4M3_MAX))
    assert not torch.equal(q.dequantize(torch.float64), x)


def test_values_past_the_scale_saturate_at_448_instead_of_becoming_nan():
    x = torch.tensor([[1000.0, -3000.0, 12.0, 0.5]])
    data = quantize_with_scales(x, torch.tensor([1.0]))
    assert data.float().tolist() == [[448.0, -448.0, 12.0, 0.5]]


def test_all_zero_rows_have_scale_one_and_give_the_bias():
    x = torch.zeros(3, 32)
    x[1] = torch.randn(32)
    q = quantize_rows_reference(x)
    assert q.scale[0] == 1 and q.scale[2] == 1 and torch.all(q.data[0].float() == 0)
    linear = torch.nn.Linear(32, 16)
    out = Fp8Linear.from_linear(linear)(q)
    torch.testing.assert_close(out[0], linear.bias.detach(), rtol=0, atol=0)
    torch.testing.assert_close(out[2], linear.bias.detach(), rtol=0, atol=0)


def test_nan_or_inf_activations_give_nan_rows_and_a_clear_error():
    x = torch.randn(4, 32)
    x[1, 5] = float("nan")
    x[3, 0] = float("inf")
    assert row_scales(x).isnan().tolist() == [False, True, False, True]
    out = Fp8Linear.from_linear(torch.nn.Linear(32, 8))(x)
    assert out[1].isnan().all() and out[3].isnan().all() and torch.isfinite(out[0]).all()
    with pytest.raises(NonFiniteError, match="step 3 holds NaN or Inf"):
        check_finite(out, "the latents after step 3")
    with pytest.raises(NonFiniteError, match="checkpoint is damaged"):
        quantize_weight(x)


def test_weights_get_one_scale_per_output_channel():
    weight = (
        torch.randn(48, 40, dtype=torch.float64) * torch.logspace(-2, 2, 48, dtype=torch.float64)[:, None]
    )
    data, scale = quantize_weight(weight)
    torch.testing.assert_close(scale.double(), weight.abs().amax(dim=1) / E4M3_MAX, rtol=1e-6, atol=0)
    assert _within_rounding(data.double() * scale.double()[:, None], weight, scale.double())


def test_a_weight_quantised_block_by_block_takes_each_rows_own_scale(monkeypatch):
    """A weight past `QUANTIZE_BLOCK_ELEMENTS` elements (the release's fc1/fc2, 32768x4096, is 8 blocks of 2²⁴)
    is quantised a block of rows at a time; every block must keep its own rows' scales. A block of 5 rows
    stands in for 2²⁴ elements, and the rows' magnitudes span 10⁶, so a block given another's scales
    saturates or underflows."""
    from pan2cli.dit import fp8

    monkeypatch.setattr(fp8, "QUANTIZE_BLOCK_ELEMENTS", 5 * 40)
    weight = (
        torch.randn(23, 40, dtype=torch.float64) * torch.logspace(3, -3, 23, dtype=torch.float64)[:, None]
    )
    data, scale = quantize_weight(weight)
    torch.testing.assert_close(scale.double(), weight.abs().amax(dim=1) / E4M3_MAX, rtol=1e-6, atol=0)
    assert torch.equal(data.float().abs().amax(dim=1), torch.full((23,), E4M3_MAX))
    assert _within_rounding(data.double() * scale.double()[:, None], weight, scale.double())


@pytest.mark.gpu
def test_gpu_the_largest_release_weight_quantises_every_row_with_its_own_scale():
    """fc1/fc2's shape in the release, 32768x4096 (8 blocks of 2²⁴ elements), on the GPU where it is quantised
    at load: every row's scale its own maximum / 448, every value within one rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator("cuda").manual_seed(9)
    rows = torch.logspace(-2, 2, 32768, device="cuda")[torch.randperm(32768, generator=gen, device="cuda")]
    weight = (torch.randn(32768, 4096, generator=gen, device="cuda") * rows[:, None]).bfloat16()
    data, scale = quantize_weight(weight)
    for start in range(0, 32768, 4096):  # float64 checks a slice at a time (1 GiB for the whole weight)
        part = weight[start : start + 4096].double()
        part_scale = scale[start : start + 4096].double()
        torch.testing.assert_close(part_scale, part.abs().amax(dim=1) / E4M3_MAX, rtol=1e-6, atol=0)
        dequantized = data[start : start + 4096].double() * part_scale[:, None]
        assert _within_rounding(dequantized, part, part_scale), start


def test_fp8_linear_is_within_the_e4m3_bound_of_a_float64_product():
    """|y − y₆₄| ≤ (2·2⁻⁴ + 2⁻⁸)·Σ|x·w| (+ subnormal steps and float32 accumulation) per element."""
    gen = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(256, 64, dtype=torch.float64)
    with torch.no_grad():
        linear.weight.normal_(0, 256**-0.5, generator=gen)
        linear.bias.normal_(0, 1, generator=gen)
    x = torch.randn(32, 256, generator=gen, dtype=torch.float64) * 3
    got = Fp8Linear.from_linear(linear)(x)
    want = linear(x)
    magnitude = x.abs() @ linear.weight.abs().t()
    bound = (2 * HALF_ULP + HALF_ULP**2) * magnitude + 256 * 2.0**-24 * magnitude + 1e-6
    assert ((got - want).abs() <= bound).all()
    error = ((got - want).norm() / want.norm()).item()
    assert 1e-4 < error < 0.05, error  # lossy, but by e4m3's rounding only


def test_the_unscaled_product_scaled_afterwards_is_the_fp8_linear():
    """`Fp8Linear.product` (fc2's GEMM with unit scales): raw · row scale · column scale + bias gives `forward`'s
    output, on the CPU's emulation; its row and column scales are the activation's and the weight's."""
    gen = torch.Generator().manual_seed(1)
    linear = torch.nn.Linear(256, 64)
    with torch.no_grad():
        linear.weight.normal_(0, 256**-0.5, generator=gen)
        linear.bias.normal_(0, 1, generator=gen)
    fp8 = Fp8Linear.from_linear(linear)
    x = quantize_rows_reference(torch.randn(3, 5, 256, generator=gen) * torch.logspace(-2, 2, 5)[:, None])
    product = fp8.product(x)
    assert product.raw.shape == (3, 5, 64) and product.row_scale is x.scale
    assert product.col_scale is fp8.weight_scale and product.bias is fp8.bias
    torch.testing.assert_close(product.dequantize(), fp8(x), rtol=1e-4, atol=1e-4)  # float32 sums


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_the_unscaled_product_through_the_gated_residual_is_the_scaled_gemm():
    """On the GPU: fc2's unit-scale GEMM scaled by the fused gated residual against `_scaled_mm` with its row and
    column scales and bias, then the same residual, at a shape of the release's fc2 (K = 32768)."""
    gen = torch.Generator(device="cuda").manual_seed(2)
    linear = torch.nn.Linear(32768, 4096, device="cuda").bfloat16()
    with torch.no_grad():
        linear.weight.normal_(0, 32768**-0.5, generator=gen)
        linear.bias.normal_(0, 1, generator=gen)
    fp8 = Fp8Linear.from_linear(linear)
    x = quantize_rows(torch.randn(1, 2048, 32768, generator=gen, device="cuda").bfloat16(), fused=True)
    residual = torch.randn(1, 2048, 4096, generator=gen, device="cuda").bfloat16()
    gate = torch.randn(1, 1, 4096, generator=gen, device="cuda")
    got = fusions.gated_residual(residual, fp8.product(x), gate, fused=True)
    want = fusions.gated_residual(residual, fp8(x), gate, fused=True)
    exact = residual.double() + gate.double() * fp8.product(x).dequantize(torch.float64)
    for out in (got, want):  # each within a few bf16 roundings of the float64 of the same GEMM
        assert ((out.double() - exact).norm() / exact.norm()).item() < 4e-3
    assert ((got.double() - want.double()).norm() / want.double().norm()).item() < 4e-3


def test_qk_bound_bounds_every_normalised_and_rotated_element():
    head_dim = 64
    weight = torch.rand(head_dim) * 2 + 0.1
    x = torch.randn(500, 2, head_dim) * torch.logspace(-4, 4, 500)[:, None, None]
    x[0, 0] = 0
    x[1, 0, weight.argmax()] = 1e6  # the largest weight's channel carrying the whole row: the worst case
    cos, sin = rope_table((1, 20, 25), (16, 24, 24), 256.0, 16 / 24)
    q, _ = fusions.qk_norm_rope(x, x, weight, weight, cos, sin, eps=1e-6, fused=False)
    assert q.abs().max() <= qk_bound(head_dim, weight) * (1 + 1e-6)
    assert q.abs().max() > 0.5 * qk_bound(head_dim, weight)


def test_fp8_is_refused_on_the_cpu_with_the_reason():
    assert "CUDA GPU" in fp8_unsupported_reason("cpu")


# -- the fused kernels against their references ----------------------------------------------------
@pytest.mark.parametrize("batch, tokens, dim, groups", [(1, 37, 256, 1), (2, 24, 96, 3)])
def test_layer_norm_modulate_quantises_like_its_reference(batch, tokens, dim, groups):
    gen = _gen(1)
    x = (torch.randn(batch, tokens, dim, generator=gen, device=DEVICE) * 4 + 1).bfloat16()
    scale = torch.randn(batch, groups, dim, generator=gen, device=DEVICE) * 0.3
    shift = torch.randn(batch, groups, dim, generator=gen, device=DEVICE)
    got = fusions.layer_norm_modulate(x, scale, shift, eps=1e-6, fused=True, quantize=True)
    exact = fusions.layer_norm_modulate_reference(x.float(), scale, shift, eps=1e-6).double()
    assert got.data.dtype == FP8 and got.scale.shape == (batch, tokens)
    torch.testing.assert_close(got.scale.double(), row_scales(exact).double(), rtol=1e-5, atol=0)
    assert _within_rounding(got.dequantize(torch.float64), exact, got.scale.double(), ulps=1.01)


@pytest.mark.parametrize("width", [96, 4096])
def test_gelu_quantise_matches_gelu_then_quantise(width):
    gen = _gen(2)
    x = (torch.randn(5, 3, width, generator=gen, device=DEVICE) * 2).bfloat16()
    x[0, 1] = 0  # an all-zero row: GELU(0) = 0, scale 1
    got = quantize_rows(x, fused=True, gelu=True)
    exact = torch.nn.functional.gelu(x.double(), approximate="tanh")
    assert got.scale[0, 1] == 1 and torch.all(got.data[0, 1].float() == 0)
    torch.testing.assert_close(got.scale.double(), row_scales(exact).double(), rtol=1e-5, atol=0)
    assert _within_rounding(got.dequantize(torch.float64), exact, got.scale.double(), ulps=1.01)


def test_gelu_quantise_takes_the_scale_from_the_negative_side_where_it_dominates():
    # The kernel takes a row's scale from GELU(max x) unless that is below GELU's negative extreme (0.17):
    # rows whose largest magnitude comes from negative x must still get the exact maximum.
    x = torch.full((6, 3000), -0.7518, device=DEVICE)  # GELU's minimum, -0.16997, everywhere
    x[1] = -5.0 + torch.linspace(0, 4, 3000, device=DEVICE)  # all negative, the extreme missing
    x[2, :10] = 0.3  # a small positive max whose GELU (0.186) beats the negative side
    x[3, :10] = 0.25  # GELU(0.25) = 0.149 < 0.170: the negative side holds the maximum
    x[4] = -torch.inf
    x[5, 7] = torch.nan
    got = quantize_rows(x.bfloat16(), fused=True, gelu=True)
    exact = torch.nn.functional.gelu(x.bfloat16().double(), approximate="tanh")
    torch.testing.assert_close(got.scale[:4].double(), row_scales(exact[:4]).double(), rtol=1e-5, atol=0)
    assert torch.isnan(got.scale[4:]).all()  # a NaN scale reaches the GEMM's output: a clear error there
    assert _within_rounding(got.dequantize(torch.float64)[:4], exact[:4], got.scale[:4].double(), ulps=1.01)


def test_qk_norm_rope_writes_e4m3_with_its_fixed_scale():
    gen = _gen(3)
    grid, heads, head_dim = (2, 3, 5), 2, 64
    n_video, n_text = 30, 7
    rand = lambda *s: torch.randn(*s, generator=gen, device=DEVICE).bfloat16()  # noqa: E731
    q, k, qt, kt = (
        rand(1, n_video, heads, head_dim),
        rand(1, n_video, heads, head_dim),
        rand(1, n_text, heads, head_dim),
        rand(1, n_text, heads, head_dim),
    )
    w = [torch.rand(head_dim, generator=gen, device=DEVICE) + 0.5 for _ in range(4)]
    cos, sin = rope_table(grid, (16, 24, 24), 256.0, 16 / 24, device=DEVICE)
    q_bound, k_bound = qk_bound(head_dim, w[0], w[2]), qk_bound(head_dim, w[1], w[3])
    q8, k8 = fusions.qk_norm_rope(
        q, k, w[0], w[1], cos, sin, qt, kt, w[2], w[3], eps=1e-6, fused=True,
        out_dtype=FP8, q_out_mult=E4M3_MAX / q_bound, k_out_mult=E4M3_MAX / k_bound,
    )  # fmt: skip
    q_ref, k_ref = fusions.qk_norm_rope_reference(
        q.float(), k.float(), w[0], w[1], cos, sin, qt.float(), kt.float(), w[2], w[3], eps=1e-6
    )
    for got, want, bound in ((q8, q_ref, q_bound), (k8, k_ref, k_bound)):
        assert got.dtype == FP8 and got.shape == (1, n_video + n_text, heads, head_dim)
        scale = torch.full(got.shape[:-1], bound / E4M3_MAX, device=DEVICE, dtype=torch.float64)
        assert _within_rounding(got.double() * scale[..., None], want.double(), scale, ulps=1.01)


@pytest.mark.parametrize("transposed", [True, False], ids=["transposed", "bshd"])
def test_values_quantise_per_head_into_the_attention_layout(transposed):
    from pan2cli.dit.fp8_attention_kernel import padded_keys
    from pan2cli.dit.fp8_values_kernel import values_fp8

    gen = _gen(4)
    heads, head_dim, n_video, n_text = 3, 64, 45, 6
    video = (torch.randn(2, n_video, heads * head_dim, generator=gen, device=DEVICE) * 5).bfloat16()
    text = torch.randn(2, n_text, heads * head_dim, generator=gen, device=DEVICE).bfloat16()
    n = n_video + n_text
    shape = (2, heads, head_dim, padded_keys(n)) if transposed else (2, n, heads, head_dim)
    out = torch.full(shape, 99.0, device=DEVICE).to(FP8)  # poisoned: the padding must be written
    descale = torch.empty(heads, device=DEVICE)
    values_fp8([video, text], heads, out, descale, transposed=transposed)
    joint = torch.cat([video, text], dim=1).double().view(2, n, heads, head_dim)
    torch.testing.assert_close(
        descale.double(), joint.abs().amax(dim=(0, 1, 3)) / E4M3_MAX, rtol=1e-6, atol=0
    )
    got = out[..., :n].permute(0, 3, 1, 2) if transposed else out  # → [B, S, H, D]
    scale = descale.double()[None, None, :].expand(2, n, heads)
    assert _within_rounding(got.double() * scale[..., None], joint, scale, ulps=1.01)
    if transposed:
        assert torch.all(out[..., n:].float() == 0)


@pytest.mark.parametrize("n_video", [45, 1100], ids=["one-block", "three-blocks"])
def test_smoothed_values_are_quantised_less_their_mean_over_the_tokens(n_video):
    """With `mean`: V − (each batch item's channel means over both streams' tokens) is what is quantised (its
    own per-head scale, the padding zero), within one rounding though V's tokens share a part 20x their own, and
    `mean` holds the shift that makes the dequantised values average to V's own mean. 1,100 video tokens: the
    statistics of three blocks of `STATS_TOKENS_PER_PROGRAM` tokens (the last partial) added up."""
    from pan2cli.dit.fp8_attention_kernel import padded_keys
    from pan2cli.dit.fp8_values_kernel import STATS_TOKENS_PER_PROGRAM, values_fp8

    assert 2 * STATS_TOKENS_PER_PROGRAM < 1100 < 3 * STATS_TOKENS_PER_PROGRAM
    gen = _gen(5)
    heads, head_dim, n_text = 2, 64, 6
    shared = torch.randn(2, 1, heads * head_dim, generator=gen, device=DEVICE) * 20
    video = (shared + torch.randn(2, n_video, heads * head_dim, generator=gen, device=DEVICE)).bfloat16()
    text = (shared + torch.randn(2, n_text, heads * head_dim, generator=gen, device=DEVICE)).bfloat16()
    n = n_video + n_text
    out = torch.full((2, heads, head_dim, padded_keys(n)), 99.0, device=DEVICE).to(FP8)
    descale, mean = torch.empty(heads, device=DEVICE), torch.full((2, heads * head_dim), 7.0, device=DEVICE)
    values_fp8([video, text], heads, out, descale, mean=mean)
    joint = torch.cat([video, text], dim=1).double()
    true_mean = joint.mean(dim=1)
    centred = (joint - true_mean[:, None]).view(2, n, heads, head_dim)
    torch.testing.assert_close(
        descale.double(), centred.abs().amax(dim=(0, 1, 3)) / E4M3_MAX, rtol=1e-5, atol=0
    )
    assert descale.max() < joint.abs().amax() / E4M3_MAX / 5  # the shared part no longer sets the scale
    got = out[..., :n].permute(0, 3, 1, 2).double() * descale.double()[None, None, :, None]
    scale = descale.double()[None, None, :].expand(2, n, heads)
    assert _within_rounding(got, centred, scale, ulps=1.01)
    assert torch.all(out[..., n:].float() == 0)
    # the shift: V's mean less the dequantised values' mean, so that the two together average to V's mean
    dequantised_mean = got.reshape(2, n, heads * head_dim).mean(dim=1)
    torch.testing.assert_close(mean.double(), true_mean - dequantised_mean, rtol=1e-5, atol=1e-5)
    assert (mean.double() - true_mean).abs().max() < float(
        descale.max()
    ) * 448 * HALF_ULP  # within a rounding


def test_the_shift_of_smoothed_values_takes_out_the_rounding_bias_where_the_softmax_is_broad():
    """The tier's emulation of the attention (e4m3 Q, K, V and P) on unit-RMS random inputs (a broad softmax:
    the output is close to V's mean): V smoothed with the shift `values_fp8` writes is closer to float64 than V
    quantised as it is and than V smoothed with its plain mean added back (measured 0.0499 against 0.0523 and
    0.0524 at 544 tokens; 0.0517 against 0.0544 and 0.0560 at the 121-frame length)."""
    from pan2cli.dit.fp8_attention import attention_reference
    from pan2cli.dit.fp8_attention_kernel import padded_keys
    from pan2cli.dit.fp8_values_kernel import values_fp8
    from pan2cli.testing.attention_inputs import exact_attention, make_inputs, relative_rms

    heads, rows = 2, 128
    inputs = make_inputs(
        "random", grid=(5, 8, 12), text_tokens=64, heads=heads, device=torch.device(DEVICE), seed=3
    )
    want = exact_attention(inputs, rows=rows)
    scales = inputs.fp8_scales()
    q8, k8 = inputs.quantized_qk(scales, fused=False)
    streams, tokens = [inputs.v_video, inputs.v_text], inputs.tokens

    def attend(mean):
        v_t = torch.empty(1, heads, 128, padded_keys(tokens), device=DEVICE).to(FP8)
        descale = torch.empty(heads, device=DEVICE)
        values_fp8(streams, heads, v_t, descale, mean=mean)
        v8 = v_t[..., :tokens].permute(0, 3, 1, 2)
        return attention_reference(q8[:, :rows], k8, v8, float(scales.q_descale * scales.k_descale), descale)

    plain = relative_rms(attend(None), want)
    shift = torch.empty(1, heads * 128, device=DEVICE)
    smoothed = attend(shift)
    true_mean = inputs.joint_values().double().mean(dim=1).float().view(1, 1, heads, 128)
    with_mean = relative_rms(smoothed + true_mean, want)
    with_shift = relative_rms(smoothed + shift.view(1, 1, heads, 128), want)
    assert with_shift < 0.97 * plain and with_shift < 0.97 * with_mean, (with_shift, plain, with_mean)


def test_values_for_an_instantiation_are_the_v_it_reads():
    """`values_for`: the wide tiles get V in the wgmma key order less its mean (returned), the 128-key tiles with
    cp.async V in key order with no mean: each the `values_fp8` output for those arguments."""
    from pan2cli.dit.cuda_fp8_attention import Instantiation, values_for
    from pan2cli.dit.fp8_values_kernel import values_fp8

    gen = _gen(7)
    heads, n_video, n_text = 2, 40, 8
    shared = torch.randn(1, 1, heads * 128, generator=gen, device=DEVICE) * 10
    video, text = (
        (shared + torch.randn(1, n, heads * 128, generator=gen, device=DEVICE)).bfloat16()
        for n in (n_video, n_text)
    )
    for instantiation, key_order in (
        (Instantiation(3, False, "tma", 224), "wgmma"),
        (Instantiation(4, True, "cp.async"), "natural"),
    ):
        v_t, descale, mean = values_for(instantiation, [video, text], heads)
        want_t, want_descale = torch.empty_like(v_t), torch.empty_like(descale)
        want_mean = torch.empty(1, heads * 128, device=DEVICE) if key_order == "wgmma" else None
        values_fp8([video, text], heads, want_t, want_descale, key_order=key_order, mean=want_mean)
        assert v_t.shape == (1, heads, 128, 48) and torch.equal(
            v_t.view(torch.uint8), want_t.view(torch.uint8)
        )
        assert torch.equal(descale, want_descale)
        assert (mean is None) == (want_mean is None)
        if mean is not None:  # the shift: with it, the dequantised values average to V's mean
            assert torch.equal(mean, want_mean)
            dequantised_mean = (v_t.double() * descale.double()[None, :, None, None]).sum(-1) / (
                n_video + n_text
            )
            torch.testing.assert_close(
                mean.double() + dequantised_mean.view(1, -1),
                torch.cat([video, text], 1).double().mean(1),
                rtol=1e-5,
                atol=1e-5,
            )


@pytest.mark.parametrize("smooth", [False, True], ids=["plain", "smoothed"])
def test_a_nan_in_v_gives_its_head_an_infinite_scale(smooth):
    """A NaN anywhere in a head's V (here the text's last token) makes that head's maximum Inf, so its
    descale is Inf and its output NaN downstream, never a silently wrong value; the other head is untouched."""
    from pan2cli.dit.fp8_attention_kernel import padded_keys
    from pan2cli.dit.fp8_values_kernel import values_fp8

    gen = _gen(6)
    heads, head_dim, n_video, n_text = 2, 32, 600, 5
    video = torch.randn(1, n_video, heads * head_dim, generator=gen, device=DEVICE).bfloat16()
    text = torch.randn(1, n_text, heads * head_dim, generator=gen, device=DEVICE).bfloat16()
    text[0, -1, head_dim + 3] = float("nan")
    out = torch.empty(1, heads, head_dim, padded_keys(n_video + n_text), device=DEVICE).to(FP8)
    descale = torch.empty(heads, device=DEVICE)
    mean = torch.empty(1, heads * head_dim, device=DEVICE) if smooth else None
    values_fp8([video, text], heads, out, descale, mean=mean)
    assert torch.isfinite(descale[0]) and descale[1] == float("inf")


def wgmma_key_columns(n_keys: int) -> list[int]:
    """Column of each key in the wgmma key order (the CUDA fp8 attention's `key_of_row`, written out from its
    definition: within each 32-key block, key c = 8i + 2q + e sits at 16(i // 2) + 4q + 2(i % 2) + e)."""
    columns = []
    for key in range(n_keys):
        c = key % 32
        i, q, e = c // 8, (c % 8) // 2, c % 2
        columns.append(key - c + 16 * (i // 2) + 4 * q + 2 * (i % 2) + e)
    return columns


@pytest.mark.parametrize("n_text", [0, 6], ids=["one-stream", "video-and-text"])
def test_values_in_the_wgmma_key_order_are_the_natural_ones_with_each_32_key_block_permuted(n_text):
    """The TMA producer's V: each 32-key block permuted by `key_of_row` (written out here from its definition),
    the padding too; with the text stream starting inside a block (key 45), each key still from its stream."""
    from pan2cli.dit.fp8_attention_kernel import padded_keys
    from pan2cli.dit.fp8_values_kernel import values_fp8

    gen = _gen(6)
    heads, head_dim, n = 2, 64, 51  # a full 32-key block, then 19 keys and 13 of zeros
    v = (torch.randn(1, n, heads * head_dim, generator=gen, device=DEVICE) * 3).bfloat16()
    streams = [v[:, : n - n_text], v[:, n - n_text :]] if n_text else [v]
    natural, permuted = (
        torch.full((1, heads, head_dim, padded_keys(n)), 99.0, device=DEVICE).to(FP8) for _ in range(2)
    )
    descales = torch.empty(2, heads, device=DEVICE)
    values_fp8(streams, heads, natural, descales[0])
    values_fp8(streams, heads, permuted, descales[1], key_order="wgmma")
    one_stream = torch.empty_like(natural)
    values_fp8([v], heads, one_stream, torch.empty(heads, device=DEVICE))
    assert torch.equal(natural.view(torch.uint8), one_stream.view(torch.uint8))
    columns = wgmma_key_columns(padded_keys(n))
    assert sorted(columns) == list(range(padded_keys(n)))  # a permutation of the padded keys
    assert columns[:8] == [0, 1, 4, 5, 8, 9, 12, 13] and columns[8:10] == [2, 3]
    torch.testing.assert_close(descales[1], descales[0], rtol=0, atol=0)
    assert torch.equal(permuted[..., columns].view(torch.uint8), natural.view(torch.uint8))
    with pytest.raises(AssertionError, match="transposed"):
        values_fp8([v], heads, torch.empty(1, n, heads, head_dim, device=DEVICE).to(FP8), descales[0],
                   transposed=False, key_order="wgmma")  # fmt: skip


def test_values_for_cudnn_share_the_largest_heads_scale():
    """cuDNN's fp8 attention applies one V descale (head 0's) to every head: `per_tensor=True` gives every head the
    largest head's descale, and each head's values, however small, still dequantise within e4m3's rounding."""
    from pan2cli.dit.fp8_values_kernel import values_fp8

    gen = _gen(7)
    heads, head_dim, n_video, n_text = 3, 64, 45, 6
    magnitudes = torch.tensor([0.01, 1.0, 50.0], device=DEVICE)  # heads of very different sizes
    rand = lambda n: torch.randn(2, n, heads, head_dim, generator=gen, device=DEVICE) * magnitudes[:, None]  # noqa: E731
    video, text = (rand(n).reshape(2, n, heads * head_dim).bfloat16() for n in (n_video, n_text))
    out = torch.full((2, n_video + n_text, heads, head_dim), 99.0, device=DEVICE).to(FP8)
    descale = torch.empty(heads, device=DEVICE)
    values_fp8([video, text], heads, out, descale, transposed=False, per_tensor=True)
    joint = torch.cat([video, text], dim=1).double().view(out.shape)
    largest = float(joint.abs().max()) / E4M3_MAX
    torch.testing.assert_close(
        descale.double(), torch.full((heads,), largest, device=DEVICE, dtype=torch.float64)
    )
    scale = descale.double()[None, None, :].expand(out.shape[:3])
    assert _within_rounding(out.double() * scale[..., None], joint, scale, ulps=1.01)
    assert float(out[:, :, 2].float().abs().max()) == E4M3_MAX  # the largest head uses e4m3's whole range


@pytest.mark.parametrize("tokens, head_dim", [(70, 64), (130, 128)])
def test_fp8_attention_matches_its_emulation_and_float64(tokens, head_dim):
    from pan2cli.dit.fp8_attention import attention_reference
    from pan2cli.dit.fp8_attention_kernel import fp8_attention, padded_keys

    gen = _gen(5)
    heads = 2
    q = torch.randn(1, tokens, heads, head_dim, generator=gen, device=DEVICE)
    k = torch.randn(1, tokens, heads, head_dim, generator=gen, device=DEVICE)
    v = torch.randn(1, tokens, heads, head_dim, generator=gen, device=DEVICE) * 3
    bound = float(max(q.abs().max(), k.abs().max()))
    q8, k8 = (
        quantize_with_scales(t, torch.full(t.shape[:-1], bound / E4M3_MAX, device=DEVICE)) for t in (q, k)
    )
    v_descale = v.abs().amax(dim=(0, 1, 3)) / E4M3_MAX
    v8 = quantize_with_scales(v, v_descale[None, None].expand(v.shape[:-1]))
    v_t = torch.zeros(1, heads, head_dim, padded_keys(tokens), device=DEVICE).to(FP8)
    v_t[..., :tokens] = v8.permute(0, 2, 3, 1)
    qk = torch.tensor([(bound / E4M3_MAX) ** 2], device=DEVICE)
    config = (32, 32, 4, 2) if DEVICE == "cpu" else (64, 64, 4, 2)
    out = fp8_attention(q8, k8, v_t, qk, v_descale.float(), config=config)
    emulated = attention_reference(q8, k8, v8, float(qk), v_descale)
    exact = torch.nn.functional.scaled_dot_product_attention(
        *(t.double().transpose(1, 2) for t in (q, k, v))
    ).transpose(1, 2)
    rel = lambda a, b: float((a.double() - b.double()).norm() / b.double().norm())  # noqa: E731
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert (
        rel(out, emulated) < 0.03
    )  # P is rounded against a running maximum in the kernel, the final one here
    assert rel(out, exact) < 0.08  # e4m3 Q, K, V and P (3 mantissa bits each)


# -- a quantised model ------------------------------------------------------------------------------
def test_a_quantised_model_is_close_to_its_bf16_self_and_keeps_the_rest_in_higher_precision():
    from pan2cli.dit.quantize import Fp8Policy, quantize_transformer
    from tests.dit.small_models import random_small_pan2

    model = random_small_pan2(head_dim=64)
    x, t, ctx = torch.randn(1, 97, 2, 6, 8), torch.tensor([500.0]), torch.randn(1, 5, 32)
    with torch.no_grad():
        want = model(x, t, ctx)
        fp8 = quantize_transformer(copy.deepcopy(model))
        assert fp8.precision == "fp8"
        block = fp8.transformer_blocks[0]
        assert isinstance(block.attn.to_q, Fp8Linear) and isinstance(block.ff.net[2], Fp8Linear)
        assert (
            not isinstance(block.norm1.linear, Fp8Linear) and block.norm1.linear.weight.dtype == torch.float32
        )
        assert not isinstance(fp8.proj_out, Fp8Linear) and not isinstance(
            fp8.context_refiner[0].attn.to_q, Fp8Linear
        )
        fusions.set_fused_kernels(fp8, False)
        emulated = fp8(x, t, ctx)
        mixed = quantize_transformer(
            copy.deepcopy(model), Fp8Policy(attention=False, bf16_blocks=frozenset({1}))
        )
        assert not isinstance(mixed.transformer_blocks[1].attn.to_q, Fp8Linear)
        fusions.set_fused_kernels(mixed, False)
        partly = mixed(x, t, ctx)
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert 1e-4 < rel(emulated, want) < 0.05
    assert rel(partly, want) < rel(emulated, want)  # less quantised, closer
    if DEVICE == "cuda":
        with torch.no_grad():
            fused = quantize_transformer(copy.deepcopy(model).cuda().bfloat16())(
                x.cuda(), t.cuda(), ctx.cuda()
            )
        assert rel(fused.double().cpu(), want.double()) < 0.06


def test_a_quantised_model_runs_its_fp8_attention_and_records_it():
    """The fp8 blocks take the fp8 attention (here its CPU emulation), not the bf16 SDPA: the output is the
    emulation's, off the same model's with bf16 attention by more than the linears' rounding alone, and each
    block's call is recorded (what the sidecar's `ran.fp8_attention` reports); none is recorded after a reset
    and for a bf16 model."""
    from pan2cli.dit.fp8_attention_choice import fp8_attention_ran, reset_fp8_attention_record
    from pan2cli.dit.quantize import Fp8Policy, quantize_transformer
    from tests.dit.small_models import random_small_pan2

    model = random_small_pan2(head_dim=64)
    x, t, ctx = torch.randn(1, 97, 2, 6, 8), torch.tensor([500.0]), torch.randn(1, 5, 32)
    with torch.no_grad():
        assert fp8_attention_ran(model) is None  # a bf16 model: no fp8 attention
        fp8 = quantize_transformer(copy.deepcopy(model))
        linears_only = quantize_transformer(copy.deepcopy(model), Fp8Policy(attention=False))
        fusions.set_fused_kernels(fp8, False)
        fusions.set_fused_kernels(linears_only, False)
        got = fp8(x, t, ctx)
        ran = fp8_attention_ran(fp8)
        assert ran == {"kernel": "emulation", "why": None, "calls": 2, "instantiations": []}
        reset_fp8_attention_record(fp8)
        assert fp8_attention_ran(fp8) is None
        without = linears_only(x, t, ctx)
        assert fp8_attention_ran(linears_only) is None
        # the same forward with the attention's e4m3 inputs: the emulation, exactly
        from pan2cli.dit import fp8_attention

        calls = []
        reference = fp8_attention.attention_reference
        fp8_attention.attention_reference = lambda *a: calls.append(1) or reference(*a)
        try:
            again = fp8(x, t, ctx)
        finally:
            fp8_attention.attention_reference = reference
    assert len(calls) == 2 and torch.equal(again, got)
    assert float((got - without).norm() / without.norm()) > 3e-4  # e4m3 Q, K, V, P moved it (9.9e-4 measured)


@pytest.mark.gpu
def test_the_fp8_gemm_equals_its_emulation_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if fp8_unsupported_reason("cuda"):
        pytest.skip(fp8_unsupported_reason("cuda"))
    gen = torch.Generator("cuda").manual_seed(6)
    linear = torch.nn.Linear(512, 384, device="cuda").bfloat16()
    x = torch.randn(3, 77, 512, generator=gen, device="cuda").bfloat16()
    fp8 = Fp8Linear.from_linear(linear)
    got = fp8(x)
    activation = quantize_rows_reference(x)
    emulated = (
        activation.dequantize(torch.float64) @ (fp8.weight.double() * fp8.weight_scale.double()[:, None]).t()
    )
    emulated = emulated + fp8.bias.double()
    assert got.dtype == torch.bfloat16 and got.shape == (3, 77, 384)
    assert float((got.double() - emulated).norm() / emulated.norm()) < 4e-3  # bf16 output rounding
    assert isinstance(activation, Fp8Activation) and math.isfinite(float(got.float().abs().max()))


@pytest.mark.gpu
def test_cudnn_fp8_attention_matches_the_emulation():
    """cuDNN's fp8 SDPA (the default fp8 attention where cudnn-frontend is installed) computes the attention of
    its e4m3 inputs, its e4m3 output within e4m3's rounding of the emulation."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if fp8_unsupported_reason("cuda"):
        pytest.skip(fp8_unsupported_reason("cuda"))
    pytest.importorskip("cudnn")
    from pan2cli.dit.cudnn_fp8_attention import cudnn_fp8_attention
    from pan2cli.dit.fp8_attention import attention_reference

    gen = torch.Generator("cuda").manual_seed(8)
    tokens, heads, head_dim = 1030, 4, 128
    q, k = (torch.nn.functional.rms_norm(torch.randn(1, tokens, heads, head_dim, generator=gen, device="cuda"),
            (head_dim,)) for _ in range(2))  # fmt: skip
    v = torch.randn(1, tokens, heads, head_dim, generator=gen, device="cuda")
    bound = math.sqrt(head_dim)
    q8, k8 = ((t * (E4M3_MAX / bound)).to(FP8) for t in (q, k))
    v_descale = (v.abs().amax() / E4M3_MAX).expand(heads).contiguous()
    v8 = (v / v_descale[0]).to(FP8)
    qk = torch.tensor([(bound / E4M3_MAX) ** 2], device="cuda")
    o8, o_descale = cudnn_fp8_attention(q8, k8, v8, qk, v_descale)
    got = o8.double() * o_descale.double()
    emulated = attention_reference(q8, k8, v8, float(qk), v_descale).double()
    assert o8.dtype == FP8 and o8.shape == q8.shape and torch.isfinite(got).all()
    assert float((got - emulated).norm() / emulated.norm()) < 0.06  # e4m3 output: 3 mantissa bits
