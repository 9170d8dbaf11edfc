"""Turn a loaded PAN 2 transformer (or one block at a time, while it loads) into the fp8 tier.

Applied from outside the model, as gpt-fast's quantize.py does: the 12 large linears of each of the 44
blocks (video and text q/k/v/out, fc1, fc2) become `Fp8Linear`s whose weights are quantised on the
device they are on, once; their norms hand them e4m3 rows (`fp8_activations`), fc1's GELU hands fc2 its
quantised input (`fp8_output`), and the joint attention runs in fp8 (`fp8_scales`). The checkpoint keys
do not change (`weight` holds the e4m3 values, `weight_scale` is a buffer outside the state dict's keys
that the loader never reads).

What stays in higher precision, and why (docs/BENCHMARKS.md has the measurements):

| part | precision | why |
| --- | --- | --- |
| AdaLN linears `norm1.linear`, `norm_out.linear` and the modulation | float32, as released | GEMVs on one timestep vector: no time to win; the modulation scales every activation |
| patch embedding `x_embedder`, `proj_out` | bf16 | 97 and 192 channels: tiny GEMMs, and the first/last word on the latents |
| text embedder and the 4 refiner blocks | bf16 | ≤ 1.5 k tokens once per forward: < 1 % of the time |
| Q/K RMSNorm, RoPE, softmax, residuals | float32 math | as in bf16; only their outputs are rounded to e4m3 |
| K smoothing, the Q/K Hadamard rotation | float32 (the rotation's operands float16) | exact transformations before Q/K's e4m3 cast: what keeps outlier channels and shared key directions from costing precision (`pan2cli.dit.fp8_attention`) |
| `Fp8Policy.bf16_blocks` | bf16 | none by default (measured: keeping the first/last block changes the error by less than its spread) |
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from pan2cli.dit.fp8 import Fp8Linear
from pan2cli.dit.fp8_attention import Fp8AttentionScales

ATTENTION_LINEARS = ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")
# The checkpoint keys (after `transformer_blocks.{i}.`) of the weights `quantize_block` stores in e4m3.
FP8_WEIGHTS = frozenset(
    [f"attn.{name}.weight" for name in (*ATTENTION_LINEARS, "to_out.0")]
    + [f"{ff}.net.{i}.weight" for ff in ("ff", "ff_context") for i in ("0.proj", "2")]
)


def is_fp8_weight(key: str) -> bool:
    """Whether checkpoint `key` is a weight the fp8 tier (default `Fp8Policy`) holds in e4m3 (one byte an element)."""
    parts = key.split(".", 2)
    return (
        len(parts) == 3
        and parts[0] == "transformer_blocks"
        and parts[1].isdigit()
        and parts[2] in FP8_WEIGHTS
    )


@dataclass(frozen=True)
class Fp8Policy:
    """What the fp8 tier quantises.

    Args:
        activation_scaling: "token" (one scale per token, written by the fused kernels: the tier) or "tensor"
            (one per activation tensor, quantised in PyTorch: for accuracy comparisons only).
        attention: fp8 attention (else bf16 SDPA over bf16 Q/K/V, with fp8 linears).
        bf16_blocks: indices of blocks left in bf16.
        qk_hadamard: the fp8 attention rotates Q and K by a Hadamard matrix before their e4m3 cast (exact;
            what holds the error on outlier channels, `pan2cli.dit.fp8_attention`). False: for comparisons.
        smooth_k: the fp8 attention subtracts K's mean over the tokens before its e4m3 cast (exact under the
            softmax). False: for comparisons.
    """

    activation_scaling: str = "token"
    attention: bool = True
    bf16_blocks: frozenset[int] = field(default_factory=frozenset)
    qk_hadamard: bool = True
    smooth_k: bool = True

    def __post_init__(self) -> None:
        if self.activation_scaling not in ("token", "tensor"):
            raise ValueError(
                f"activation_scaling must be 'token' or 'tensor', not {self.activation_scaling!r}"
            )


def quantize_block(block: nn.Module, policy: Fp8Policy = Fp8Policy()) -> None:
    """Make one `PAN2TransformerBlock` fp8 in place (its linears quantised where their weights are)."""
    fused_feeds = policy.activation_scaling == "token"
    attn = block.attn
    for name in ATTENTION_LINEARS:
        setattr(attn, name, _fp8(getattr(attn, name), policy))
    attn.to_out[0] = _fp8(attn.to_out[0], policy)
    for ff in (block.ff, block.ff_context):
        ff.net[0].proj = _fp8(ff.net[0].proj, policy)
        ff.net[2] = _fp8(ff.net[2], policy)
        ff.net[0].fp8_output = fused_feeds
    block.fp8_activations = fused_feeds
    attn.fp8_scales = (
        Fp8AttentionScales.for_attention(attn, hadamard=policy.qk_hadamard, smooth_k=policy.smooth_k)
        if policy.attention
        else None
    )


def quantize_transformer(model: nn.Module, policy: Fp8Policy = Fp8Policy()) -> nn.Module:
    """Make every block of a `PAN2Transformer3DModel` fp8 but `policy.bf16_blocks` (in place); returns the model."""
    for index, block in enumerate(model.transformer_blocks):
        if index not in policy.bf16_blocks:
            quantize_block(block, policy)
    model.precision = "fp8"
    return model


def _fp8(linear: nn.Module, policy: Fp8Policy) -> Fp8Linear:
    if isinstance(linear, Fp8Linear):
        return linear
    module = Fp8Linear.from_linear(linear)
    module.input_scaling = policy.activation_scaling
    return module
