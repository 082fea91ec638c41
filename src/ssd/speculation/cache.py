"""The speculation cache: pre-drafted chains keyed by verification outcome (docs/ARCHITECTURE.md 1, 1.1).

While the target verifies round i of a sequence, the draft pre-drafts round i + 1 for predicted
outcomes v = (k, t): k of the K sent tokens accepted, bonus token t. Each such chain is stored
under (seq_id, round_id, k, t). When the real outcome arrives the worker looks up exactly that
key: a chain is only ever served for the sequence, round and outcome it was drafted for, because
its tokens and proposal distributions were conditioned on that exact prefix.

Also here, pure helpers for which outcomes to pre-draft: `ranked_tokens`, `candidate_outcomes`
(top-F_k per k, without the token the draft sent at k) and `candidate_rank` (for the miss-curve
estimator in fanout.py).
"""
from __future__ import annotations

import logging
import operator
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ssd.speculation.backup import onehot_probs

__all__ = [
    "CacheStats",
    "CachedChain",
    "ChainKey",
    "SpeculationCache",
    "candidate_outcomes",
    "candidate_rank",
    "ranked_tokens",
]

logger = logging.getLogger(__name__)


def _index(value: Any, name: str) -> int:
    """A non-negative Python int from an int-like (int, numpy int, 0-d integer tensor); not bool."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got bool {value}")
    try:
        out = operator.index(value)
    except TypeError:
        raise ValueError(f"{name} must be an integer, got {type(value).__name__} {value!r}") from None
    if out < 0:
        raise ValueError(f"{name} must be >= 0, got {out}")
    return out


@dataclass(frozen=True)
class ChainKey:
    """Which speculation a chain continues: sequence, round, and that round's outcome (k, t)."""

    seq_id: int
    round_id: int
    k: int  # accepted draft tokens of round round_id
    t: int  # bonus token of round round_id

    def __post_init__(self) -> None:
        for name in ("seq_id", "round_id", "k", "t"):
            object.__setattr__(self, name, _index(getattr(self, name), name))


@dataclass(frozen=True, eq=False)
class CachedChain:
    """A pre-drafted next speculation for the outcome `key`.

    tokens [K] long: the proposed tokens. probs [K, V]: the distributions they were drawn from
    (after Saguaro scaling: exactly what the verifier must use), or None for a deterministic chain
    (greedy draft), which stands for one-hot distributions. state: an opaque handle to draft state
    the worker can reuse on a hit (KV slots, last logits); the cache never looks inside it.
    """

    key: ChainKey
    tokens: Tensor
    probs: Tensor | None = None
    state: Any = None

    def proposal_probs(self, vocab_size: int) -> Tensor:
        """[K, V] proposal distributions for the verifier (one-hot for a deterministic chain)."""
        if self.probs is not None:
            return self.probs
        return onehot_probs(self.tokens, vocab_size, device=self.tokens.device)


@dataclass(frozen=True)
class CacheStats:
    lookups: int
    hits: int
    lookups_by_k: tuple[int, ...]
    hits_by_k: tuple[int, ...]
    entries: int

    @property
    def misses(self) -> int:
        return self.lookups - self.hits

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def hit_rate_by_k(self) -> tuple[float, ...]:
        return tuple(h / n if n else 0.0 for h, n in zip(self.hits_by_k, self.lookups_by_k))


@dataclass
class _Counts:
    lookups_by_k: list[int]
    hits_by_k: list[int]

    @classmethod
    def empty(cls, num_outcomes: int) -> _Counts:
        return cls([0] * num_outcomes, [0] * num_outcomes)

    def frozen(self, entries: int) -> CacheStats:
        return CacheStats(sum(self.lookups_by_k), sum(self.hits_by_k), tuple(self.lookups_by_k),
                          tuple(self.hits_by_k), entries)


