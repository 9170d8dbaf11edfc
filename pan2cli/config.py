"""What to generate and how to run it: `GenerationSettings`, `settings_with` (the one precedence of settings),
`RuntimeConfig` and `runtime_with` (the one precedence of run-time options).

`GenerationSettings` is everything that decides one video; its fields are a preset file's keys (`pan2cli.presets`
reads them into it). `settings_with` layers values over a base: preset < command-line flags < prompt-file
record. `RuntimeConfig` is how the models run (device, dtypes, engines, chunk size, offload), which does not
change the video; a preset names two of its options too (`precision`, `chunk_latent_frames`), and `runtime_with`
resolves them: given > preset > default. Every value is checked once, here (`RULES`), whichever way it arrived.

torch-free: the CLI builds these before any model loads (`pan2 --help` does not import torch).
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple

from pan2cli.constants import (
    DTYPE_NAMES,
    SIZE_MULTIPLE,
    VAE_TEMPORAL_FACTOR,
    latent_frames,
    latent_shape,
    valid_frames,
    valid_seed,
    valid_size,
)
from pan2cli.errors import InputError
from pan2cli.outputs import FPS_RANGE, fps_problem

if TYPE_CHECKING:
    import torch

SAMPLERS = ("euler",)
# The compiled CUDA decoder: "auto" where it applies, "off" the reference decoder, "require" fail when it cannot run.
DECODE_KERNEL_MODES = ("auto", "off", "require")
# Where the initial noise is drawn (`RuntimeConfig.generator_device`); None: on the device that runs the model.
GENERATOR_DEVICES = ("cpu", "cuda")
# The DiT's arithmetic (`RuntimeConfig.precision`): bf16 as released, or the fp8 tier (pan2cli.dit.quantize).
PRECISIONS = ("bf16", "fp8")
# The fp8 tier's attention (`RuntimeConfig.fp8_attention`, pan2cli.dit.fp8_attention_choice): "auto" picks pan2's
# CUDA kernel on sm_90 GPUs with head dim 128 and pan2's Triton kernel elsewhere; cuDNN's only when asked for.
FP8_ATTENTIONS = ("auto", "cuda", "triton", "cudnn")
# Latent frames per VAE decoder pass after the first: the output does not depend on it, the memory does.
DEFAULT_CHUNK_LATENT_FRAMES = 4


class Rule(NamedTuple):
    """What a field's value must be: its type(s), what that is called, and a requirement on the value."""

    types: type | tuple[type, ...]
    what: str
    ok: Callable[[Any], bool] | None = None  # None: any value of the type; never called with None
    requirement: str = ""
    hint: str | None = None  # what to pass instead, shown under the error


def _positive_number(value: float) -> bool:
    return math.isfinite(value) and value > 0


_POSITIVE_NUMBER = Rule((int, float), "a number", _positive_number, "must be a finite number > 0")
_DTYPE = Rule(
    (str, type(None)), "a dtype name", lambda v: v in DTYPE_NAMES, f"must be one of: {', '.join(DTYPE_NAMES)}"
)

_SIZE_HINT = "PAN 2's own size is 704x1248 (height x width, --size HxW); sizes are multiples of 32"

