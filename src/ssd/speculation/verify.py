"""Rejection-sampling verification of drafted tokens (docs/ARCHITECTURE.md section 1).

For each row, draft tokens d_1..d_K were drawn from proposal distributions q_1..q_K and the
target scored them with p_1..p_{K+1}. Token d_j is accepted while u_j < min(1, p_j(d_j) / q_j(d_j));
at the first rejection the bonus token is drawn from the residual norm(max(p_j - q_j, 0)); if
every proposed token is accepted the bonus is drawn from the next target distribution. The
emitted tokens are then distributed exactly as the target's, for ANY proposal q, provided q is
the distribution the tokens were actually drawn from:

- a deterministic proposal (argmax draft, n-gram, cached chain) is a one-hot q: d is accepted
  with probability p(d) and the residual is norm(max(p - onehot(d), 0));
- greedy decoding needs no special path: at temperature 0 the target p is a one-hot at its
  argmax, so d is accepted iff it is the argmax and the bonus is the argmax.

Everything here is a pure function, vectorized over the batch and the draft positions.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ssd.layers.sampler import inverse_cdf_sample

__all__ = ["VerifyResult", "acceptance_prob", "residual", "verify", "verify_with_generators"]


@dataclass(frozen=True)
class VerifyResult:
    """Per row: the first accepted_len draft tokens are accepted, then bonus_token follows."""

    accepted_len: Tensor  # [B] long, in [0, num_draft]
    bonus_token: Tensor  # [B] long


def acceptance_prob(p_tok: Tensor, q_tok: Tensor) -> Tensor:
    """min(1, p/q) elementwise: the probability of accepting a token given p(d) and q(d).

    q(d) = 0 means d could not have been proposed from q: the caller broke the contract and no
    choice is exact. We take the limit of p/q as q -> 0: accept (1) if the target gives the token
    any probability, never (0) if it gives none. A token with p(d) = 0 is never accepted.
    """
    proposable = q_tok > 0
    ratio = p_tok / torch.where(proposable, q_tok, torch.ones_like(q_tok))
    return torch.where(proposable, ratio.clamp(max=1), (p_tok > 0).to(ratio.dtype))


def residual(p: Tensor, q: Tensor) -> Tensor:
    """norm(max(p - q, 0)) over the last dim: the bonus distribution after a rejection.

    Its mass equals the rejection probability, so when it is (numerically) zero a rejection has
    (numerically) zero probability; we then fall back to p rather than divide by zero.
    """
    diff = (p - q).clamp(min=0)
    mass = diff.sum(dim=-1, keepdim=True)
    has_mass = mass > torch.finfo(diff.dtype).eps
    return torch.where(has_mass, diff / torch.where(has_mass, mass, torch.ones_like(mass)), p.to(diff.dtype))


def verify(
    target_probs: Tensor,
    draft_probs: Tensor,
    draft_tokens: Tensor,
    accept_u: Tensor,
    bonus_u: Tensor,
    num_draft: Tensor | None = None,
) -> VerifyResult:
    """Verify one round of drafts against the target.

    target_probs [B, K+1, V]: p_1..p_{K+1}; draft_probs [B, K, V]: q_1..q_K, the distributions the
    draft tokens [B, K] were drawn from; accept_u [B, K] and bonus_u [B]: uniforms in [0, 1).
    num_draft [B] (default K): row b proposed only its first num_draft[b] <= K tokens; later
    positions are ignored and, once all proposed tokens are accepted, the bonus is drawn from p at
    position num_draft[b].
    """
    batch, positions, vocab = target_probs.shape
    k = positions - 1
    _check_shapes(batch, k, vocab, draft_probs, draft_tokens, accept_u, bonus_u)
    device = target_probs.device
    if num_draft is None:
        num_draft = torch.full((batch,), k, dtype=torch.long, device=device)
    num_draft = num_draft.to(device=device, dtype=torch.long)

    proposed = torch.arange(k, device=device)[None, :] < num_draft[:, None]
    tokens = torch.where(proposed, draft_tokens.long(), 0).unsqueeze(-1)
    p_tok = target_probs[:, :k].gather(-1, tokens).squeeze(-1)
    q_tok = draft_probs.gather(-1, tokens).squeeze(-1)
    accepted = proposed & (accept_u < acceptance_prob(p_tok, q_tok))
    accepted_len = accepted.long().cumprod(dim=1).sum(dim=1)

    rows = torch.arange(batch, device=device)
    p_next = target_probs[rows, accepted_len]
    if k > 0:
        rejected = accepted_len < num_draft
        q_rejected = draft_probs[rows, accepted_len.clamp(max=k - 1)]
        bonus_dist = torch.where(rejected[:, None], residual(p_next, q_rejected), p_next)
    else:
        bonus_dist = p_next
    return VerifyResult(accepted_len=accepted_len, bonus_token=inverse_cdf_sample(bonus_dist, bonus_u))


def verify_with_generators(
    target_probs: Tensor,
    draft_probs: Tensor,
    draft_tokens: Tensor,
    generators: Sequence[torch.Generator | None],
    num_draft: Tensor | None = None,
) -> VerifyResult:
    """`verify` with uniforms drawn per row from that row's generator (None: global RNG).

    Row b draws num_draft[b] accept uniforms then one bonus uniform (K + 1 without num_draft),
    whatever it accepts: its random stream depends only on its own proposals, never on the draft
    lengths of its batch mates.
    """
    B, k = target_probs.shape[0], target_probs.shape[1] - 1
    nd = [k] * B if num_draft is None else [int(n) for n in num_draft.tolist()]
    accept_u = torch.ones(B, k, dtype=torch.float64)
    bonus_u = torch.empty(B, dtype=torch.float64)
    for b, g in enumerate(generators):
        r = torch.rand(nd[b] + 1, dtype=torch.float64, generator=g, device=g.device if g is not None else None)
        accept_u[b, :nd[b]] = r[:nd[b]].cpu()
        bonus_u[b] = r[nd[b]]
    dev = target_probs.device
    return verify(target_probs, draft_probs, draft_tokens, accept_u.to(dev), bonus_u.to(dev), num_draft)


def _check_shapes(
    batch: int, k: int, vocab: int, draft_probs: Tensor, draft_tokens: Tensor, accept_u: Tensor, bonus_u: Tensor
) -> None:
    expected = {
        "draft_probs": (draft_probs, (batch, k, vocab)),
        "draft_tokens": (draft_tokens, (batch, k)),
        "accept_u": (accept_u, (batch, k)),
        "bonus_u": (bonus_u, (batch,)),
    }
    for name, (tensor, shape) in expected.items():
        if tuple(tensor.shape) != shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {shape} "
                f"(B, K, V = {batch}, {k}, {vocab})"
            )
