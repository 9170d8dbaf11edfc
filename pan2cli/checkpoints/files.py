"""Read tensor files: safetensors (lazily, memory-mapped) and torch pickles (`weights_only=True`), with one
wording of their failures for every caller (checkpoints raise `CheckpointError`, latents `InputError`).
"""

from __future__ import annotations

import pickle
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping

import torch

from pan2cli.errors import CheckpointError, InputError

# safetensors' dtype names (its header's "dtype" field).
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class ReadErrors:
    """How a reader's failures are told.

    Attributes:
        error: the class raised (`CheckpointError`, or `InputError` for a user's input file).
        noun: what the file is, e.g. "latents file": messages then say "latents file PATH ..." and
            "(truncated or not a latents file)"; None: "PATH ..." and the format's own name.
        loads: what pan2 loads with `weights_only=True`, for the message about pickled objects.
        hint: the hint of every failure.
        objects_hint: the hint for pickled objects other than tensors (None: `hint`).
    """

    error: type[InputError] = CheckpointError
    noun: str | None = None
    loads: str = "checkpoints"
    hint: str | None = None
    objects_hint: str | None = None

    def name(self, path: Path) -> str:
        return f"{self.noun} {path}" if self.noun else str(path)

    def empty(self, path: Path) -> InputError:
        return self.error(f"{self.name(path)} is empty (0 bytes)", hint=self.hint)

    def unreadable(self, path: Path, exc: BaseException, kind: str) -> InputError:
        message = f"{self.name(path)} could not be read (truncated or not a {self.noun or kind})"
        detail = _loader_detail(exc)
        return self.error(f"{message}: {detail}" if detail else message, hint=self.hint)

    def objects(self, path: Path) -> InputError:
        return self.error(
            f"{self.name(path)} holds objects other than plain tensors; pan2 loads {self.loads} with weights_only=True",
            hint=self.objects_hint or self.hint,
        )

    def tensor(self, path: Path, key: str, exc: BaseException) -> InputError:
        return self.error(f"{self.name(path)}: tensor {key} could not be read (truncated file?): {exc}")


CHECKPOINT_ERRORS = ReadErrors()


@dataclass(frozen=True)
class TensorFile:
    """Every tensor's shape and dtype in a file, and a loader for the ones needed (large files stay on disk).

    Attributes:
        path: the file.
        shapes, dtypes: tensor name → shape / dtype (from a safetensors header: no tensor is read).
        load: tensor name → the tensor (safetensors: read from the memory-mapped file when asked).
        metadata: a safetensors file's string metadata (empty for pickles).
    """

    path: Path
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]
    load: Callable[[str], torch.Tensor]
    metadata: dict[str, str] = field(default_factory=dict)


def read_tensor_file(path: Path, errors: ReadErrors = CHECKPOINT_ERRORS) -> TensorFile:
    """A `.safetensors` file, or else a torch pickle of a state dict (see `read_state_dict`)."""
    if Path(path).suffix.lower() == ".safetensors":
        return read_safetensors(path, errors)
    return read_state_dict(path, errors)


def read_safetensors(path: Path, errors: ReadErrors = CHECKPOINT_ERRORS) -> TensorFile:
    """The header of a safetensors file, the file memory-mapped once for every later `load`.

    Raises:
        errors.error: empty, truncated or not safetensors; a tensor that cannot be read (on `load`).
    """
    # Imported here: `.pt` users never pay for it, and tests can swap `safetensors.safe_open`.
    from safetensors import safe_open

    path = Path(path)
    _check_not_empty(path, errors)
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
        shapes, dtypes = {}, {}
        for key in handle.keys():
            sliced = handle.get_slice(key)
            shapes[key] = tuple(sliced.get_shape())
            dtypes[key] = SAFETENSORS_DTYPES.get(sliced.get_dtype(), torch.uint8)
        metadata = dict(handle.metadata() or {})
    except MemoryError:
        raise
    except Exception as exc:  # safetensors raises its own SafetensorError, OSErrors and others
        raise errors.unreadable(path, exc, "safetensors file") from exc

    def load(key: str) -> torch.Tensor:
        try:
            return handle.get_tensor(key)
        except MemoryError:
            raise
        except Exception as exc:
            raise errors.tensor(path, key, exc) from exc

    return TensorFile(path, shapes, dtypes, load, metadata)


