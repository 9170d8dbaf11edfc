"""The gated delta rule of Qwen3.5's linear-attention layers (Gated DeltaNet), computed chunk by chunk.

Per head, with a `d_k x d_v` state S (zero at the start), for each token t:

    S ← exp(g_t) · S                      (the decay, g_t ≤ 0)
    S ← S + β_t · k_t (v_t − Sᵀ k_t)ᵀ      (the delta rule: write only what S does not already predict)
    o_t = Sᵀ q_t

Within a chunk of C tokens whose state starts as S₀ and with γ_i the cumulative log decay up to token i, the
writes δ_i = β_i (v_i − (decayed state)ᵀ k_i) solve one unit lower-triangular system,

    (I + A) δ = β v − β e^γ (k S₀),    A_ij = β_i e^(γ_i − γ_j) k_i·k_j  (j < i),

so a chunk costs two triangular solves and a few matrix products instead of C sequential updates; then
o_i = e^(γ_i) S₀ᵀ q_i + Σ_(j ≤ i) e^(γ_i − γ_j) (q_i·k_j) δ_j and the state passes on to the next chunk as
e^(γ_C) S₀ + Σ_j e^(γ_C − γ_j) k_j δ_jᵀ. This is the algorithm (chunks of 64, float32) of transformers'
`torch_chunk_gated_delta_rule`, the code Qwen3.5 runs where the flash-linear-attention kernels are not
installed; `tests/pipeline/test_qwen3_5.py` holds it against the token-by-token recurrence above in float64.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk, as transformers' fallback and the FLA kernels


def gated_delta_rule(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    log_decay: torch.Tensor,
    beta: torch.Tensor,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """The outputs o_t of the rule (module docstring) for every token, from a zero state.

    Args:
        query, key: `[B, H, L, d_k]`, already L2-normalised (and the query scaled by d_k^-½).
        value: `[B, H, L, d_v]`.
        log_decay: g, `[B, H, L]`, ≤ 0.
        beta: β, `[B, H, L]`, in (0, 1).
        chunk: tokens per chunk (the result does not depend on it beyond rounding).

    Returns:
        `[B, H, L, d_v]` in the inputs' dtype (float32 in Qwen3.5: it casts them first).
    """
    batch, heads, length, d_k = key.shape
    d_v = value.shape[-1]
    pad = (-length) % chunk  # zero tokens at the end: no decay, no write, so nothing reaches the real ones
    if pad:
        query, key, value = (F.pad(x, (0, 0, 0, pad)) for x in (query, key, value))
        log_decay, beta = (F.pad(x, (0, pad)) for x in (log_decay, beta))
    chunks = (length + pad) // chunk
    q, k, v = (x.reshape(batch, heads, chunks, chunk, x.shape[-1]) for x in (query, key, value))
    gamma = log_decay.reshape(batch, heads, chunks, chunk).cumsum(-1)
    b = beta.reshape(batch, heads, chunks, chunk, 1)

    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=key.device).tril()
    # e^(γ_i − γ_j) for j ≤ i; the other half masked before exp (γ_i − γ_j > 0 there could overflow).
    pair_decay = torch.where(causal, gamma[..., :, None] - gamma[..., None, :], -torch.inf).exp()
    system = (b * pair_decay * (k @ k.transpose(-1, -2))).tril(-1) + torch.eye(
        chunk, dtype=key.dtype, device=key.device
    )
    writes = torch.linalg.solve_triangular(system, b * v, upper=False, unitriangular=True)
    state_reads = torch.linalg.solve_triangular(
        system, b * k * gamma.exp()[..., None], upper=False, unitriangular=True
    )
    within = (q @ k.transpose(-1, -2)) * pair_decay  # token i reading chunk token j ≤ i
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    chunk_decay = gamma[..., -1].exp()[..., None, None]

    state = torch.zeros(batch, heads, d_k, d_v, dtype=value.dtype, device=value.device)
    out = torch.empty_like(v)
    for c in range(chunks):  # the only sequential part: the state from chunk to chunk
        delta = writes[:, :, c] - state_reads[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + within[:, :, c] @ delta
        state = state * chunk_decay[:, :, c] + k_to_end[:, :, c].transpose(-1, -2) @ delta
    return out.reshape(batch, heads, chunks * chunk, d_v)[:, :, :length]