class SpeculationCache:
    """Chains by (seq_id, round_id, k, t), with hit/miss counts overall, by k and by sequence.

    num_draft (K) bounds k to [0, K] and every chain's length to K; vocab_size, when given, bounds
    t and every token and fixes the width of probs. Thread-safe (one lock), so a drafting thread
    can put while a responding thread gets.
    """

    def __init__(self, num_draft: int, vocab_size: int | None = None) -> None:
        if num_draft < 1:
            raise ValueError(f"num_draft must be >= 1, got {num_draft}")
        if vocab_size is not None and vocab_size < 1:
            raise ValueError(f"vocab_size must be >= 1, got {vocab_size}")
        self.num_draft = num_draft
        self.vocab_size = vocab_size
        self._chains: dict[int, dict[int, dict[tuple[int, int], CachedChain]]] = {}
        self._counts = _Counts.empty(num_draft + 1)
        self._seq_counts: dict[int, _Counts] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------ validation

    def _key(self, seq_id: int, round_id: int, k: int, t: int) -> ChainKey:
        key = ChainKey(seq_id, round_id, k, t)
        if key.k > self.num_draft:
            raise ValueError(f"k = {key.k} outside [0, K = {self.num_draft}]")
        if self.vocab_size is not None and key.t >= self.vocab_size:
            raise ValueError(f"bonus token t = {key.t} outside [0, V = {self.vocab_size})")
        return key

    def _check_chain(self, chain: CachedChain) -> None:
        self._key(chain.key.seq_id, chain.key.round_id, chain.key.k, chain.key.t)
        tokens = chain.tokens
        if tokens.dim() != 1 or tokens.shape[0] != self.num_draft or tokens.dtype.is_floating_point:
            raise ValueError(f"chain tokens must be an integer tensor [K = {self.num_draft}], got "
                             f"{tokens.dtype} {tuple(tokens.shape)}")
        if self.vocab_size is not None and tokens.numel() and (
            int(tokens.min()) < 0 or int(tokens.max()) >= self.vocab_size
        ):
            raise ValueError(f"chain tokens outside [0, {self.vocab_size}): {tokens.tolist()}")
        if chain.probs is not None:
            probs = chain.probs
            width_ok = self.vocab_size is None or probs.shape[-1] == self.vocab_size
            if probs.dim() != 2 or probs.shape[0] != self.num_draft or not width_ok:
                raise ValueError(f"chain probs must be [K, V] = [{self.num_draft}, {self.vocab_size or 'V'}], "
                                 f"got {tuple(probs.shape)}")

    # ------------------------------------------------------------ the cache

    def put(self, chain: CachedChain, *, replace: bool = False) -> None:
        """Store chain under its own key. A second chain for the same key raises unless replace."""
        self._check_chain(chain)
        key = chain.key
        with self._lock:
            slot = self._chains.setdefault(key.seq_id, {}).setdefault(key.round_id, {})
            if (key.k, key.t) in slot and not replace:
                raise KeyError(f"a chain is already cached for {key}")
            slot[(key.k, key.t)] = chain

    def get(self, seq_id: int, round_id: int, k: int, t: int) -> CachedChain | None:
        """The chain drafted for exactly this outcome, or None (a miss). Counts the lookup."""
        key = self._key(seq_id, round_id, k, t)
        with self._lock:
            chain = self._chains.get(key.seq_id, {}).get(key.round_id, {}).get((key.k, key.t))
            hit = chain is not None
            for counts in (self._counts, self._seq_counts.setdefault(key.seq_id, _Counts.empty(self.num_draft + 1))):
                counts.lookups_by_k[key.k] += 1
                counts.hits_by_k[key.k] += hit
        if chain is not None and chain.key != key:  # impossible by construction; never serve it
            raise RuntimeError(f"cache slot for {key} holds a chain for {chain.key}")
        return chain

    def outcomes(self, seq_id: int, round_id: int) -> list[tuple[int, int]]:
        """The (k, t) cached for this sequence and round (no lookup counted)."""
        with self._lock:
            return sorted(self._chains.get(seq_id, {}).get(round_id, {}))

    def clear_round(self, seq_id: int, round_id: int) -> int:
        """Drop the chains of one round of one sequence; returns how many were dropped."""
        with self._lock:
            rounds = self._chains.get(seq_id, {})
            dropped = len(rounds.pop(round_id, {}))
            if not rounds:
                self._chains.pop(seq_id, None)
        return dropped

    def clear_seq(self, seq_id: int) -> CacheStats:
        """Drop everything of a finished sequence; returns its final per-sequence stats."""
        with self._lock:
            self._chains.pop(seq_id, None)
            counts = self._seq_counts.pop(seq_id, None) or _Counts.empty(self.num_draft + 1)
        logger.debug("speculation cache: sequence %d cleared", seq_id)
        return counts.frozen(0)

    def stats(self, seq_id: int | None = None) -> CacheStats:
        """Lookups and hits overall (seq_id None) or for one live sequence, each also by k."""
        with self._lock:
            if seq_id is None:
                return self._counts.frozen(self._entries())
            counts = self._seq_counts.get(seq_id) or _Counts.empty(self.num_draft + 1)
            entries = sum(len(r) for r in self._chains.get(seq_id, {}).values())
            return counts.frozen(entries)

    def __len__(self) -> int:
        with self._lock:
            return self._entries()

    def _entries(self) -> int:
        return sum(len(r) for rounds in self._chains.values() for r in rounds.values())