# Every checked field, by name: of GenerationSettings, of a preset (`pan2cli.presets.Preset`) and of RuntimeConfig.
# bool is a subclass of int, but `frames = true` is a mistake, not 1: bools pass only where a bool is wanted.
RULES: dict[str, Rule] = {
    "prompt": Rule(str, "a string"),
    "frames": Rule(
        int,
        "an integer",
        valid_frames,
        "must be 1 + 4*k (e.g. 121, 241, 481): the Wan2.2 VAE decodes 1 + 4*(latent frames - 1) frames",
        "121 frames are 5 s at 24 fps, 241 are 10 s, 481 are 20 s; --duration SECONDS picks the frames",
    ),
    "height": Rule(
        int, "an integer", valid_size, f"must be a positive multiple of {SIZE_MULTIPLE}", _SIZE_HINT
    ),
    "width": Rule(
        int, "an integer", valid_size, f"must be a positive multiple of {SIZE_MULTIPLE}", _SIZE_HINT
    ),
    "fps": Rule((int, float), "a number", lambda v: fps_problem(v) is None, f"must be {FPS_RANGE}"),
    "steps": Rule(int, "an integer", lambda v: v >= 1, "must be >= 1"),
    "guidance": _POSITIVE_NUMBER,
    "flow_shift": Rule((int, float, type(None)), "a number", _positive_number, "must be a finite number > 0"),
    "seed": Rule(int, "an integer", valid_seed, "must be between 0 and 2**64 - 1"),
    "sampler": Rule(str, "a string", lambda v: v in SAMPLERS, f"must be one of: {', '.join(SAMPLERS)}"),
    "negative_prompt": Rule(str, "a string"),
    "image": Rule((str, os.PathLike, type(None)), "a path"),
    # a preset's own
    "name": Rule(str, "a string", lambda v: bool(v.strip()), "must not be empty"),
    "description": Rule(str, "a string"),
    # RuntimeConfig (a preset names its chunk too; None in a RuntimeConfig: the preset's, `runtime_with`)
    "chunk_latent_frames": Rule((int, type(None)), "an integer", lambda v: v >= 1, "must be >= 1"),
    "device": Rule((str, type(None)), "a device name"),
    "dtype": _DTYPE,
    "vae_dtype": _DTYPE,
    "decode_kernel": Rule(
        str,
        "a string",
        lambda v: v in DECODE_KERNEL_MODES,
        f"must be one of: {', '.join(DECODE_KERNEL_MODES)}",
    ),
    "decode_kernel_parallel": Rule(bool, "True or False"),
    "dit_fused_kernels": Rule(bool, "True or False"),
    "offload": Rule(bool, "True or False"),
    "max_gpu_memory_gib": Rule(
        (int, float, type(None)), "a number of GiB", _positive_number, "must be a finite number > 0"
    ),
    "precision": Rule(
        (str, type(None)),
        "a precision name",
        lambda v: v in PRECISIONS,
        f"must be one of: {', '.join(PRECISIONS)}",
    ),
    "fp8_attention": Rule(
        str, "a string", lambda v: v in FP8_ATTENTIONS, f"must be one of: {', '.join(FP8_ATTENTIONS)}"
    ),
    "generator_device": Rule(
        (str, type(None)),
        "a device type",
        lambda v: v in GENERATOR_DEVICES,
        f"must be one of: {', '.join(GENERATOR_DEVICES)} (or None: the device that runs the model)",
    ),
}


def value_problem(name: str, value: Any) -> str | None:
    """What is wrong with `value` for field `name` (its type first, then its value), or None."""
    types, what, ok, requirement, _ = RULES[name]
    types = types if isinstance(types, tuple) else (types,)
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        return f"'{name}' must be {what}, got {type(value).__name__} {value!r}"
    if ok is not None and value is not None and not ok(value):
        return f"invalid '{name}' = {value!r}: {requirement}"
    return None


def _check_fields(obj: Any) -> None:
    """Raise one InputError naming every invalid field of the dataclass `obj`, with their rules' hints (a
    field without a rule, a preset's `source`, is its class's to check)."""
    problems = {
        field.name: problem
        for field in dataclasses.fields(obj)
        if field.name in RULES
        and (problem := value_problem(field.name, getattr(obj, field.name))) is not None
    }
    if problems:
        hints = dict.fromkeys(RULES[name].hint for name in problems if RULES[name].hint)  # each once
        raise InputError("; ".join(problems.values()), hint="; ".join(hints) or None)


