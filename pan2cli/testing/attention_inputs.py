"""Synthetic inputs of PAN 2's joint attention shaped like a trained video DiT's: the fp8 attention's outlier suite.

Each case makes the *pre-norm* projections of one joint attention (video Q/K `[B, N, H, D]` with RoPE tables,
text Q/K `[B, L, H, D]`, V of both streams `[B, n, H·D]`, all bf16 as the projections write them) and the
four Q/K RMSNorm weights, so that a test or a benchmark sends them through the real path (`qk_norm_rope`,
the fp8 quantisation, an attention kernel) and measures what the model would do. The reference is float64
attention of the same bf16 inputs (`exact_attention`: RMSNorm and RoPE in float64 too); the error is the
relative RMS of O against it (`relative_rms`).

The cases (`CASES`), each a failure mode that trained transformers are known for:

* `random`: Q, K, V independent N(0, 1), norm weights 1 ± 0.1 (random weights' attention: broad softmax).
* `shared_key`: every key of a head shares one direction, 5 to 20 times (spread over the heads) the length
  of its own per-token part, then RMS-normed: each key is mostly that common vector, and the scores a
  query gives the keys differ by the small per-token parts (what K smoothing is for). The direction is
  shared in the frame the attention sees, after RoPE (a bias added before RoPE would be turned a
  different way at every position): the projection's output is made from it by undoing each token's
  RoPE and the norm weights (`_before_norm`).
* `outlier_channels`: 4 of the 128 channels of every head's Q and K, the same 4 in both, 30 times the
  others before the RMSNorm (a "massive activation"): after the norm those channels carry most of each
  vector, and the scores are dominated by 4 products (what the Hadamard rotation is for).
* `sharp_rows`: each query is the sum of 1 to 3 random keys plus 10 % noise, in the frame the attention
  sees (as `shared_key`), norm weights 1.5: a low-entropy softmax, a few keys taking most of each row's
  weight (the scores' absolute error matters most there).
* `heavy_tailed_values`: V from a Student-t with 3 degrees of freedom, the 128 channels of a head scaled by
  factors spread log-uniformly over 100x (Q and K as in `random`): one V scale per head must cover values
  far apart.

`pan2` itself never imports this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from pan2cli.dit.fp8_attention import (
    Fp8AttentionScales,
    attention_reference,
    quantize_qk,
    quantize_values_reference,
)
from pan2cli.dit.fusions import qk_norm_rope_reference
from pan2cli.dit.rope import rope_table

CASES = {
    "random": "unit-RMS random Q, K, V",
    "shared_key": "keys of a head share one direction, 5-20x their own part",
    "outlier_channels": "4 of 128 channels of Q and K 30x before the norm",
    "sharp_rows": "each query close to 1-3 keys (low-entropy softmax)",
    "heavy_tailed_values": "V Student-t(3), channel scales spread 100x",
}
ROPE = dict(axes_dim=(16, 56, 56), theta=256.0, temporal_scale=16 / 24)  # PAN 2's, for head_dim 128
EPS = 1e-6  # PAN 2's RMSNorm epsilon


@dataclass
class AttentionInputs:
    """The pre-norm inputs of one joint attention (video tokens first, then text).

    q_video, k_video: `[B, N, H, D]` bf16; q_text, k_text: `[B, L, H, D]` bf16; v_video `[B, N, H·D]`,
    v_text `[B, L, H·D]` bf16; weights: the RMSNorm weights (q, k, q_text, k_text), each `[D]` float32;
    cos, sin: `[N, D/2]` float32 RoPE tables of the video tokens.
    """

    name: str
    q_video: torch.Tensor
    k_video: torch.Tensor
    q_text: torch.Tensor
    k_text: torch.Tensor
    v_video: torch.Tensor
    v_text: torch.Tensor
    weights: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor
    eps: float = EPS

    @property
    def heads(self) -> int:
        return self.q_video.shape[2]

    @property
    def head_dim(self) -> int:
        return self.q_video.shape[3]

    @property
    def tokens(self) -> int:
        return self.q_video.shape[1] + self.q_text.shape[1]

    def qk_streams(self) -> dict:
        """The keyword arguments of `qk_norm_rope` / `qk_norm_rope_reference` for these Q and K."""
        w = self.weights
        return dict(
            q=self.q_video, k=self.k_video, q_weight=w[0], k_weight=w[1], cos=self.cos, sin=self.sin,
            q_text=self.q_text, k_text=self.k_text, q_text_weight=w[2], k_text_weight=w[3],
        )  # fmt: skip

    def fp8_scales(self, *, hadamard: bool = True, smooth_k: bool = True) -> Fp8AttentionScales:
        """The fp8 attention's scales for these norm weights, as `pan2cli.dit.quantize` makes a block's."""
        w = self.weights
        return Fp8AttentionScales.for_norm_weights(
            self.head_dim,
            (w[0], w[2]),
            (w[1], w[3]),
            hadamard=hadamard,
            smooth_k=smooth_k,
            device=w[0].device,
        )

    def quantized_qk(self, scales: Fp8AttentionScales, *, fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Q and K in e4m3 as the fp8 tier makes them (`quantize_qk`): `[B, S, H, D]` each."""
        streams = (self.q_video, self.k_video, self.q_text, self.k_text, self.weights, self.cos, self.sin)
        return quantize_qk(*streams, eps=self.eps, scales=scales, fused=fused)

    def joint_values(self) -> torch.Tensor:
        """V of all tokens, `[B, S, H, D]` bf16."""
        batch = self.v_video.shape[0]
        return torch.cat([self.v_video, self.v_text], dim=1).view(
            batch, self.tokens, self.heads, self.head_dim
        )


