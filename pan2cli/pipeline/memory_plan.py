"""The memory plan of a `pan2 generate` run, chosen before anything loads from the memory there is.

Stage by stage, what must be on the GPU at once, against the budget (the GPU's free memory, or
`--max-gpu-memory` where smaller, less `MARGIN_BYTES`):

1. text encoding: the text model's weights and `TEXT_ACTIVATION_BYTES`; where they do not fit, some of its
   layers stream from host memory (`pan2cli.pipeline.offload`);
2. image encoding (image-to-video): the VAE encoder, `ENCODER_PEAK_BYTES`;
3. denoising: the transformer's 44 blocks and the rest of it (embeddings, text refiner, output), and the
   activation peak (`activation_bytes`, measured); where they do not fit, as many blocks as needed stream
   from page-locked host memory, spread over the model (`pan2cli.pipeline.offload.spread`), with room for
   `STREAM_BUFFERS` blocks in flight; with guidance, room for the hidden states of the second pass (both
   passes run through each block in one call: each streamed block crosses the bus once per step);
4. decode: the VAE decoder's peak (`decoder_bytes`), with a smaller chunk where the reference decoder's does
   not fit.

`--offload` streams every block whatever fits. The page-locked host memory the plan needs is compared with the
host's available memory (`pan2cli.host_memory`) before anything loads: a plan that fits neither memory is an
`InputError` saying what would fit. torch-free: sizes come from the checkpoints' headers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from pan2cli.errors import InputError
from pan2cli.host_memory import HostMemory

GIB = 2**30

# -- measured figures ------------------------------------------------------------------------------------
# Peak GPU memory of one CFG step of the real transformer (random weights), 704x1248, 300 prompt tokens,
# one H200, docs/BENCHMARKS.md "The PAN 2 DiT per denoising step" (2026-12-02, `scripts/bench_dit.py`):
# (video tokens, peak GiB) at 121 / 241 / 481 frames, and the weights' GiB. The activation peak (peak less
# weights) is linear in the tokens to 0.01 GiB: bf16 161.7 KiB per token, fp8 124.7 KiB (its e4m3 copies of
# the activations replace bf16 ones).
MEASURED_TEXT_TOKENS = 300
MEASURED_DIT_PEAKS = {
    "bf16": (62.71, ((26598, 66.84), (52338, 70.81), (103818, 78.75))),
    "fp8": (40.72, ((26598, 44.02), (52338, 47.08), (103818, 53.20))),
}
# The VAE decoder's compiled kernel path, 704x1248, weights included: 5.80 GiB for 5 s, 5.86 GiB for 20 s (flat in
# the length, the chunk too: its high-resolution stages run a frame pair at a time); weights 1.10 GiB
# (docs/KERNEL_NOTES.md). The reference decoder (bf16): 23.99 GiB at chunks of 4 latent frames
# (docs/BENCHMARKS.md); its dependence on the chunk is an estimate (proportional above the weights), not measured.
MEASURED_PIXELS = 704 * 1248
DECODER_WEIGHT_BYTES = int(1.10 * GIB)
DECODER_KERNEL_PEAK_BYTES = int(5.86 * GIB)
DECODER_REFERENCE_PEAK_BYTES = int(23.99 * GIB)
DECODER_REFERENCE_CHUNK = 4

# -- allowances (not measured: upper bounds with room) ---------------------------------------------------
MARGIN_BYTES = 1 * GIB  # the allocator's rounding and fragmentation, cuBLAS/cuDNN workspaces
STREAM_BUFFERS = (
    3  # streamed layers on the device at once: in use, arriving, and one whose memory is not yet free
)
TEXT_ACTIVATION_BYTES = 1 * GIB  # the text model on ≤ 1.5 k tokens (a short prompt's measured peak: 0.1 GiB)
ENCODER_PEAK_BYTES = 4 * GIB  # the VAE encoder on one 704x1248 frame (image-to-video)
HOST_ALLOWANCE_BYTES = 4 * GIB  # the process itself: Python, torch, CUDA's host side, the readers' buffers
MAX_TEXT_TOKENS = 1536  # the text features PAN 2 keeps (`pan2cli.text.encoder.MAX_PROMPT_TOKENS`)
PCIE4_BYTES_PER_S = 25e9  # what a PCIe 4 x16 link moves host-to-device in practice


def spread(count: int, total: int) -> list[int]:
    """`count` of `total` layer indices, as evenly spaced as they go (the first one first): which layers stream,
    so that each streamed layer's copy has the compute of the resident ones before it to hide behind."""
    count = max(0, min(count, total))
    return [i * total // count for i in range(count)] if count else []


def _fit(weights_gib: float, points) -> tuple[float, float]:
    """Least-squares line (bytes, bytes per token) through the measured activation peaks."""
    xs = [tokens + MEASURED_TEXT_TOKENS for tokens, _ in points]
    ys = [(peak - weights_gib) * GIB for _, peak in points]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


ACTIVATION_FITS = {precision: _fit(*measured) for precision, measured in MEASURED_DIT_PEAKS.items()}


def activation_bytes(precision: str, tokens: int) -> int:
    """The DiT's activation peak for one pass over `tokens` (video + text) tokens (`MEASURED_DIT_PEAKS`)."""
    intercept, per_token = ACTIVATION_FITS[precision]
    return int(max(0.0, intercept) + per_token * tokens)


def decoder_bytes(kernel: bool, pixels: int, chunk: int, element_bytes: int = 2) -> int:
    """The VAE decoder's peak: the kernel path's (flat in chunk and length), or the reference's at `chunk` latent
    frames per pass; activations scale with the frame's pixels and the dtype's size (bf16 measured)."""
    scale = pixels / MEASURED_PIXELS * element_bytes / 2
    if kernel:
        return int(DECODER_WEIGHT_BYTES + (DECODER_KERNEL_PEAK_BYTES - DECODER_WEIGHT_BYTES) * scale)
    per_chunk = (DECODER_REFERENCE_PEAK_BYTES - DECODER_WEIGHT_BYTES) / DECODER_REFERENCE_CHUNK
    return int(DECODER_WEIGHT_BYTES + per_chunk * chunk * scale)


# -- inputs ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayeredSizes:
    """A model's bytes as loaded: each layer of its streamable list, and everything else."""

    layer_bytes: tuple[int, ...]
    other_bytes: int

    @property
    def total(self) -> int:
        return sum(self.layer_bytes) + self.other_bytes


@dataclass(frozen=True)
class RunShape:
    """What the largest job of the batch asks for.

    Attributes:
        precision: "bf16" or "fp8" (the transformer's).
        video_tokens: latent frames x (latent height / 2) x (latent width / 2) (PAN 2's 1x2x2 patches).
        pixels: height x width of a frame (the decoder's activations).
        frames: video frames (for the plan's line).
        guidance: whether a step runs two passes (classifier-free guidance).
        image: whether a job starts from an image (the VAE encoder runs).
        hidden_size: the transformer's D (a second pass's hidden states, `[N + L, D]` bf16).
        text_tokens: text tokens a pass may carry (at most `MAX_TEXT_TOKENS`).
    """

    precision: str
    video_tokens: int
    pixels: int
    frames: int
    guidance: bool = True
    image: bool = False
    hidden_size: int = 4096
    text_tokens: int = MAX_TEXT_TOKENS


# -- the plan ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class LayerPlan:
    """Which layers of a model stream (the rest resident) and what the stage needs on the GPU."""

    streamed: tuple[int, ...]
    layers: int
    stage_bytes: int  # predicted peak of the stage on the GPU
    streamed_bytes: int  # bytes of the streamed layers (page-locked host memory)

    @property
    def resident(self) -> int:
        return self.layers - len(self.streamed)


@dataclass(frozen=True)
class MemoryPlan:
    """The plan of a run (module docstring); `line()` says it, `record()` is the sidecar's."""

    budget_bytes: int
    cap_bytes: int | None
    free_bytes: int
    transformer: LayerPlan
    text_encoder: LayerPlan
    chunk_latent_frames: int
    decoder_kernel: bool
    bytes_per_step: int
    host_bytes: int  # page-locked (and, while the text model loads, plain) host memory at the busiest stage
    shape: RunShape
    reason: str
    notes: tuple[str, ...] = field(default=())

    def line(self) -> str:
        """One line for stderr: what was planned and why."""
        dit = self.transformer
        if not dit.streamed:
            where = f"all {dit.layers} transformer blocks resident"
        else:
            per_step = self.bytes_per_step / 1e9
            where = (
                f"{dit.resident} of {dit.layers} transformer blocks resident, {len(dit.streamed)} streamed from "
                f"{dit.streamed_bytes / GIB:.1f} GiB of page-locked host memory ({per_step:.1f} GB over the bus "
                f"per step, {per_step * 1e9 / PCIE4_BYTES_PER_S:.1f} s at PCIe 4's ~25 GB/s)"
            )
        text = self.text_encoder
        if text.streamed:
            where += f"; {len(text.streamed)} of the text encoder's {text.layers} layers streamed"
        notes = "".join(f"; {note}" for note in self.notes)
        return f"Memory plan: {where}: {self.reason}{notes}."

    def record(self) -> dict:
        """The sidecar's `memory_plan`."""
        dit, text = self.transformer, self.text_encoder
        return {
            "gpu_budget_gib": round(self.budget_bytes / GIB, 2),
            "max_gpu_memory_gib": round(self.cap_bytes / GIB, 2) if self.cap_bytes is not None else None,
            "gpu_free_gib": round(self.free_bytes / GIB, 2),
            "resident_blocks": dit.resident,
            "streamed_blocks": list(dit.streamed),
            "bytes_streamed_per_step": self.bytes_per_step,
            "pinned_host_gib": round(dit.streamed_bytes / GIB, 2),
            "predicted_denoising_peak_gib": round(dit.stage_bytes / GIB, 2),
            "text_encoder_streamed_layers": list(text.streamed),
            "decoder": "compiled kernel" if self.decoder_kernel else "reference",
            "chunk_latent_frames": self.chunk_latent_frames,
            "reason": self.reason,
        }


def plan_layers(sizes: LayeredSizes, fixed_bytes: int, budget: int, *, stream_all: bool = False,
                second_pass: int = 0) -> LayerPlan | None:  # fmt: skip
    """The fewest streamed layers with which a stage fits `budget`, or None when even streaming all does not.

    Args:
        sizes: the model's layers and other parts.
        fixed_bytes: what the stage needs besides the weights (activations, margin).
        budget: bytes the stage may use.
        stream_all: stream every layer (`--offload`).
        second_pass: the second guidance pass's hidden states, held while both passes run through each layer.
    """
    layers = len(sizes.layer_bytes)
    resident_all = sizes.total + fixed_bytes + second_pass
    if not stream_all and resident_all <= budget:
        return LayerPlan((), layers, resident_all, 0)
    in_flight = STREAM_BUFFERS * max(sizes.layer_bytes, default=0)
    base = sizes.other_bytes + fixed_bytes + second_pass + in_flight
    for count in range(layers if stream_all else 1, layers + 1):
        streamed = tuple(spread(count, layers))
        resident = sum(b for i, b in enumerate(sizes.layer_bytes) if i not in streamed)
        if base + resident <= budget:
            return LayerPlan(streamed, layers, base + resident, sum(sizes.layer_bytes[i] for i in streamed))
    return None


def _gib(nbytes: float) -> str:
    return f"{nbytes / GIB:.1f} GiB"


@dataclass(frozen=True)
class Alternative:
    """Another way to run the same jobs, named in an error when it would fit: e.g. `--precision fp8` and the
    transformer's sizes in fp8."""

    flag: str
    precision: str
    transformer: LayeredSizes


def _denoising_needs(shape: RunShape, precision: str) -> tuple[int, int]:
    """(the activation peak of one pass, what the second guidance pass adds when both run through a block)."""
    tokens = shape.video_tokens + shape.text_tokens
    second_pass = tokens * shape.hidden_size * 2 if shape.guidance else 0  # [N + L, D] bf16
    return activation_bytes(precision, tokens), second_pass


def _plan_denoising(
    shape, precision: str, sizes: LayeredSizes, budget: int, stream_all: bool
) -> LayerPlan | None:
    activations, second_pass = _denoising_needs(shape, precision)
    return plan_layers(sizes, activations, budget, stream_all=stream_all, second_pass=second_pass)


def plan_memory(
    *,
    shape: RunShape,
    transformer: LayeredSizes,
    text_encoder: LayeredSizes,
    free_bytes: int,
    cap_bytes: int | None,
    host: HostMemory | None,
    decoder_kernel: bool,
    chunk_latent_frames: int,
    vae_element_bytes: int = 2,
    stream_all: bool = False,
    alternatives: Sequence[Alternative] = (),
    decoder_beside_transformer: bool = False,
) -> MemoryPlan:
    """The plan of a run (module docstring).

    Args:
        shape: the largest job's demands.
        transformer, text_encoder: sizes as loaded (in the run's precision and dtype).
        free_bytes: the GPU's free memory now; cap_bytes: `--max-gpu-memory` (None: no cap).
        host: the host's memory (None: not checked).
        decoder_kernel: whether the compiled decoder will run (else the reference's peak, chunk by chunk).
        chunk_latent_frames: the decoder's chunk asked for (the plan may take a smaller one).
        vae_element_bytes: 2 (bf16) or 4 (float32).
        stream_all: `--offload`: every block streams.
        alternatives: other ways to run (`Alternative`), named in an error where they would fit.
        decoder_beside_transformer: the VAE decoder stays on the GPU while the transformer denoises (a batch
            that decodes each video as soon as it is sampled): its weights count in the denoising stage.

    Raises:
        InputError: a stage fits the GPU in no plan, or the host lacks the memory the plan page-locks.
    """
    budget = (min(free_bytes, cap_bytes) if cap_bytes is not None else free_bytes) - MARGIN_BYTES
    capped = cap_bytes is not None and cap_bytes < free_bytes
    gpu = f"{_gib(cap_bytes)} (--max-gpu-memory)" if capped else f"{_gib(free_bytes)} free"

    # 1. text encoding, 2. image encoding
    text = plan_layers(text_encoder, TEXT_ACTIVATION_BYTES, budget)
    if text is None:
        floor = (
            text_encoder.other_bytes
            + TEXT_ACTIVATION_BYTES
            + STREAM_BUFFERS * max(text_encoder.layer_bytes, default=0)
        )
        raise InputError(
            f"the text encoder needs {_gib(floor + MARGIN_BYTES)} of GPU memory even with its layers streamed; "
            f"the GPU has {gpu}",
            hint="a GPU with more memory, or a larger --max-gpu-memory",
        )
    if shape.image and ENCODER_PEAK_BYTES > budget:
        raise InputError(
            f"image-to-video's VAE encoder needs about {_gib(ENCODER_PEAK_BYTES + MARGIN_BYTES)}; the GPU has {gpu}",
            hint="a larger --max-gpu-memory, or text-to-video",
        )

    # 3. denoising
    if decoder_beside_transformer:
        budget_for_decoder = budget
        budget -= DECODER_WEIGHT_BYTES
    dit = _plan_denoising(shape, shape.precision, transformer, budget, stream_all)
    if dit is None:
        activations, second_pass = _denoising_needs(shape, shape.precision)
        floor = (
            transformer.other_bytes
            + activations
            + second_pass
            + STREAM_BUFFERS * max(transformer.layer_bytes, default=0)
        )
        hints = [
            alt.flag
            for alt in alternatives
            if _plan_denoising(shape, alt.precision, alt.transformer, budget, True)
        ]
        raise InputError(
            f"denoising {shape.frames} frames in {shape.precision} needs {_gib(floor + MARGIN_BYTES)} of GPU memory "
            f"even with every transformer block streamed (activations {_gib(activations)}); the GPU has {gpu}",
            hint="; ".join([*hints, "fewer frames or a smaller --size", "a larger --max-gpu-memory"]),
        )

    # 4. decode: the chunk asked for, or the largest that fits
    if decoder_beside_transformer:
        budget = budget_for_decoder
    chunk = chunk_latent_frames
    while chunk > 1 and decoder_bytes(decoder_kernel, shape.pixels, chunk, vae_element_bytes) > budget:
        chunk -= 1
    if decoder_bytes(decoder_kernel, shape.pixels, chunk, vae_element_bytes) > budget:
        raise InputError(
            f"the VAE decoder needs about {_gib(decoder_bytes(decoder_kernel, shape.pixels, 1, vae_element_bytes) + MARGIN_BYTES)} "
            f"at one latent frame per pass; the GPU has {gpu}",
            hint="a smaller --size, or a larger --max-gpu-memory",
        )
    notes = (
        [f"decoder chunk {chunk} latent frames, not {chunk_latent_frames}"]
        if chunk < chunk_latent_frames
        else []
    )

    # Streamed blocks run both guidance passes while on the GPU (`forward_passes`): once per step over the bus.
    # A text model that streams is read to host memory whole, then page-locked layer by layer.
    text_host = text_encoder.total if text.streamed else 0
    plan = MemoryPlan(
        budget, cap_bytes, free_bytes, dit, text, chunk, decoder_kernel, dit.streamed_bytes,
        max(text_host, dit.streamed_bytes), shape, _reason(stream_all, dit, transformer, shape, gpu), tuple(notes),
    )  # fmt: skip
    if host is not None and plan.host_bytes and plan.host_bytes + HOST_ALLOWANCE_BYTES > host.available:
        hints = []
        for alt in alternatives:
            other = _plan_denoising(shape, alt.precision, alt.transformer, budget, stream_all)
            if other is not None and other.streamed_bytes < dit.streamed_bytes:
                hints.append(f"{alt.flag} page-locks {_gib(other.streamed_bytes)}")
        hints.append("a larger --max-gpu-memory keeps more on the GPU and less in host memory")
        held = []
        if dit.streamed:
            held.append(
                f"{len(dit.streamed)} of the {dit.layers} transformer blocks ({_gib(dit.streamed_bytes)})"
            )
        if text.streamed:
            held.append(
                f"the text encoder while {len(text.streamed)} of its layers stream ({_gib(text_host)})"
            )
        raise InputError(
            f"the memory plan holds {' and, before them, '.join(held)} in host memory: "
            f"{_gib(plan.host_bytes + HOST_ALLOWANCE_BYTES)} with the process's own, and the host has "
            f"{host.describe()}",
            hint="; ".join(hints),
        )
    return plan


def _reason(stream_all: bool, dit: LayerPlan, sizes: LayeredSizes, shape: RunShape, gpu: str) -> str:
    activations, _ = _denoising_needs(shape, shape.precision)
    if stream_all:
        return "--offload streams every block"
    if not dit.streamed:
        return f"weights {_gib(sizes.total)} and {shape.frames} frames' activations {_gib(activations)} fit {gpu}"
    need = _gib(sizes.total + activations + MARGIN_BYTES)
    return (
        f"{shape.frames} frames in {shape.precision} need {need} with every block resident; the GPU has {gpu}"
    )
