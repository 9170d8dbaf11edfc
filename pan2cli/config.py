"""How to run the models: `RuntimeConfig` (device, dtypes, decode engine, row split, DiT fusions, offload, chunk size).

A `RuntimeConfig` does not change the video (up to rounding); what to generate comes from a preset. Its values
are checked once, here (`RULES`).

torch-free: the CLI builds it before any model loads (`pan2 --help` does not import torch).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, NamedTuple

from pan2cli.constants import DTYPE_NAMES
from pan2cli.errors import InputError

if TYPE_CHECKING:
    import torch

# The compiled CUDA decoder: "auto" where it applies, "off" the reference decoder, "require" fail when it cannot run.
DECODE_KERNEL_MODES = ("auto", "off", "require")
# Latent frames per VAE decoder pass after the first: the output does not depend on it, the memory does.
DEFAULT_CHUNK_LATENT_FRAMES = 4


class Rule(NamedTuple):
    """What a field's value must be: its type(s), what that is called, and a requirement on the value."""

    types: type | tuple[type, ...]
    what: str
    ok: Callable[[Any], bool] | None = None  # None: any value of the type; never called with None
    requirement: str = ""


_DTYPE = Rule(
    (str, type(None)), "a dtype name", lambda v: v in DTYPE_NAMES, f"must be one of: {', '.join(DTYPE_NAMES)}"
)

# Every checked field, by name. bool is a subclass of int, but `chunk_latent_frames = true` is a mistake, not 1:
# bools pass only where a bool is wanted.
RULES: dict[str, Rule] = {
    "chunk_latent_frames": Rule(int, "an integer", lambda v: v >= 1, "must be >= 1"),
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
}


def value_problem(name: str, value: Any) -> str | None:
    """What is wrong with `value` for field `name` (its type first, then its value), or None."""
    types, what, ok, requirement = RULES[name]
    types = types if isinstance(types, tuple) else (types,)
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        return f"'{name}' must be {what}, got {type(value).__name__} {value!r}"
    if ok is not None and value is not None and not ok(value):
        return f"invalid '{name}' = {value!r}: {requirement}"
    return None


def _check_fields(obj: Any) -> None:
    """Raise one InputError naming every invalid field of the dataclass `obj`."""
    problems = [
        problem
        for field in dataclasses.fields(obj)
        if field.name in RULES
        and (problem := value_problem(field.name, getattr(obj, field.name))) is not None
    ]
    if problems:
        raise InputError("; ".join(problems))


@dataclass(frozen=True)
class RuntimeConfig:
    """How the models run, not what they generate: the same video whatever these are (up to rounding).

    Attributes:
        device: `cuda`, `cuda:N` or `cpu`; None: cuda when available.
        dtype: "bf16" or "fp32" for the DiT and the text encoder (the decoder of `pan2 decode`); None: bf16
            on CUDA, fp32 on the CPU.
        vae_dtype: The VAE's dtype in `pan2 generate`; None: the same as `dtype`.
        decode_kernel: The compiled CUDA decoder, one of `DECODE_KERNEL_MODES`.
        decode_kernel_parallel: When several processes decode one video, split its rows across them.
        dit_fused_kernels: The Triton fusions of the MMDiT where they apply (CUDA with Triton,
            power-of-two head_dim); the PyTorch ops elsewhere.
        offload: Keep the DiT's blocks in (pinned) host memory and stream them to the device one at a
            time: same output, a fraction of the memory.
        chunk_latent_frames: Latent frames per VAE decoder pass after the first.

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
    chunk_latent_frames: int = DEFAULT_CHUNK_LATENT_FRAMES

    def __post_init__(self) -> None:
        _check_fields(self)

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