def tensor_reader(
    files: Mapping[str, Path], errors: ReadErrors = CHECKPOINT_ERRORS
) -> Callable[[str], torch.Tensor]:
    """Tensor name → the tensor, from the safetensors file holding it (`files`), each file memory-mapped once."""
    opened = {path: read_safetensors(path, errors) for path in sorted(set(files.values()))}
    return lambda key: opened[files[key]].load(key)


def _torch_load(path: Path, mmap: bool) -> object:
    """`torch.load` on the CPU, tensors only. A plain pickle (not torch.save's) makes torch warn in two lines
    about its protocol before the one-line error that says what is wrong with the file: not that warning."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)


def read_pickle(path: Path, errors: ReadErrors = CHECKPOINT_ERRORS, *, mmap: bool = False) -> object:
    """`torch.load(path, weights_only=True)` on the CPU: whatever the file holds (tensors, dicts, numbers).

    Args:
        mmap: keep the tensors' storage on disk (the 2.8 GB VAE); legacy (non-zip) pickles are read whole.

    Raises:
        errors.error: empty, truncated or not a torch file, or objects other than plain tensors.
    """
    path = Path(path)
    _check_not_empty(path, errors)
    try:
        try:
            return _torch_load(path, mmap)
        except RuntimeError as exc:
            if not mmap or "mmap" not in str(exc):
                raise
            return _torch_load(path, False)
    except MemoryError:
        raise
    except pickle.UnpicklingError as exc:
        if _refused_object(path, exc):
            raise errors.objects(path) from exc
        raise errors.unreadable(path, exc, "checkpoint") from exc
    # torch.load surfaces corrupt or foreign files as many types (RuntimeError for a bad zip, EOFError,
    # KeyError for a text file, ValueError, OSError ...): all mean "not this kind of file".
    except Exception as exc:
        raise errors.unreadable(path, exc, "checkpoint") from exc


def read_state_dict(path: Path, errors: ReadErrors = CHECKPOINT_ERRORS) -> TensorFile:
    """A torch pickle of a flat state dict (or of `{"state_dict": ...}`), memory-mapped where it can be.

    Raises:
        errors.error: see `read_pickle`; anything but a mapping of names to tensors.
    """
    obj = read_pickle(path, errors, mmap=True)
    if isinstance(obj, Mapping) and isinstance(obj.get("state_dict"), Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise errors.error(f"{errors.name(Path(path))} is not a state dict of tensors", hint=errors.hint)
    state = dict(obj)
    return TensorFile(
        Path(path),
        {k: tuple(v.shape) for k, v in state.items()},
        {k: v.dtype for k, v in state.items()},
        state.__getitem__,
    )


def float_tensor(tensor: torch.Tensor, where: str, key: str) -> torch.Tensor:
    """`tensor` itself if it is floating-point (a model's parameters are), else a `CheckpointError`."""
    if not tensor.is_floating_point():
        raise CheckpointError(f"{where}: tensor {key} has dtype {tensor.dtype}, expected a float")
    return tensor


def _check_not_empty(path: Path, errors: ReadErrors) -> None:
    # Both loaders report a 0-byte file with a confusing message of their own.
    if path.stat().st_size == 0:
        raise errors.empty(path)


def _refused_object(path: Path, exc: pickle.UnpicklingError) -> bool:
    """Tell "weights_only refused a class" from "these bytes are not a pickle at all".

    Both raise UnpicklingError. A refused class names an unsupported global; a rejected pickle inside a
    well-formed torch.save zip is also an object the unpickler refused.
    """
    text = str(exc)
    if "Unsupported global" in text or "Unsupported class" in text:
        return True
    return zipfile.is_zipfile(path)


def _loader_detail(exc: BaseException) -> str:
    """One short line from the loader's message, or "" when it would only confuse.

    torch.load reports a text file as a bare KeyError (e.g. "101") and random bytes as a weights_only
    refusal that advises weights_only=False, which is wrong advice here.
    """
    text = str(exc).strip()
    if isinstance(exc, KeyError) or not text or text.startswith("Weights only load failed"):
        return ""
    return text.splitlines()[0][:200]
