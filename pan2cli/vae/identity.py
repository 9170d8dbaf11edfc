"""Which VAE a latents file belongs to: `pan2 generate --save-latents` records the identity of the VAE its latents
were made for (`vae_identity`), and `pan2 decode` refuses to decode them with another (`check_latents_vae`).

Latents decoded with another VAE give a video, and a wrong one: the identity holds where the VAE came from (to name
it), its decoder's architecture and latent statistics (exact), and a signature of its weights (the biases of
`post_quant_conv` and of the decoder's `conv_out`, 60 values, compared within 1 % of their largest: the same VAE
stored in bf16, fp16 or fp32, in the original or diffusers layout, matches; one trained or initialised otherwise
does not). A file without the record (an older pan2, another tool) decodes as before.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Mapping

from pan2cli.errors import InputError

# The decoder's architecture: what decides how latents become pixels (the encoder's width does not).
_ARCHITECTURE = (
    "z_dim",
    "decoder_base_dim",
    "dim_mult",
    "num_res_blocks",
    "temperal_downsample",
    "is_residual",
    "out_channels",
    "patch_size",
    "scale_factor_spatial",
    "scale_factor_temporal",
)
_SIGNATURE_TENSORS = ("post_quant_conv.bias", "decoder.conv_out.bias")
# bf16 storage moves a value by at most 2**-9 of itself; another training or seed moves the biases by their size.
_SIGNATURE_TOLERANCE = 0.01


def _statistics_hash(config) -> str:
    """16 hex digits of the SHA-256 of the latent statistics (`latents_mean`, `latents_std`)."""
    text = json.dumps([list(config.latents_mean), list(config.latents_std)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def vae_identity(
    spec: str | Path | None, revision: str | None = None, *, name: str | None = None
) -> dict[str, Any]:
    """The identity of a VAE, as a latents file records it (plain values, for `torch.load(weights_only=True)`).

    Args:
        spec, revision: the VAE, as `--vae` and `--revision` take it (`resolve_vae_checkpoint`).
        name: what to call it (what `--vae` takes to load it again); default `spec`.

    Returns:
        `{"vae": name, "revision": …, "architecture": {field: value}, "latent_statistics": hash, "signature": [60
        floats]}`.
    """
    from pan2cli.vae.checkpoint import read_decoder_tensors, resolve_vae_checkpoint

    checkpoint = resolve_vae_checkpoint(spec, revision)
    tensors = read_decoder_tensors(checkpoint)
    config = tensors.config
    # a checkpoint without these tensors (which does not load either) has no signature to compare
    signature = []
    if all(key in tensors.shapes for key in _SIGNATURE_TENSORS):
        signature = [
            float(v) for key in _SIGNATURE_TENSORS for v in tensors.load(key).float().flatten().tolist()
        ]
    return {
        "vae": str(name if name is not None else checkpoint.source),
        "revision": revision,
        "architecture": {field: _plain(getattr(config, field)) for field in _ARCHITECTURE},
        "latent_statistics": _statistics_hash(config),
        "signature": signature,
    }


def _plain(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value


def _well_formed(record: Any) -> bool:
    """Whether `record` has the fields of `vae_identity`'s records (a damaged or foreign one does not)."""
    return (
        isinstance(record, Mapping)
        and isinstance(record.get("architecture"), Mapping)
        and set(_ARCHITECTURE) <= set(record["architecture"])
        and isinstance(record.get("latent_statistics"), str)
        and isinstance(record.get("signature"), list)
    )


def identity_mismatch(made_for: Mapping[str, Any], other: Mapping[str, Any]) -> str | None:
    """How the VAE `other` differs from the one latents were `made_for` (both `vae_identity` records), or None.

    A record that is not a mapping of the expected fields (another tool's, a damaged one) compares as no record.
    """
    if not (_well_formed(made_for) and _well_formed(other)):
        return None
    try:
        theirs, ours = made_for["architecture"], other["architecture"]
        for field in _ARCHITECTURE:
            if theirs.get(field) != ours.get(field):
                return f"its {field} is {ours.get(field)}, not {theirs.get(field)}"
        if made_for["latent_statistics"] != other["latent_statistics"]:
            return "its latent statistics (latents_mean, latents_std) are others"
        a, b = [float(x) for x in made_for["signature"]], [float(x) for x in other["signature"]]
    except (KeyError, TypeError, AttributeError, ValueError):
        return None
    scale = max((abs(x) for x in (*a, *b)), default=0.0)
    if not (a and b):
        return None
    if len(a) != len(b) or any(abs(x - y) > _SIGNATURE_TOLERANCE * scale for x, y in zip(a, b)):
        return "its weights are others (the biases of post_quant_conv and conv_out differ)"
    return None


def check_latents_vae(
    path: Path, made_for: Mapping[str, Any] | None, vae: Mapping[str, Any], vae_flag: str
) -> None:
    """Refuse latents made for another VAE than `vae` (the identity of `pan2 decode`'s `--vae`, named by `vae_flag`);
    nothing to check without a record.

    Raises:
        InputError: the VAE differs, naming both and how (exit 2), with the `--vae` that decodes them.
    """
    if not isinstance(made_for, Mapping):
        return
    problem = identity_mismatch(made_for, vae)
    if problem is None:
        return
    theirs = made_for.get("vae", "another VAE")
    revision = f" --revision {made_for['revision']}" if made_for.get("revision") else ""
    raise InputError(
        f"latents file {path} was made for the VAE {theirs}, and --vae {vae_flag} is another: {problem}",
        hint=f"decode it with --vae {theirs}{revision}",
    )