def make_inputs(
    case: str,
    *,
    grid: tuple[int, int, int],
    text_tokens: int,
    heads: int = 4,
    head_dim: int = 128,
    batch: int = 1,
    seed: int = 0,
    device: torch.device | str = "cpu",
) -> AttentionInputs:
    """One case of `CASES` at a video grid (latent frames, patch rows, patch columns) plus `text_tokens`.

    Drawn in float32 on `device` from a generator seeded there (the same inputs on every machine of one
    kind; a GPU draws other numbers than the CPU), rounded to bf16 as projections are. head_dim 128 for PAN 2's
    RoPE axes; other head dims split their channels over the axes in the same proportions.
    """
    if case not in CASES:
        raise ValueError(f"unknown attention case {case!r}; the cases are {', '.join(CASES)}")
    device = torch.device(device)
    gen = torch.Generator(device).manual_seed(seed)
    n_video = grid[0] * grid[1] * grid[2]
    axes = ROPE["axes_dim"] if head_dim == 128 else _axes(head_dim)
    cos, sin = rope_table(grid, axes, ROPE["theta"], ROPE["temporal_scale"], device=device)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device)

    video, text = (batch, n_video, heads, head_dim), (batch, text_tokens, heads, head_dim)
    q_video, k_video, q_text, k_text = randn(*video), randn(*video), randn(*text), randn(*text)
    v_video, v_text = randn(*video), randn(*text)
    weights = [1 + 0.1 * randn(head_dim) for _ in range(4)]
    if case == "shared_key":  # in the frame the attention sees: after the norm and RoPE
        factors = torch.linspace(5, 20, heads, device=device)[:, None]  # per head
        direction = randn(heads, head_dim)
        # unit RMS, like the per-token parts
        direction /= direction.square().mean(dim=-1, keepdim=True).sqrt()
        k_video = _before_norm(k_video + factors * direction, weights[1], cos, sin)
        k_text = _before_norm(k_text + factors * direction, weights[3])
    elif case == "outlier_channels":
        channels = torch.randperm(head_dim, generator=gen, device=device)[:4]
        for t in (q_video, k_video, q_text, k_text):
            t[..., channels] *= 30
    elif case == "sharp_rows":  # in the frame the attention sees
        weights = [torch.full((head_dim,), 1.5, device=device) for _ in range(4)]
        queries = _pointing_queries(torch.cat([k_video, k_text], dim=1), gen)
        q_video = _before_norm(queries[:, :n_video], weights[0], cos, sin)
        q_text = _before_norm(queries[:, n_video:], weights[2])
        k_video, k_text = _before_norm(k_video, weights[1], cos, sin), _before_norm(k_text, weights[3])
    elif case == "heavy_tailed_values":
        scales = torch.logspace(0, 2, head_dim, device=device)[
            torch.randperm(head_dim, generator=gen, device=device)
        ]
        v_video, v_text = _student_t3(video, gen) * scales, _student_t3(text, gen) * scales

    def projection(t):
        return t.to(torch.bfloat16)

    return AttentionInputs(
        name=case,
        q_video=projection(q_video), k_video=projection(k_video),
        q_text=projection(q_text), k_text=projection(k_text),
        v_video=projection(v_video).reshape(batch, n_video, heads * head_dim),
        v_text=projection(v_text).reshape(batch, text_tokens, heads * head_dim),
        weights=tuple(weights), cos=cos, sin=sin,
    )  # fmt: skip