@dataclass(frozen=True, kw_only=True)
class GenerationSettings:
    """Everything that decides one video; the JSON sidecar records it. Checked on construction.

    The fields between `prompt` and `image` are a preset file's keys, in its order.

    Attributes:
        prompt: The text ("" in a preset), given to the text encoder as it is (surrounding whitespace too).
        frames: Video frames, 1 + 4 * (latent frames - 1), as the Wan2.2 VAE requires.
        height, width: Video size in pixels, multiples of 32.
        fps: Frames per second of the written video.
        steps: Denoising steps.
        guidance: Classifier-free guidance scale (≤ 1: no negative pass).
        flow_shift: Timestep shift s of the flow-matching schedule σ' = s·σ/(1+(s−1)·σ); None: the checkpoint's
            (`shift` of its `scheduler/scheduler_config.json`).
        seed: Random seed, 0 <= seed < 2**64.
        sampler: Sampler name, one of `SAMPLERS`.
        negative_prompt: Negative prompt for classifier-free guidance ("" for none).
        image: Start image (image-to-video), or None.

    Raises:
        InputError: On construction, naming every field with the wrong type or an invalid value.
    """

    prompt: str = ""
    frames: int
    height: int
    width: int
    fps: float
    steps: int
    guidance: float
    flow_shift: float | None = None
    seed: int
    sampler: str
    negative_prompt: str
    image: Path | None = None

    def __post_init__(self) -> None:
        _check_fields(self)
        for name in ("guidance", "flow_shift"):
            # Floats even when a file says `guidance = 3`, so that dumps are consistent.
            if getattr(self, name) is not None:
                object.__setattr__(self, name, float(getattr(self, name)))
        if self.image is not None:
            object.__setattr__(self, "image", Path(self.image))

    @property
    def latent_frames(self) -> int:
        """Latent frames the VAE decodes into `frames` video frames."""
        return latent_frames(self.frames)

    @property
    def latent_shape(self) -> tuple[int, int, int, int, int]:
        """Shape of the Wan2.2 VAE latent: `[1, 48, 1 + (F − 1)/4, H/16, W/16]`."""
        return latent_shape(self.frames, self.height, self.width)

    @property
    def duration_s(self) -> float:
        """Video length in seconds (`frames / fps`; 121 frames at 24 fps is 5.04 s)."""
        return self.frames / self.fps


SETTINGS_FIELDS = tuple(field.name for field in dataclasses.fields(GenerationSettings))


def frames_for_duration(duration: float, fps: float) -> int:
    """Video frames for `duration` seconds: `4·round(duration·fps/4) + 1` (5 s at 24 fps → 121)."""
    return VAE_TEMPORAL_FACTOR * round(duration * fps / VAE_TEMPORAL_FACTOR) + 1


def settings_with(base: GenerationSettings, *layers: Mapping[str, Any]) -> GenerationSettings:
    """`base` with each layer's values over it, later layers winning: preset < flags < prompt-file record.

    The one place settings take precedence. A None value never overrides. `duration` (seconds) stands for
    `frames` = `frames_for_duration(duration, fps)` at the resulting fps; a layer giving either replaces an
    earlier layer's length (a record's duration wins over `--frames`), and one layer may not give both.

    Args:
        base: The settings to start from, e.g. a `Preset` (its name and other preset fields are left behind).
        layers: Mappings of `GenerationSettings` field names (and `duration`) to values.

    Returns:
        Plain, checked `GenerationSettings`.

    Raises:
        InputError: `frames` and `duration` in one layer, a duration that is no positive number, or an
            invalid value.
        TypeError: A name that is no setting.
    """
    values = {name: getattr(base, name) for name in SETTINGS_FIELDS}
    for layer in layers:
        if layer.get("frames") is not None and layer.get("duration") is not None:
            raise InputError("--frames and --duration both set the length", hint="pass one of them")
    given = {name: value for name, (_, value) in given_settings(*layers).items()}
    duration = given.pop("duration", None)
    values.update(given)
    if duration is not None:
        if (
            isinstance(duration, bool)
            or not isinstance(duration, (int, float))
            or not _positive_number(duration)
        ):
            raise InputError(f"--duration {duration} must be a positive number of seconds")
        if value_problem("fps", values["fps"]) is None:  # otherwise the check below names the fps
            if not math.isfinite(duration * values["fps"]):  # 1e308 s: no frame count (and no OverflowError)
                raise InputError(
                    f"a duration of {duration:g} s at {values['fps']:g} fps is more frames than any number can hold",
                    hint=f"the duration is in seconds: 5 gives {frames_for_duration(5, values['fps'])} frames at "
                    f"{values['fps']:g} fps",
                )
            values["frames"] = frames_for_duration(duration, values["fps"])
    return GenerationSettings(**values)


