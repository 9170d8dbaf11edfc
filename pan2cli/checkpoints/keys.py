"""Strict checks of a checkpoint's tensors against a model's: which keys are missing, unexpected or mis-shaped."""

from __future__ import annotations

from typing import Iterable, Mapping

from pan2cli.errors import CheckpointError


def listing(keys: Iterable[str], limit: int = 8) -> str:
    """Up to `limit` keys, sorted, comma-separated, with a count of the rest."""
    keys = sorted(keys)
    return ", ".join(keys[:limit]) + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def key_problems(
    shapes: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    accepted_prefixes: tuple[str, ...] = (),
) -> list[str]:
    """What keeps `shapes` (checkpoint key -> shape) from loading strictly into `expected` (model key -> shape).

    Keys starting with `accepted_prefixes` are not counted as unexpected. Returns one phrase per kind
    of problem ("missing keys: …", "unexpected keys: …", "wrong shapes: …"); empty when it loads.
    """
    present = set(shapes)
    missing = set(expected) - present
    unexpected = {k for k in present - set(expected) if not k.startswith(accepted_prefixes)}
    misshaped = {k for k in present & set(expected) if tuple(shapes[k]) != tuple(expected[k])}
    problems = [f"missing keys: {listing(missing)}"] if missing else []
    problems += [f"unexpected keys: {listing(unexpected)}"] if unexpected else []
    if misshaped:
        problems.append(
            "wrong shapes: "
            + listing(f"{k} {list(shapes[k])} (expected {list(expected[k])})" for k in misshaped)
        )
    return problems


def check_keys(
    shapes: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    mismatch: str,
    *,
    accepted_prefixes: tuple[str, ...] = (),
    hint: str | None = None,
) -> None:
    """Raise `CheckpointError("<mismatch> (<problems>)")` unless `shapes` loads strictly into `expected`.

    Args:
        mismatch: what does not match, e.g. "model.safetensors does not match the Wan2.2 VAE encoder".
        accepted_prefixes: see `key_problems`.
    """
    problems = key_problems(shapes, expected, accepted_prefixes)
    if problems:
        raise CheckpointError(f"{mismatch} ({'; '.join(problems)})", hint=hint)
