"""Logits -> probabilities -> tokens.

This module is the one place where logits become probabilities: the target's p, the draft's q
and plain autoregressive sampling all go through `logits_to_probs`, so the verifier always sees
exactly the distribution a token was drawn from (docs/ARCHITECTURE.md section 1).

Sampling is inverse-CDF with one uniform per row drawn from that row's own generator, so a
seeded request reproduces regardless of its batch mates or its position in the batch.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["logits_to_probs", "sample", "inverse_cdf_sample", "uniforms"]


def logits_to_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Turn logits [B, V] into probabilities [B, V] (float32), one parameter set per row.

    temperature [B]: 0 gives a one-hot at the argmax (first maximum on ties).
    top_k [B]: keep the k most likely tokens (<= 0 or >= V: off); ties at the boundary keep
        exactly k tokens, lower token ids first.
    top_p [B]: then keep the smallest set of most likely tokens whose (top-k renormalized) mass
        is >= top_p, always at least one (>= 1: off). The kept mass is renormalized.
    """
    logits = logits.float()
    vocab = logits.shape[-1]
    device = logits.device
    temperature = temperature.to(device=device, dtype=torch.float32)
    top_k = top_k.to(device=device, dtype=torch.long)
    top_p = top_p.to(device=device, dtype=torch.float32)

    greedy = temperature <= 0
    scale = torch.where(greedy, torch.ones_like(temperature), temperature)
    probs = torch.softmax(logits / scale[:, None], dim=-1)

    filtered = ((top_k > 0) & (top_k < vocab)) | (top_p < 1)
    if bool((filtered & ~greedy).any()):
        probs = _top_k_top_p(probs, top_k, top_p)
    if bool(greedy.any()):
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], one_hot, probs)
    return probs


def _top_k_top_p(probs: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Zero all but the top-k / top-p tokens of each row and renormalize (rows may be off)."""
    vocab = probs.shape[-1]
    # Stable descending sort: among equal probabilities the lower token id ranks first.
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    rank = torch.arange(vocab, device=probs.device)
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    keep = rank[None, :] < k[:, None]
    kept = sorted_probs * keep
    kept = kept / kept.sum(dim=-1, keepdim=True)
    mass_before = kept.cumsum(dim=-1) - kept
    keep &= (mass_before < top_p[:, None]) | (top_p[:, None] >= 1)
    keep_by_token = torch.zeros_like(keep).scatter_(-1, order, keep)
    out = probs * keep_by_token
    return out / out.sum(dim=-1, keepdim=True)


def uniforms(
    generators: Sequence[torch.Generator | None], n: int, device: torch.device | str | None = None
) -> Tensor:
    """n uniforms in [0, 1) per row [B, n] (float64), row b drawn from generators[b].

    A None generator draws from the global RNG. The draws of a row depend only on its own
    generator, never on its batch mates; a generator shared by rows is consumed in row order.
    """
    if all(g is None for g in generators):
        return torch.rand(len(generators), n, dtype=torch.float64, device=device)
    rows = [
        torch.rand(n, dtype=torch.float64, generator=g, device=g.device if g is not None else device)
        for g in generators
    ]
    return torch.stack([r.to(device) for r in rows]) if device is not None else torch.stack(rows)


def inverse_cdf_sample(probs: Tensor, u: Tensor) -> Tensor:
    """Token [B] (long) with cdf[t-1] <= u * total < cdf[t], for u [B] in [0, 1).

    The CDF is accumulated in float64 and probs need not be normalized. A token of probability 0
    is never returned: at equal CDF values the first index wins, and if rounding pushes the
    threshold past the end the last token of positive probability is taken.
    """
    cdf = probs.double().cumsum(dim=-1)
    threshold = (u.to(device=cdf.device, dtype=torch.float64) * cdf[:, -1]).unsqueeze(-1)
    token = torch.searchsorted(cdf, threshold, right=True).squeeze(-1)
    vocab = probs.shape[-1]
    last_positive = vocab - 1 - (probs > 0).flip(-1).int().argmax(dim=-1)
    return torch.where(token >= vocab, last_positive, token)


def sample(probs: Tensor, generators: Sequence[torch.Generator | None]) -> Tensor:
    """Draw one token per row of probs [B, V] using one uniform from that row's generator.

    Greedy rows (one-hot probs) return their argmax and still consume one uniform: every row
    always consumes exactly one uniform per sampled token.
    """
    if probs.shape[0] != len(generators):
        raise ValueError(f"{probs.shape[0]} rows of probabilities but {len(generators)} generators")
    u = uniforms(generators, 1, device=probs.device)[:, 0]
    return inverse_cdf_sample(probs, u)
