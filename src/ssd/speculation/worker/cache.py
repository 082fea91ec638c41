"""The speculation cache the draft worker uses (docs/ARCHITECTURE.md 1, 1.1).

While the target verifies round r of a sequence, the worker pre-drafts round r + 1 for likely
outcomes (accepted, bonus). Each chain is stored under (seq_id, round, accepted, bonus) and is only
ever served for exactly that key: its tokens and proposal distributions were conditioned on that
prefix. A chain may be partial (pre-drafting was cut short when the engine asked); a miss then
finishes it just in time instead of starting over.

A pre-drafted chain keeps the KV of its tokens in a scratch region of K slots of the worker's KV
pool; on a hit that KV is copied into the sequence's own cache instead of being recomputed. The
pool has `num_regions` regions, sized by the engine for its whole batch (max_num_seqs sequences).

Also here, pure helpers for which outcomes to pre-draft: `ranked_tokens`, `candidate_outcomes`
(top-F per accepted length, without the token the draft sent there) and `candidate_rank` (for the
miss-curve estimator in fanout.py).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__ = ["Chain", "SpeculationCache", "candidate_outcomes", "candidate_rank", "ranked_tokens"]


@dataclass
class Chain:
    """Draft tokens following outcome (accepted, bonus) of a round (up to num_draft; fewer when
    pre-drafting was cut short), the distributions they were sampled from, and the generator that
    continues them."""

    accepted: int
    bonus: int
    num_draft: int
    gen: torch.Generator
    tokens: list[int] = field(default_factory=list)
    probs: list[Tensor] = field(default_factory=list)     # proposal actually sampled from (empty when greedy)
    ranking: list[Tensor] = field(default_factory=list)   # the draft's distribution per position (candidates)
    region: int | None = None      # scratch region holding the KV of [bonus, tokens[:-1]] (pre-drafted)

    @property
    def complete(self) -> bool:
        return len(self.tokens) >= self.num_draft

    def probs_tensor(self, n: int | None = None) -> Tensor | None:
        """The proposal distributions of the first n tokens (all by default), stacked."""
        return torch.stack(self.probs[:n]) if self.probs else None


class SpeculationCache:
    """Chains by (seq_id, round, accepted, bonus), and the scratch regions their KV lives in."""

    def __init__(self, num_regions: int, k: int, slots: Tensor | None = None):
        if num_regions < 1 or k < 1:
            raise ValueError(f"need num_regions >= 1 and k >= 1, got {num_regions} and {k}")
        self.k = k
        self.num_regions = num_regions
        self.slots = slots                      # [num_regions * k] KV slot ids (None: no KV, tests)
        self._free = list(range(num_regions))
        self._chains: dict[int, tuple[int, dict[tuple[int, int], Chain]]] = {}   # seq -> (round, chains)
        self.lookups = 0
        self.hits = 0

    # ---- regions
    @property
    def free_regions(self) -> int:
        return len(self._free)

    def take_region(self) -> int:
        if not self._free:
            raise RuntimeError("no free scratch region (callers bound their chains by free_regions)")
        return self._free.pop()

    def region_slots(self, region: int) -> Tensor:
        return self.slots[region * self.k:(region + 1) * self.k]

    # ---- chains
    def put(self, seq_id: int, rnd: int, chain: Chain) -> None:
        held = self._chains.get(seq_id)
        if held is not None and held[0] != rnd:
            self.drop(seq_id)                   # chains of an older round are dead
            held = None
        if held is None:
            held = self._chains[seq_id] = (rnd, {})
        key = (chain.accepted, chain.bonus)
        if key in held[1]:
            raise KeyError(f"a chain is already cached for sequence {seq_id}, round {rnd}, outcome {key}")
        held[1][key] = chain

    def get(self, seq_id: int, rnd: int, accepted: int, bonus: int) -> Chain | None:
        """The chain pre-drafted for exactly this outcome of this round (complete or partial), or None."""
        held = self._chains.get(seq_id)
        chain = held[1].get((accepted, bonus)) if held is not None and held[0] == rnd else None
        self.lookups += 1
        self.hits += chain is not None and chain.complete
        return chain

    def has_round(self, seq_id: int, rnd: int) -> bool:
        held = self._chains.get(seq_id)
        return held is not None and held[0] == rnd and bool(held[1])

    def outcomes(self, seq_id: int, rnd: int) -> list[tuple[int, int]]:
        held = self._chains.get(seq_id)
        return sorted(held[1]) if held is not None and held[0] == rnd else []

    def drop(self, seq_id: int) -> int:
        """Forget every chain of a sequence and free their regions; returns how many were dropped."""
        held = self._chains.pop(seq_id, None)
        if held is None:
            return 0
        self._free += [c.region for c in held[1].values() if c.region is not None]
        return len(held[1])

    def __len__(self) -> int:
        return sum(len(c) for _, c in self._chains.values())


# ---------------------------------------------------------------- which outcomes to pre-draft


def ranked_tokens(probs: Tensor, m: int) -> Tensor:
    """[..., m] token ids in descending probability, ties lower id first (as everywhere else).

    Takes the top m by value, then orders them stably; a tie that straddles rank m may pick a
    higher id than a full stable sort would (it only changes which outcome gets pre-drafted)."""
    m = min(m, probs.shape[-1])
    vals, idx = probs.topk(m, dim=-1)
    order = torch.sort(idx, dim=-1, stable=True)                    # by id ...
    vals = vals.gather(-1, order.indices)
    by_value = torch.sort(vals, dim=-1, descending=True, stable=True).indices   # ... then by value
    return order.values.gather(-1, by_value)


def _rows(draft_sent, draft_ranked) -> tuple[list[int], list[list[int]]]:
    sent = [int(x) for x in (draft_sent.tolist() if isinstance(draft_sent, Tensor) else draft_sent)]
    ranked_rows = draft_ranked.tolist() if isinstance(draft_ranked, Tensor) else draft_ranked
    ranked = [[int(x) for x in row] for row in ranked_rows]
    if len(ranked) != len(sent) + 1:
        raise ValueError(f"need K + 1 = {len(sent) + 1} ranked rows (positions 1..K+1), got {len(ranked)}")
    return sent, ranked


def _candidates_at(sent: list[int], ranked: list[list[int]], accepted: int) -> list[int]:
    """Ranked bonus candidates after `accepted` tokens: the order at that position minus the sent token."""
    excluded = {sent[accepted]} if accepted < len(sent) else set()
    out: list[int] = []
    for token in ranked[accepted]:
        if token not in excluded:
            excluded.add(token)  # also drops duplicates in the ranking
            out.append(token)
    return out


def candidate_outcomes(draft_sent: Sequence[int] | Tensor, draft_ranked: Sequence[Sequence[int]] | Tensor,
                       fan_out: Sequence[int]) -> list[tuple[int, int]]:
    """The outcomes (accepted, bonus) to pre-draft, by accepted length then by rank.

    draft_sent [K]: the tokens sent for verification. draft_ranked [K+1, M]: per position the draft's
    token ids in descending probability (row K: after the last sent token). fan_out [K+1]: F per
    accepted length. For accepted < K the bonus follows a rejection of the sent token there, and a
    rejected token is never the bonus (rejection needs p(d) < q(d), where the residual is 0), so the
    candidates are the top F other than that token. A ranking shorter than F (+1) yields fewer.
    """
    sent, ranked = _rows(draft_sent, draft_ranked)
    if len(fan_out) != len(sent) + 1:
        raise ValueError(f"fan_out has {len(fan_out)} entries, expected K + 1 = {len(sent) + 1}")
    out: list[tuple[int, int]] = []
    for accepted, f in enumerate(fan_out):
        if f < 0:
            raise ValueError(f"fan-out must be >= 0, got F_{accepted} = {f}")
        out.extend((accepted, t) for t in _candidates_at(sent, ranked, accepted)[:f])
    return out


def candidate_rank(draft_sent: Sequence[int] | Tensor, draft_ranked: Sequence[Sequence[int]] | Tensor,
                   accepted: int, bonus: int) -> int | None:
    """Zero-based rank of `bonus` among the candidates after `accepted` tokens (None: not ranked).

    (accepted, bonus) is among candidate_outcomes(..., fan_out) iff the rank is < fan_out[accepted]:
    the data `MissCurveEstimator.observe_rank` fits the miss curve from."""
    sent, ranked = _rows(draft_sent, draft_ranked)
    if not 0 <= accepted <= len(sent):
        raise ValueError(f"accepted = {accepted} outside [0, K = {len(sent)}]")
    candidates = _candidates_at(sent, ranked, accepted)
    return candidates.index(bonus) if bonus in candidates else None
