"""Which fp8 attention a model runs, chosen once per run, and the record of what its calls ran.

Three kernels compute the fp8 tier's joint attention from the same e4m3 Q and K:

* "cuda": pan2's CUDA kernel (`cuda_fp8_attention`; sm_90 GPUs, head dim 128; per-head V scale, bf16 out),
  in the instantiation its table picks for the GPU and token count. The default where it runs: the fastest
  and as accurate as the Triton kernel (docs/BENCHMARKS.md).
* "triton": pan2's Triton kernel (`fp8_attention_kernel`; any GPU with fp8 tensor cores, any power-of-two
  head dim; per-head V scale, bf16 out). The default elsewhere.
* "cudnn": cuDNN's fp8 SDPA through cudnn-frontend (`cudnn_fp8_attention`; one V scale for all heads and an
  e4m3 output: the least accurate of the three), only when asked for.

`RuntimeConfig.fp8_attention` asks for one of them or "auto"; `resolve_fp8_attention` turns that into the
kernel that runs (building the CUDA kernel's extension, and falling back to the Triton kernel with the reason
where "auto" finds it cannot be built), once per run, when the model is prepared; `use_fp8_attention` hands it
to every block. Each call records what it ran (`Fp8AttentionRun`), so `fp8_attention_ran` (the sidecar's
`ran.fp8_attention`) says what actually ran, not what was asked for: nothing where the fp8 attention did not
run (a bf16 model, or the bf16 attention of a sequence-parallel split).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch

from pan2cli.errors import InputError, KernelBuildError

KERNELS = ("cuda", "triton", "cudnn")
# What each kernel is, in the words of `pan2 doctor` and the notes.
DESCRIPTIONS = {
    "cuda": "pan2's CUDA fp8 attention",
    "triton": "pan2's Triton fp8 attention",
    "cudnn": "cuDNN's fp8 attention (one V scale per tensor, e4m3 output)",
    "emulation": "the PyTorch emulation of the fp8 attention",
}


@dataclass(frozen=True)
class Fp8AttentionChoice:
    """The kernel a run's fp8 attention takes (`KERNELS`), why in a few words, and whether it stands in for the
    default that could not be built here (`fallback`: worth a line on stderr)."""

    kernel: str
    reason: str
    fallback: bool = False


def resolve_fp8_attention(
    requested: str, device: torch.device, head_dim: int, *, build: bool = True
) -> Fp8AttentionChoice:
    """The kernel that runs a model's fp8 attention on `device` for `requested` (`RuntimeConfig.fp8_attention`).

    Args:
        requested: "auto" (the CUDA kernel where it runs and builds, else the Triton kernel), "cuda", "triton"
            or "cudnn".
        device: where the model runs.
        head_dim: the model's head dim (PAN 2's is 128).
        build: build (or load) the CUDA kernel's extension now, so that a failed build is known before the
            first step; False (`pan2 doctor`) decides from the GPU alone.

    Raises:
        InputError: "cuda" where it cannot run, "cudnn" without cudnn-frontend, or an unknown name.
        KernelBuildError: "cuda" and its extension failed to build.
    """
    from pan2cli.dit import cuda_fp8_attention as cuda

    if requested == "triton":
        return Fp8AttentionChoice("triton", "asked for (--fp8-attention triton)")
    if requested == "cudnn":
        from pan2cli.dit.cudnn_fp8_attention import cudnn_frontend

        cudnn_frontend()  # raises the error that says how to install it
        return Fp8AttentionChoice("cudnn", "asked for (--fp8-attention cudnn)")
    if requested not in ("auto", "cuda"):
        raise InputError(
            f"--fp8-attention {requested!r} is not an fp8 attention", hint="use auto, cuda, triton or cudnn"
        )
    why_not = cuda.why_not_runnable(device, head_dim)
    if requested == "cuda":
        if why_not is not None:
            raise InputError(
                f"--fp8-attention cuda: pan2's CUDA fp8 attention cannot run here: {why_not}",
                hint="--fp8-attention auto (the default) runs the Triton kernel where the CUDA one does not",
            )
        if build:
            cuda.extension_ops(device)
        return Fp8AttentionChoice("cuda", "asked for (--fp8-attention cuda)")
    if why_not is not None:
        return Fp8AttentionChoice("triton", f"pan2's CUDA fp8 attention does not run here: {why_not}")
    if build:
        try:
            cuda.extension_ops(device)
        except KernelBuildError as error:  # the Triton kernel runs instead, and the reason is said
            return Fp8AttentionChoice(
                "triton", f"pan2's CUDA fp8 attention could not be built: {error}", True
            )
    return Fp8AttentionChoice("cuda", "the default on sm_90 GPUs with head dim 128")


class Fp8AttentionRun:
    """A model's fp8 attention: the choice its calls take, and a count of what each call ran."""

    def __init__(self, choice: Fp8AttentionChoice | None):
        self.choice = choice  # None: resolved ("auto") at the first call
        self.calls: Counter[tuple[str, object]] = Counter()  # (kernel, instantiation or None) → calls

    def ran(self, kernel: str, instantiation=None) -> None:
        self.calls[kernel, instantiation] += 1


def use_fp8_attention(model: torch.nn.Module, choice: Fp8AttentionChoice) -> None:
    """Every fp8 block of `model` runs `choice` from now on; the record of what ran starts empty."""
    run = Fp8AttentionRun(choice)
    for block in model.transformer_blocks:
        block.attn.fp8_attention = run


def fp8_attention_run(attn, device: torch.device) -> Fp8AttentionRun:
    """`attn`'s run record, with a choice: "auto" resolved here, once per module, for a model that was
    quantised without `use_fp8_attention` (the library used directly)."""
    if attn.fp8_attention is None:
        attn.fp8_attention = Fp8AttentionRun(None)
    run = attn.fp8_attention
    if run.choice is None:
        run.choice = resolve_fp8_attention("auto", device, attn.head_dim)
    return run


def reset_fp8_attention_record(model: torch.nn.Module) -> None:
    """Forget what the fp8 attention ran so far (before a video's denoising)."""
    for run in _runs(model):
        run.calls.clear()


def fp8_attention_ran(model: torch.nn.Module) -> dict | None:
    """What the fp8 attention calls of `model` ran since the last reset, for the sidecar: `kernel` (several
    joined by "+" if they differed), `why` (the choice's reason), `calls`, and for the CUDA kernel its
    `instantiations` (stages, ping_pong, producer, key_tile and calls each); None where no fp8 attention ran."""
    calls: Counter[tuple[str, object]] = Counter()
    reasons = []
    for run in _runs(model):
        calls.update(run.calls)
        chosen_ran = run.choice is not None and any(kernel == run.choice.kernel for kernel, _ in run.calls)
        if chosen_ran and run.choice.reason not in reasons:  # the emulation (CPU) was chosen by no one
            reasons.append(run.choice.reason)
    if not calls:
        return None
    kernels = list(dict.fromkeys(kernel for kernel, _ in calls))
    instantiations = [
        {**instantiation.record(), "calls": count}
        for (_, instantiation), count in calls.items()
        if instantiation is not None
    ]
    return {
        "kernel": "+".join(kernels),
        "why": "; ".join(reasons) or None,
        "calls": sum(calls.values()),
        "instantiations": instantiations,
    }


def _runs(model: torch.nn.Module) -> list[Fp8AttentionRun]:
    blocks = getattr(model, "transformer_blocks", ())  # a stand-in model (tests) may have none
    runs = (getattr(getattr(block, "attn", None), "fp8_attention", None) for block in blocks)
    return list({id(run): run for run in runs if run is not None}.values())