def _axes(head_dim: int) -> tuple[int, int, int]:
    """PAN 2's split of 128 channels over (t, h, w), 16:56:56, scaled to `head_dim` (even parts)."""
    t = max(2, head_dim // 8 // 2 * 2)
    h = (head_dim - t) // 2 // 2 * 2
    return t, h, head_dim - t - h


def _student_t3(shape, gen) -> torch.Tensor:
    """Student-t samples with 3 degrees of freedom, Z / √(χ²₃ / 3), from `gen` (float32, on its device)."""
    z = torch.randn(shape, generator=gen, device=gen.device)
    chi2 = torch.randn(*shape, 3, generator=gen, device=gen.device).square().sum(dim=-1)
    return z / (chi2 / 3).sqrt()


def _before_norm(y: torch.Tensor, weight: torch.Tensor, cos=None, sin=None) -> torch.Tensor:
    """A projection's output that the RMSNorm with `weight` (and RoPE with cos/sin) turns into y's direction:
    x = RoPE⁻¹(y) / weight, since RoPE(weight ⊙ x / rms(x)) = y / rms(x). y: `[B, n, H, D]`."""
    if cos is not None:  # a rotation by minus each pair's angle
        c, s = cos[:, None, :], sin[:, None, :]
        y1, y2 = y[..., 0::2], y[..., 1::2]
        y = torch.stack([y1 * c + y2 * s, y2 * c - y1 * s], dim=-1).flatten(-2)
    return y / weight


def _pointing_queries(keys: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """For keys `[B, S, H, D]`, queries each the sum of 1-3 random keys plus 10 % noise (same shape)."""
    batch, n, heads, head_dim = keys.shape
    queries = torch.zeros_like(keys)
    count = torch.randint(1, 4, (batch, n, heads), generator=gen, device=keys.device)
    for m in range(3):
        pick = torch.randint(0, n, (batch, n, heads), generator=gen, device=keys.device)
        chosen = torch.gather(keys, 1, pick[..., None].expand(-1, -1, -1, head_dim))
        queries += chosen * (m < count)[..., None]
    noise = torch.randn(queries.shape, generator=gen, device=keys.device)
    return queries + 0.1 * noise * queries.norm(dim=-1, keepdim=True) / math.sqrt(head_dim)


def normed_qk(
    inputs: AttentionInputs, dtype: torch.dtype = torch.float64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Q and K after the RMSNorm and RoPE, computed in `dtype` from the bf16 projections: `[B, S, H, D]`."""
    streams = {name: t.to(dtype) if t.is_floating_point() else t for name, t in inputs.qk_streams().items()}
    return qk_norm_rope_reference(**streams, eps=inputs.eps)


def exact_attention(inputs: AttentionInputs, rows: int | None = None) -> torch.Tensor:
    """float64 attention of the bf16 inputs (RMSNorm and RoPE in float64 too) for the first `rows` query
    rows (all by default): `[B, rows, H, D]` float64."""
    q, k = normed_qk(inputs)
    v = inputs.joint_values().double()
    q = q if rows is None else q[:, :rows]
    out = []
    for h in range(inputs.heads):  # one head at a time: S x S float64 scores of one head at most
        scores = q[:, :, h] @ k[:, :, h].transpose(-1, -2) / math.sqrt(inputs.head_dim)
        out.append(torch.softmax(scores, dim=-1) @ v[:, :, h])
    return torch.stack(out, dim=2)


def emulated_fp8_attention(
    inputs: AttentionInputs, scales: Fp8AttentionScales, rows: int | None = None
) -> torch.Tensor:
    """The fp8 tier's attention in its PyTorch emulation (e4m3 Q and K from `quantize_qk_reference`, V per
    head, P in e4m3; `pan2cli.dit.fp8_attention.attention_reference`) for the first `rows` query rows:
    `[B, rows, H, D]` float32."""
    q8, k8 = inputs.quantized_qk(scales, fused=False)
    v8, v_descale = quantize_values_reference(inputs.joint_values())
    q8 = q8 if rows is None else q8[:, :rows]
    return attention_reference(q8, k8, v8, scales.q_descale * scales.k_descale, v_descale)


def relative_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    """‖got − want‖ / ‖want‖ over all elements, in float64."""
    got, want = got.double(), want.double().to(got.device)
    return float((got - want).norm() / want.norm())


def softmax_sharpness(inputs: AttentionInputs, rows: int = 256) -> float:
    """The mean over the first `rows` query rows (all heads) of the largest softmax weight of the row
    (float64): about 1/S for a flat softmax, near 1 when one key takes the row."""
    q, k = normed_qk(inputs)
    q = q[:, :rows]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(inputs.head_dim)
    return float(torch.softmax(scores, dim=-1).amax(dim=-1).mean())