def given_settings(*layers: Mapping[str, Any]) -> dict[str, tuple[int, Any]]:
    """The values the layers give over the base, as `settings_with` takes them: name → (index of the layer whose
    value wins, value). None gives nothing; a layer giving the length (`frames` or `duration`) drops an earlier
    layer's. The sidecar's `overrides` are these, with where each came from."""
    given: dict[str, tuple[int, Any]] = {}
    for index, layer in enumerate(layers):
        values = {name: value for name, value in layer.items() if value is not None}
        if values.keys() & {"frames", "duration"}:
            given.pop("frames", None)
            given.pop("duration", None)
        given.update((name, (index, value)) for name, value in values.items())
    return given


@dataclass(frozen=True)
class RuntimeConfig:
    """How the models run, not what they generate: the same video whatever these are (up to rounding), but
    `generator_device`, which decides the noise a seed gives.

    Attributes:
        device: `cuda`, `cuda:N` or `cpu`; None: cuda when available.
        dtype: "bf16" or "fp32" for the DiT and the text encoder (the decoder of `pan2 decode`); None: bf16
            on CUDA, fp32 on the CPU.
        vae_dtype: The VAE's dtype in `pan2 generate`; None: the same as `dtype`.
        decode_kernel: The compiled CUDA decoder, one of `DECODE_KERNEL_MODES`: "auto" uses it wherever it
            applies (CUDA, sm_90a/sm_100a/sm_103a, bf16), otherwise the reference with one line saying
            why; "off" always the reference; "require" fails (exit 1) when the kernel cannot run.
        decode_kernel_parallel: When several processes decode one video, split its rows across them
            (one halo row exchanged per 3x3 convolution: exact); False: every rank decodes the whole video.
        dit_fused_kernels: The Triton fusions of the MMDiT where they apply (CUDA with Triton,
            power-of-two head_dim); the PyTorch ops elsewhere.
        offload: Keep every one of the DiT's blocks in page-locked host memory and stream them to the device
            one at a time: same output, a fraction of the memory. Without it the memory plan
            (`pan2cli.pipeline.memory_plan`) streams as many blocks as the GPU (or `max_gpu_memory_gib`) needs.
        max_gpu_memory_gib: The most GPU memory (GiB) the run may allocate (`--max-gpu-memory`): the memory plan
            keeps every stage under it (streaming the transformer's blocks and the text encoder's layers, a
            smaller decoder chunk where needed) and the process is capped there
            (`torch.cuda.set_per_process_memory_fraction`); None: the GPU's free memory.
        chunk_latent_frames: Latent frames per VAE decoder pass after the first (the first is one frame);
            the output does not depend on it, larger chunks use more memory and give larger GEMMs. None: the
            preset's, else `DEFAULT_CHUNK_LATENT_FRAMES` (`runtime_with`).
        generator_device: Where the initial noise is drawn, one of `GENERATOR_DEVICES`: None on the device
            that runs the model (a CUDA generator on a GPU), as IFM's vLLM-Omni runner and the diffusers
            reference draw it, so that a seed gives their video; "cpu" as a CPU run, or a vLLM-Omni request
            with `generator_device="cpu"`; "cuda" as a GPU run (on GPUs with as many SMs: the CUDA draw of a
            large tensor depends on the SM count).
        precision: The DiT's arithmetic, one of `PRECISIONS`: "bf16" as released, or "fp8" (e4m3 linears and
            attention in the 44 blocks, quantised at load; lossy, about twice bf16's speed on fp8 tensor cores:
            `pan2cli.dit.quantize`); fp8 needs a CUDA GPU with fp8 tensor cores (`check_precision`). None: the
            preset's, else bf16 (`runtime_with`).
        fp8_attention: The fp8 tier's attention, one of `FP8_ATTENTIONS`: "auto" (pan2's CUDA kernel on sm_90 GPUs
            with head dim 128, pan2's Triton kernel elsewhere), "cuda", "triton" or "cudnn" (cuDNN's, through
            nvidia-cudnn-frontend: one V scale per tensor and e4m3 output, less accurate); resolved once per run
            when the model is prepared (`pan2cli.dit.fp8_attention_choice`); unused in bf16.

    Raises:
        InputError: On construction, naming every field with the wrong type or an invalid value.
    """

    device: str | None = None
    dtype: str | None = None
    vae_dtype: str | None = None
    decode_kernel: str = "auto"
    decode_kernel_parallel: bool = True
    dit_fused_kernels: bool = True
    offload: bool = False
    max_gpu_memory_gib: float | None = None
    chunk_latent_frames: int | None = None
    generator_device: str | None = None
    precision: str | None = None
    fp8_attention: str = "auto"

    def __post_init__(self) -> None:
        _check_fields(self)

    def check_precision(self, device: torch.device, given_by: str = "--precision fp8") -> None:
        """Raise `InputError` when `precision` cannot run on `device` (fp8 on the CPU, or a GPU without fp8
        tensor cores) or the fp8 attention asked for cannot (`fp8_attention`), before anything loads; the message
        starts with `given_by`, what asked for fp8 (the flag, or `preset NAME sets precision = "fp8"`)."""
        if self.precision != "fp8":
            return
        if not self.dit_fused_kernels:
            raise InputError(
                f"{given_by}: fp8 runs with the fused DiT kernels (they write its e4m3 activations)",
                hint="drop --no-dit-fused-kernels, or run with --precision bf16",
            )
        from pan2cli.devices import compute_capability, fp8_unsupported_reason

        reason = fp8_unsupported_reason(device)
        if reason is not None:
            raise InputError(f"{given_by}: {reason}", hint="run with --precision bf16 (the default)")
        if self.fp8_attention == "cuda" and compute_capability(device) != (9, 0):
            major, minor = compute_capability(device)
            raise InputError(
                f"--fp8-attention cuda: pan2's CUDA fp8 attention runs on sm_90 GPUs (H100, H200), this one is "
                f"sm_{major}{minor}",
                hint="--fp8-attention auto (the default) runs the Triton kernel here",
            )
        if self.fp8_attention == "cudnn":
            import importlib.util

            if importlib.util.find_spec("cudnn") is None:
                raise InputError(
                    "--fp8-attention cudnn: cuDNN's fp8 attention needs nvidia-cudnn-frontend, which is not installed",
                    hint="pip install 'pan2cli[fp8]', or leave --fp8-attention at auto",
                )

    def torch_generator_device(self, device: torch.device) -> torch.device:
        """Where the initial noise is drawn for a model on `device` (checked: cuda without CUDA is bad input)."""
        from pan2cli.devices import resolve_generator_device

        return resolve_generator_device(self.generator_device, device)

    def torch_device(self) -> torch.device:
        """The device to run on (checked: a CUDA device that does not exist is bad input)."""
        from pan2cli.devices import resolve_device

        return resolve_device(self.device)

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        """The DiT / text encoder dtype (the decoder's in `pan2 decode`) on `device`."""
        from pan2cli.devices import resolve_dtype

        return resolve_dtype(self.dtype, device)

    def torch_vae_dtype(self, device: torch.device) -> torch.dtype:
        """The VAE's dtype in `pan2 generate` on `device`."""
        from pan2cli.devices import resolve_dtype

        return resolve_dtype(self.vae_dtype if self.vae_dtype is not None else self.dtype, device)


