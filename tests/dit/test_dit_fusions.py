"""The fused `pan2_fusions` ops equal their PyTorch references (Triton interpreter on CPU, real kernels on CUDA)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from pan2cli.dit import fusions  # noqa: E402
from pan2cli.dit.rope import rope_table  # noqa: E402

# TRITON_INTERPRET=1 without CUDA, set for each test of this module only (conftest.py).
pytestmark = pytest.mark.usefixtures("triton_interpreter_without_cuda")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Relative L2 error allowed against the reference at the same dtype (the bounds). In bf16 the
# interpreter rounds fp32 → bf16 toward zero (GPUs round to nearest even), so there the two paths differ
# by up to one bf16 ulp per element: ~3e-3 relative.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def rel_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def _qk_inputs(batch, grid, n_text, heads, head_dim, axes, dtype, seed=0):
    gen = _gen(seed)
    n_video = grid[0] * grid[1] * grid[2]

    def rand(*shape, scale=1.0, offset=0.0):
        return (torch.randn(*shape, generator=gen, device=DEVICE) * scale + offset).to(dtype)

    cos, sin = rope_table(grid, axes, 256.0, 16 / 24, device=DEVICE)  # PAN 2's θ and frame scale
    return dict(
        q=rand(batch, n_video, heads, head_dim, scale=3.0),
        k=rand(batch, n_video, heads, head_dim),
        q_weight=rand(head_dim, scale=0.3, offset=1.0),
        k_weight=rand(head_dim, scale=0.3, offset=1.0),
        cos=cos,
        sin=sin,
        q_text=rand(batch, n_text, heads, head_dim) if n_text else None,
        k_text=rand(batch, n_text, heads, head_dim, scale=2.0) if n_text else None,
        q_text_weight=rand(head_dim, scale=0.3, offset=1.0) if n_text else None,
        k_text_weight=rand(head_dim, scale=0.3, offset=1.0) if n_text else None,
    )


@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "batch, grid, n_text, heads, head_dim, axes",
    [
        (1, (3, 5, 7), 13, 3, 64, (20, 22, 22)),  # 105 video tokens, odd everything
        (2, (2, 3, 5), 7, 2, 128, (16, 56, 56)),  # PAN 2's head_dim and axes split
        (1, (1, 1, 9), 0, 5, 64, (0, 32, 32)),  # one frame, no text, no temporal channels
        (2, (4, 1, 3), 1, 1, 128, (64, 32, 32)),  # a single text token
    ],
)
def test_qk_norm_rope_matches_reference(dtype, batch, grid, n_text, heads, head_dim, axes, interleaved):
    inputs = _qk_inputs(batch, grid, n_text, heads, head_dim, axes, dtype)
    fused = fusions.qk_norm_rope(**inputs, eps=1e-6, fused=True, interleaved=interleaved)
    reference = fusions.qk_norm_rope(**inputs, eps=1e-6, fused=False, interleaved=interleaved)
    n_total = grid[0] * grid[1] * grid[2] + n_text
    for got, want in zip(fused, reference):
        assert got.shape == want.shape == (batch, n_total, heads, head_dim)
        assert got.dtype == dtype
        assert rel_error(got, want) <= TOLERANCE[dtype]
        # text rows are only normalised: checked on their own, not just inside the global error
        assert rel_error(got[:, -n_text:], want[:, -n_text:]) <= TOLERANCE[dtype] if n_text else True


def test_interleaved_rotation_is_the_complex_product():
    """PAN 2's pairs: channels (2i, 2i+1) as one complex number, turned by e^{i·angle_i} (independent of apply_rope)."""
    from pan2cli.dit.rope import apply_rope

    grid, axes = (3, 2, 5), (16, 56, 56)
    cos, sin = rope_table(grid, axes, 256.0, 16 / 24, dtype=torch.float64)
    x = torch.randn(2, 30, 3, 128, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    pairs = torch.view_as_complex(x.view(2, 30, 3, 64, 2).contiguous())
    turned = pairs * torch.polar(torch.ones_like(cos), torch.atan2(sin, cos))[None, :, None, :]
    assert torch.allclose(
        apply_rope(x, cos, sin, interleaved=True), torch.view_as_real(turned).flatten(-2), atol=1e-12
    )
    # the angles: pair 0 of token (t=2, h=0, w=0) turns by 2·16/24 rad; pair 8 (the first h pair) by h
    token = 2 * 10
    assert torch.allclose(
        torch.atan2(sin[token, 0], cos[token, 0]), torch.tensor(2 * 16 / 24, dtype=torch.float64)
    )
    assert torch.allclose(torch.atan2(sin[5 + 3, 8], cos[5 + 3, 8]), torch.tensor(1.0, dtype=torch.float64))


@pytest.mark.parametrize("block_rows", [1, 8, 32])
def test_qk_launcher_block_edges_and_strided_inputs(block_rows):
    """Blocks that straddle heads, tokens and samples; q/k as strided views of a fused qkv projection."""
    from pan2cli.dit.qk_norm_rope_kernel import qk_norm_rope as launch

    batch, grid, heads, head_dim = 2, (3, 2, 3), 3, 64
    n_video = 18
    gen = _gen(1)
    qkv = torch.randn(batch, n_video, 3, heads, head_dim, generator=gen, device=DEVICE)
    q, k = qkv[:, :, 0], qkv[:, :, 1]  # token stride 3·H·head_dim
    w_q = torch.rand(head_dim, generator=gen, device=DEVICE) + 0.5
    w_k = torch.rand(head_dim, generator=gen, device=DEVICE) + 0.5
    cos, sin = rope_table(grid, (20, 22, 22), 256.0, device=DEVICE)
    q_out = torch.full((batch, n_video + 4, heads, head_dim), float("nan"), device=DEVICE)
    k_out = torch.full_like(q_out, float("nan"))
    launch(q, k, w_q, w_k, cos, sin, q_out, k_out, eps=1e-6, out_token_offset=2, block_rows=block_rows)
    want_q, want_k = fusions.qk_norm_rope_reference(q, k, w_q, w_k, cos, sin, eps=1e-6)
    assert rel_error(q_out[:, 2:-2], want_q) <= 1e-5 and rel_error(k_out[:, 2:-2], want_k) <= 1e-5
    # rows outside the stream's slice are untouched
    assert q_out[:, :2].isnan().all() and k_out[:, -2:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "batch, n_tokens, groups, dim",
    [
        (1, 37, 1, 96),  # per sample, D not a power of two
        (2, 30, 1, 64),  # per sample, batch 2
        (2, 30, 3, 80),  # per latent frame (3 frames of 10 tokens)
        (1, 45, 45, 48),  # per token
        (3, 7, 7, 200),  # per token, D > 128 and odd row count
    ],
)
def test_layer_norm_modulate_matches_reference(dtype, batch, n_tokens, groups, dim):
    gen = _gen(2)
    x = (torch.randn(batch, n_tokens, dim, generator=gen, device=DEVICE) * 4 + 1.5).to(dtype)
    scale = (torch.randn(batch, groups, dim, generator=gen, device=DEVICE) * 0.5).to(dtype)
    shift = torch.randn(batch, groups, dim, generator=gen, device=DEVICE).to(dtype)
    got = fusions.layer_norm_modulate(x, scale, shift, eps=1e-6, fused=True)
    want = fusions.layer_norm_modulate(x, scale, shift, eps=1e-6, fused=False)
    assert got.shape == x.shape and got.dtype == dtype
    assert rel_error(got, want) <= TOLERANCE[dtype]


@pytest.mark.parametrize("block_rows", [1, 4])
def test_layer_norm_modulate_strided_modulation(block_rows):
    """scale/shift as chunks of one `[B, G, 6, D]` modulation tensor (the model's layout)."""
    from pan2cli.dit.layer_norm_modulate_kernel import layer_norm_modulate as launch

    gen = _gen(3)
    batch, n_tokens, groups, dim = 2, 12, 4, 40
    x = torch.randn(batch, n_tokens, dim, generator=gen, device=DEVICE)
    mod = torch.randn(batch, groups, 6, dim, generator=gen, device=DEVICE)
    shift, scale = mod[:, :, 0], mod[:, :, 1]
    out = torch.full_like(x, float("nan"))
    launch(x, scale, shift, out, eps=1e-5, block_rows=block_rows)
    assert rel_error(out, fusions.layer_norm_modulate_reference(x, scale, shift, eps=1e-5)) <= 1e-5


@pytest.mark.parametrize(
    "batch, n_tokens, groups, block_rows, row_steps",
    [(1, 37, 1, 2, 4), (2, 24, 1, 1, 3), (2, 24, 3, 2, 2)],  # rows past the end; per sample; per frame
)
def test_layer_norm_modulate_rows_sharing_one_modulation_row(batch, n_tokens, groups, block_rows, row_steps):
    """A program taking several tiles that share a modulation row (read once) writes what one tile a program does."""
    from pan2cli.dit.fp8 import FP8
    from pan2cli.dit.layer_norm_modulate_kernel import layer_norm_modulate as launch

    gen = _gen(4)
    dim = 72
    x = (torch.randn(batch, n_tokens, dim, generator=gen, device=DEVICE) * 3 + 1).bfloat16()
    scale = torch.randn(batch, groups, dim, generator=gen, device=DEVICE) * 0.3
    shift = torch.randn(batch, groups, dim, generator=gen, device=DEVICE)
    outs = []
    for steps in (1, row_steps):
        out = torch.empty(x.shape, dtype=FP8, device=DEVICE)
        out_scale = torch.full((batch * n_tokens,), float("nan"), device=DEVICE)
        launch(x, scale, shift, out, eps=1e-6, out_scale=out_scale, block_rows=block_rows, row_steps=steps)
        outs.append((out.float(), out_scale))
    assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    want = fusions.layer_norm_modulate_reference(x.float(), scale, shift, eps=1e-6)
    assert rel_error(outs[1][0] * outs[1][1].view(batch, n_tokens, 1), want) <= 0.04  # e4m3: 3 mantissa bits


def test_layer_norm_modulate_refuses_steps_across_modulation_groups():
    from pan2cli.dit.layer_norm_modulate_kernel import layer_norm_modulate as launch

    x = torch.randn(1, 12, 16, device=DEVICE)
    scale = torch.zeros(1, 3, 16, device=DEVICE)  # groups of 4 tokens: 8 rows a program would straddle two
    with pytest.raises(AssertionError, match="straddle"):
        launch(x, scale, scale, torch.empty_like(x), eps=1e-6, block_rows=2, row_steps=4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "batch, n_tokens, dim, gate_shape",
    [
        (1, 37, 96, (1, 1, 96)),  # the video gate, D not a power of two
        (2, 30, 64, (2, 1, 64)),  # one gate per sample
        (3, 7, 200, (1, 1, 200)),  # the text table broadcast over the batch
        (2, 5, 48, (48,)),  # a plain vector
    ],
)
def test_gated_residual_matches_reference(dtype, batch, n_tokens, dim, gate_shape):
    gen = _gen(7)
    x = (torch.randn(batch, n_tokens, dim, generator=gen, device=DEVICE) * 3).to(dtype)
    update = torch.randn(batch, n_tokens, dim, generator=gen, device=DEVICE).to(dtype)
    gate = torch.randn(*gate_shape, generator=gen, device=DEVICE)  # float32, as the AdaLN linears give
    if len(gate_shape) == 3 and gate_shape[0] == 1:
        gate = gate.expand(batch, 1, dim)  # the model's expanded view of the text table
    got = fusions.gated_residual(x, update, gate, fused=True)
    want = fusions.gated_residual(x, update, gate, fused=False)
    assert got.shape == x.shape and got.dtype == dtype
    assert rel_error(got, want) <= TOLERANCE[dtype]
    # each sample uses its own gate: a wrong batch stride would give sample 1 sample 0's gate
    assert (
        rel_error(got[-1], (x[-1].float() + update[-1].float() * gate.reshape(-1, dim)[-1]).to(dtype))
        <= (TOLERANCE[dtype])
    )


@pytest.mark.parametrize("block_rows", [1, 4])
def test_gated_residual_strided_gate(block_rows):
    """The gate as one chunk of a `[B, 6·D]` modulation tensor (the model's layout), out written in place."""
    from pan2cli.dit.gated_residual_kernel import gated_residual as launch

    gen = _gen(8)
    batch, n_tokens, dim = 2, 9, 40
    x = torch.randn(batch, n_tokens, dim, generator=gen, device=DEVICE)
    update = torch.randn(batch, n_tokens, dim, generator=gen, device=DEVICE)
    gate = torch.randn(batch, 6 * dim, generator=gen, device=DEVICE)[:, 2 * dim : 3 * dim]
    want = x + update * gate[:, None]
    launch(x, update, gate, x, block_rows=block_rows)
    assert rel_error(x, want) <= 1e-6


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_gated_residual_scales_an_fp8_product_on_the_way_in(with_bias):
    """An fp8 GEMM's unscaled product as the update: x + gate·(raw·row_scale·col_scale + bias), each sample with
    its own gate and each row with its own scale, against float64."""
    from pan2cli.dit.fp8 import Fp8Product

    gen = _gen(10)
    batch, n_tokens, dim = 2, 9, 48
    x = (torch.randn(batch, n_tokens, dim, generator=gen, device=DEVICE) * 3).bfloat16()
    raw = (torch.randn(batch, n_tokens, dim, generator=gen, device=DEVICE) * 1e4).bfloat16()
    row_scale = torch.rand(batch, n_tokens, generator=gen, device=DEVICE) * 1e-2 + 1e-3
    col_scale = torch.rand(dim, generator=gen, device=DEVICE) * 1e-2 + 1e-3
    bias = torch.randn(dim, generator=gen, device=DEVICE).bfloat16() if with_bias else None
    gate = torch.randn(batch, 1, dim, generator=gen, device=DEVICE)
    product = Fp8Product(raw, row_scale, col_scale, bias)
    got = fusions.gated_residual(x, product, gate, fused=True)
    update = raw.double() * row_scale.double()[..., None] * col_scale.double()
    if with_bias:
        update = update + bias.double()
    want = x.double() + gate.double() * update
    assert got.dtype == torch.bfloat16 and got.shape == x.shape
    # one bf16 rounding of the result, float32 math before it: within one bf16 ulp (2⁻⁷ relative; the GPU
    # rounds to nearest, half that, but Triton's CPU interpreter truncates)
    assert ((got.double() - want).abs() <= want.abs() * 2**-7 + 1e-6).all()
    assert rel_error(fusions.gated_residual(x, product, gate, fused=False), want.bfloat16()) <= 1e-2


def test_launchers_refuse_bad_layouts():
    from pan2cli.dit.layer_norm_modulate_kernel import layer_norm_modulate as ln_launch
    from pan2cli.dit.qk_norm_rope_kernel import qk_norm_rope as qk_launch

    x = torch.randn(1, 10, 8, device=DEVICE)
    with pytest.raises(AssertionError, match="do not divide"):
        ln_launch(
            x,
            torch.zeros(1, 3, 8, device=DEVICE),
            torch.zeros(1, 3, 8, device=DEVICE),
            torch.empty_like(x),
            eps=1e-6,
        )
    q = torch.randn(1, 4, 2, 48, device=DEVICE)  # head_dim 48 is not a power of two
    out = torch.empty_like(q)
    with pytest.raises(AssertionError, match="power of two"):
        qk_launch(q, q, q[0, 0, 0], q[0, 0, 0], None, None, out, out.clone(), eps=1e-6)


def test_custom_ops_are_registered_with_fakes():
    """torch.compile sees the fused ops as `torch.ops.pan2_fusions.*` with shape-only fakes."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q = torch.empty(2, 6, 3, 64)
        t = torch.empty(2, 5, 3, 64)
        w = torch.empty(64)
        cos = torch.empty(6, 32)
        q_out, k_out = torch.ops.pan2_fusions.qk_norm_rope(q, q, w, w, cos, cos, t, t, w, w, 1e-6, True)
        assert q_out.shape == k_out.shape == (2, 11, 3, 64)
        q8, _ = torch.ops.pan2_fusions.qk_norm_rope(
            q, q, w, w, cos, cos, t, t, w, w, 1e-6, True, True, 2.0, 3.0
        )
        assert q8.shape == (2, 11, 3, 64) and q8.dtype == torch.float8_e4m3fn
        y8, y8_scale = torch.ops.pan2_fusions.layer_norm_modulate_fp8(
            torch.empty(2, 6, 32), torch.empty(2, 1, 32), torch.empty(2, 1, 32), 1e-6
        )
        assert y8.shape == (2, 6, 32) and y8.dtype == torch.float8_e4m3fn and y8_scale.shape == (2, 6)
        y = torch.ops.pan2_fusions.layer_norm_modulate(
            torch.empty(2, 6, 32), torch.empty(2, 1, 32), torch.empty(2, 1, 32), 1e-6
        )
        assert y.shape == (2, 6, 32)
        r = torch.ops.pan2_fusions.gated_residual(
            torch.empty(2, 6, 32), torch.empty(2, 6, 32), torch.empty(32)
        )
        assert r.shape == (2, 6, 32)


# -- GPU: the real kernels at larger shapes, and under torch.compile -------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim, axes", [(128, (16, 56, 56)), (64, (16, 24, 24))])
def test_gpu_qk_norm_rope_large(head_dim, axes):
    inputs = _qk_inputs(
        2, (7, 22, 13), 77, 32 if head_dim == 128 else 8, head_dim, axes, torch.bfloat16, seed=4
    )
    fused = fusions.qk_norm_rope(**inputs, eps=1e-6, fused=True)
    reference = fusions.qk_norm_rope(**inputs, eps=1e-6, fused=False)
    for got, want in zip(fused, reference):
        assert rel_error(got, want) <= 1e-2
        # same math, round to nearest even on both sides: nearly every element is bit-identical
        assert (got != want).float().mean().item() < 0.01


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [1, 7, 7 * 286])
def test_gpu_layer_norm_modulate_large(groups):
    gen = _gen(5)
    x = (torch.randn(2, 7 * 286, 4096, generator=gen, device="cuda") * 3).bfloat16()
    scale = (torch.randn(2, groups, 4096, generator=gen, device="cuda") * 0.3).float()  # float32 AdaLN
    shift = torch.randn(2, groups, 4096, generator=gen, device="cuda").float()
    got = fusions.layer_norm_modulate(x, scale, shift, eps=1e-6, fused=True)
    want = fusions.layer_norm_modulate(x, scale, shift, eps=1e-6, fused=False)
    assert rel_error(got, want) <= 1e-2


@pytest.mark.gpu
def test_gpu_gated_residual_large():
    gen = _gen(9)
    x = (torch.randn(2, 7 * 286, 4096, generator=gen, device="cuda") * 3).bfloat16()
    update = torch.randn(2, 7 * 286, 4096, generator=gen, device="cuda").bfloat16()
    gate = torch.randn(2, 1, 4096, generator=gen, device="cuda")  # float32 AdaLN
    got = fusions.gated_residual(x, update, gate, fused=True)
    want = fusions.gated_residual(x, update, gate, fused=False)
    # float32 math and one round-to-nearest-even on both sides; an FMA contraction may move a few elements
    assert (got != want).float().mean().item() < 0.01
    assert rel_error(got, want) <= 1e-2


@pytest.mark.gpu
def test_gpu_fused_ops_under_torch_compile():
    inputs = _qk_inputs(1, (3, 6, 5), 9, 4, 128, (16, 56, 56), torch.bfloat16, seed=6)

    def both(x, scale, shift, **qk):
        q, k = fusions.qk_norm_rope(**qk, eps=1e-6, fused=True)
        y = fusions.layer_norm_modulate(x, scale, shift, eps=1e-6, fused=True)
        return q, k, y, fusions.gated_residual(x, y, shift, fused=True)

    x = torch.randn(1, 90, 512, device="cuda", dtype=torch.bfloat16)
    scale, shift = torch.randn(2, 1, 1, 512, device="cuda", dtype=torch.bfloat16).unbind(0)
    eager = both(x, scale, shift, **inputs)
    compiled = torch.compile(both, fullgraph=True)(x, scale, shift, **inputs)
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