# ---------------------------------------------------------------- which outcomes to pre-draft


def ranked_tokens(probs: Tensor, m: int) -> Tensor:
    """[..., m] token ids in descending probability (ties: lower id first, as everywhere else)."""
    m = min(m, probs.shape[-1])
    return torch.sort(probs, dim=-1, descending=True, stable=True).indices[..., :m]


def _rows(
    draft_sent: Sequence[int] | Tensor, draft_ranked: Sequence[Sequence[int]] | Tensor
) -> tuple[list[int], list[list[int]]]:
    sent = [int(x) for x in (draft_sent.tolist() if isinstance(draft_sent, Tensor) else draft_sent)]
    ranked_rows = draft_ranked.tolist() if isinstance(draft_ranked, Tensor) else draft_ranked
    ranked = [[int(x) for x in row] for row in ranked_rows]
    if len(ranked) != len(sent) + 1:
        raise ValueError(f"need K + 1 = {len(sent) + 1} ranked rows (positions 1..K+1), got {len(ranked)}")
    return sent, ranked


def _candidates_at(sent: list[int], ranked: list[list[int]], k: int) -> list[int]:
    """The ranked bonus candidates for outcome k: q's order at position k+1, minus d_{k+1} (k < K)."""
    excluded = {sent[k]} if k < len(sent) else set()
    out: list[int] = []
    for token in ranked[k]:
        if token not in excluded:
            excluded.add(token)  # also drops duplicates in the ranking
            out.append(token)
    return out


def candidate_outcomes(
    draft_sent: Sequence[int] | Tensor,
    draft_ranked: Sequence[Sequence[int]] | Tensor,
    fan_out: Sequence[int],
) -> list[tuple[int, int]]:
    """The outcomes (k, t) to pre-draft, by k then by rank.

    draft_sent [K]: the tokens sent for verification. draft_ranked [K+1, M]: per position
    j = 1..K+1 the draft's token ids in descending probability (`ranked_tokens` of the draft's raw
    q, before any Saguaro scaling; row K is the draft's distribution after the last sent token).
    fan_out [K+1]: F_k.

    For k < K the bonus follows a rejection of d_{k+1}, and a rejected token is never the bonus
    (rejection needs p(d) < q(d), where the residual max(p - q, 0) is 0), so the candidates are the
    top F_k tokens at position k+1 other than d_{k+1}. For k = K they are the top F_K at K+1.
    A ranking shorter than F_k (+1) yields fewer candidates.
    """
    sent, ranked = _rows(draft_sent, draft_ranked)
    if len(fan_out) != len(sent) + 1:
        raise ValueError(f"fan_out has {len(fan_out)} entries, expected K + 1 = {len(sent) + 1}")
    out: list[tuple[int, int]] = []
    for k, f in enumerate(fan_out):
        if f < 0:
            raise ValueError(f"fan-out must be >= 0, got F_{k} = {f}")
        out.extend((k, t) for t in _candidates_at(sent, ranked, k)[:f])
    return out


def candidate_rank(
    draft_sent: Sequence[int] | Tensor, draft_ranked: Sequence[Sequence[int]] | Tensor, k: int, t: int
) -> int | None:
    """Zero-based rank of bonus t among the candidates for outcome k (None: not ranked).

    (k, t) is among candidate_outcomes(..., fan_out) iff candidate_rank(...) < fan_out[k]: the
    data `MissCurveEstimator.observe_rank` fits the miss curve from.
    """
    sent, ranked = _rows(draft_sent, draft_ranked)
    if not 0 <= k <= len(sent):
        raise ValueError(f"k = {k} outside [0, K = {len(sent)}]")
    candidates = _candidates_at(sent, ranked, k)
    return candidates.index(t) if t in candidates else None