# The run-time options a preset names too, and their defaults where neither the caller nor the preset sets them.
PRESET_RUNTIME_DEFAULTS = {"precision": "bf16", "chunk_latent_frames": DEFAULT_CHUNK_LATENT_FRAMES}


def runtime_with(preset: Any | None, given: RuntimeConfig) -> RuntimeConfig:
    """`given` with the options a preset names too (`precision`, `chunk_latent_frames`) resolved: the given value
    (a flag, an argument), else the preset's, else the default (`PRESET_RUNTIME_DEFAULTS`).

    The one place run-time options take precedence; `pan2 generate` and `VideoGenerator` both call it. Its
    result has every such option set (never None).

    Args:
        preset: a `pan2cli.presets.Preset` (its `precision` may be None: not in the file), or None (no preset:
            the defaults).
        given: the options as given; None where left to the preset.
    """
    resolved = {
        name: next(v for v in (getattr(given, name), getattr(preset, name, None), default) if v is not None)
        for name, default in PRESET_RUNTIME_DEFAULTS.items()
    }
    return dataclasses.replace(given, **resolved)


def runtime_given(given: RuntimeConfig) -> dict[str, Any]:
    """The options a preset names too that `given` sets over it (for the sidecar's `overrides`)."""
    return {name: value for name in PRESET_RUNTIME_DEFAULTS if (value := getattr(given, name)) is not None}
