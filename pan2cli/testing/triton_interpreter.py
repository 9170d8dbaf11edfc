"""Two fixes to Triton 3.6's CPU interpreter (`TRITON_INTERPRET=1`) that the fp8 kernels' CPU tests need.

1. A loop over a run-time bound (`for n in range(0, n_keys, BLOCK)`) fails with NumPy ≥ 2.4: the interpreter
   turns a scalar argument into a one-element array and calls `int()` on it, which NumPy no longer allows
   for arrays of one dimension.
2. Its float → fp8 cast is not round-to-nearest-even: a value that rounds up across a power of two loses the
   carry into the exponent (124.8 → 64 instead of 128), and nothing saturates. On a GPU the cast is
   `cvt.rn.satfinite` (nearest even, clamped to ±448 for e4m3). The fixed cast goes through torch's
   conversion (nearest even) after clamping to the format's largest finite value, as the GPU does.

`apply()` patches the interpreter in this process (idempotent); the GPU path is untouched.
"""

from __future__ import annotations

import numpy as np
import torch

_FP8 = {"fp8e4nv": torch.float8_e4m3fn, "fp8e5": torch.float8_e5m2}
_applied = False


def apply() -> None:
    """Patch the interpreter (see the module docstring); a no-op without Triton or when already applied."""
    global _applied
    if _applied:
        return
    try:
        import triton.runtime.interpreter as interpreter
    except ImportError:
        return
    patch_tensor = interpreter._patch_lang_tensor

    def patch_tensor_with_index(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interpreter._patch_lang_tensor = patch_tensor_with_index

    builder = interpreter.InterpreterBuilder
    fp_to_fp = builder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        target = _FP8.get(getattr(dst_type.scalar, "name", ""))
        if target is None or src.dtype.scalar.primitive_bitwidth == 8:
            return fp_to_fp(self, src, dst_type, rounding_mode)
        values = torch.from_numpy(np.ascontiguousarray(src.data).astype(np.float32))
        limit = torch.finfo(target).max
        cast = values.clamp(-limit, limit).to(target).view(torch.uint8).numpy()
        return interpreter.TensorHandle(cast, dst_type.scalar)

    builder.create_fp_to_fp = create_fp_to_fp
    _applied = True
