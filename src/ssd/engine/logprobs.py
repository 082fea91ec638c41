"""Token log-probabilities of committed tokens (`SamplingParams.logprobs`).

Every mode reports the same thing: at each committed position, the target's distribution that
position's token is drawn from — the warped one (temperature, top-k, top-p) when sampling, so
filtered-out tokens have -inf; for a greedy request (temperature 0, whose warped distribution is a
point mass) the model's plain softmax. AR computes it from its decode logits, the verifier from the
same logits rows of the verification forward; so the values agree across modes (bitwise on the
batch-invariant CPU kernels, to float rounding elsewhere).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ssd.sampling_params import SamplingParams


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()    # the `logprobs` most likely (id, logprob), most likely first


def logprob_rows(logits: torch.Tensor, probs: torch.Tensor | None, params: SamplingParams) -> torch.Tensor:
    """[m, V] log-probabilities for one sequence's rows: log(probs) (the warped distribution) when
    sampling, log_softmax(logits) when greedy."""
    if params.greedy or probs is None:
        return torch.log_softmax(logits.float().cpu(), dim=-1)
    return torch.log(probs.double()).float()


def token_logprobs(rows: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """One entry per token: tokens[j] was committed at row j."""
    out = []
    top_vals = top_ids = None
    if top > 0:
        top_vals, top_ids = rows[:len(tokens)].topk(min(top, rows.shape[-1]), dim=-1)
    for j, t in enumerate(tokens):
        alts = () if top_ids is None else tuple(zip(top_ids[j].tolist(), top_vals[j].tolist()))
        out.append(TokenLogprob(int(t), float(rows[j, t]), alts))
    return out


def wanted(seqs) -> bool:
    return any(s.params.logprobs is not None for s in seqs)
