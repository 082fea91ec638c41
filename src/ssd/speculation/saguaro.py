"""Saguaro sampling: bend the draft's proposal toward outcomes the speculation cache holds (docs/ARCHITECTURE.md 1.2).

At a rejection the verifier draws the bonus token from the residual norm(max(p - q, 0)). The
speculation cache holds, for each k, the draft's top-F_k tokens at that position: it hits when the
bonus lands among them. Saguaro sampling has the draft propose from

    q' proportional to q with its top-F tokens multiplied by C in [0, 1]

instead of q. Lowering q on the top-F tokens raises max(p - q', 0) there, so more of the residual
mass (and more bonus tokens) falls on cached candidates: more cache hits, at some cost in
acceptance (the proposal strays from the draft's best guess). C = 1 is plain sampling; C = 0 never
proposes a top-F token.

Why it stays exact. Rejection sampling emits exactly the target distribution for ANY proposal
distribution, provided the verifier's ratio test min(1, p/q') and residual max(p - q', 0) use the
distribution the token was actually drawn from. The draft therefore samples from q' and ships q'
(not q) to the verifier; q is only used to pick which tokens to scale and to rank cache candidates.
Verifying a q'-sampled token against q is the pitfall: it is not exact (tests show the error).
"""
from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["saguaro_proposal", "top_mask", "top_ranks"]


def top_ranks(q: Tensor) -> Tensor:
    """rank[..., v] = position of token v in q's descending order (0 = most likely).

    Ties rank the lower token id first (a stable sort), the same rule as the sampler's top-k and
    `cache.ranked_tokens`, so "top-F" names the same tokens everywhere.
    """
    order = torch.sort(q, dim=-1, descending=True, stable=True).indices
    positions = torch.arange(q.shape[-1], device=q.device).expand_as(order)
    return torch.empty_like(order).scatter_(-1, order, positions)


def top_mask(q: Tensor, fan_out: Tensor) -> Tensor:
    """top_ranks(q) < fan_out[..., None], without sorting the whole vocabulary: a top-k for the
    threshold value, then ties at the threshold taken lowest token id first (the same rule)."""
    f = fan_out.expand(q.shape[:-1])
    fmax = int(f.max()) if f.numel() else 0
    if fmax <= 0:
        return torch.zeros_like(q, dtype=torch.bool)
    fmax = min(fmax, q.shape[-1])
    vals = q.topk(fmax, dim=-1).values
    thr = vals.gather(-1, (f.clamp(1, fmax) - 1)[..., None])
    above = q > thr
    need = (f.clamp(max=fmax)[..., None] - above.sum(-1, keepdim=True))
    ties = q == thr
    top = above | (ties & (ties.cumsum(-1) <= need))
    return top & (f[..., None] > 0)


def saguaro_proposal(q: Tensor, fan_out: int | Tensor, c: float) -> Tensor:
    """q' over the last dim: q with its top-fan_out tokens scaled by c, renormalized.

    q [..., V]: the draft's (normalized) distributions. fan_out: an int, or a long tensor
    broadcastable to q.shape[:-1] (e.g. [K] for F_k per draft position k). c in [0, 1].

    c = 1 or fan_out = 0 returns q unchanged. A row whose scaled mass is (numerically) zero, i.e.
    below the dtype's eps (c = 0 and all of q's mass sits in its top-F: a one-hot or very peaked
    q), falls back to q for that row; this is still exact, since whatever is returned is what the
    draft samples from and what the verifier must be given.
    """
    if not 0.0 <= c <= 1.0:
        raise ValueError(f"Saguaro scale C must be in [0, 1], got {c}")
    fan_out = torch.as_tensor(fan_out, device=q.device)
    if fan_out.dtype.is_floating_point or bool((fan_out < 0).any()):
        raise ValueError(f"fan_out must be a non-negative integer (tensor), got {fan_out}")
    if c == 1.0 or not bool((fan_out > 0).any()):
        return q
    top = top_mask(q, fan_out.long())
    scaled = torch.where(top, q * c, q)
    mass = scaled.sum(dim=-1, keepdim=True)
    usable = mass > torch.finfo(scaled.dtype).eps
    return torch.where(usable, scaled / torch.where(usable, mass, torch.ones_like(mass)), q)
