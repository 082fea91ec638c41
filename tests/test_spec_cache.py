"""Tests for ssd.speculation.cache: keying, stats, validation, and the candidate-outcome helpers."""
from __future__ import annotations

import random
import threading

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ssd.speculation.cache import (
    CachedChain,
    ChainKey,
    SpeculationCache,
    candidate_outcomes,
    candidate_rank,
    ranked_tokens,
)

torch.set_num_threads(1)

K, V = 3, 6


def _chain(seq_id: int, round_id: int, k: int, t: int, probs: bool = True) -> CachedChain:
    """A chain whose contents encode its own key, so a chain served for the wrong key shows."""
    tokens = torch.tensor([seq_id % V, round_id % V, (k * V + t) % V], dtype=torch.long)
    dist = torch.full((K, V), float(seq_id * 1000 + round_id * 100 + k * 10 + t)) if probs else None
    return CachedChain(ChainKey(seq_id, round_id, k, t), tokens, dist, state=(seq_id, round_id, k, t))


# ---------------------------------------------------------------- keying never crosses


keys = st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, K), st.integers(0, V - 1))
# keys drawn mostly from a small pool (so gets hit, and pool keys differ in one field at a time) plus fresh ones
pooled = st.lists(keys, min_size=1, max_size=6, unique=True).flatmap(
    lambda pool: st.lists(
        st.tuples(
            st.sampled_from(["put", "put", "get", "get", "get", "clear_round", "clear_seq"]),
            st.one_of(st.sampled_from(pool), st.sampled_from(pool).flatmap(_neighbours), keys),
        ),
        max_size=60,
    )
)


def _neighbours(key: tuple[int, int, int, int]):
    """Keys equal to key in all fields but one."""
    bounds = [3, 3, K, V - 1]
    return st.integers(0, 3).flatmap(
        lambda field: st.integers(0, bounds[field]).map(lambda value: key[:field] + (value,) + key[field + 1 :])
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pooled)
def test_cache_serves_only_the_chain_built_for_the_exact_key(operations) -> None:
    _check_against_reference(operations)


def test_long_seeded_run_against_reference_hits_and_misses() -> None:
    rng = random.Random(0)
    pool = [(rng.randrange(3), rng.randrange(3), rng.randrange(K + 1), rng.randrange(V)) for _ in range(12)]
    names, weights = ["put", "get", "clear_round", "clear_seq"], [8, 12, 1, 0.5]
    operations = []
    for _ in range(3000):
        key = rng.choice(pool)
        if rng.random() < 0.3:  # a neighbour: one field changed
            field = rng.randrange(4)
            key = key[:field] + (rng.randrange([3, 3, K + 1, V][field]),) + key[field + 1 :]
        operations.append((rng.choices(names, weights)[0], key))
    hits, lookups = _check_against_reference(operations)
    assert 0.25 * sum(lookups) < sum(hits) < 0.9 * sum(lookups) and min(hits) > 0


def _check_against_reference(operations) -> tuple[list[int], list[int]]:
    """Every get returns the chain put under exactly that key (same object), or None."""
    cache = SpeculationCache(num_draft=K, vocab_size=V)
    reference: dict[tuple[int, int, int, int], CachedChain] = {}
    lookups = [0] * (K + 1)
    hits = [0] * (K + 1)
    for name, key in operations:
        seq_id, round_id, k, t = key
        if name == "put":
            chain = _chain(*key)
            if key in reference:
                with pytest.raises(KeyError):
                    cache.put(chain)
                cache.put(chain, replace=True)
            else:
                cache.put(chain)
            reference[key] = chain
        elif name == "get":
            got = cache.get(*key)
            lookups[k] += 1
            if key in reference:
                hits[k] += 1
                assert got is reference[key]
                assert got.key == ChainKey(*key) and got.state == key
            else:
                assert got is None
        elif name == "clear_round":
            dropped = cache.clear_round(seq_id, round_id)
            gone = [x for x in reference if x[:2] == (seq_id, round_id)]
            assert dropped == len(gone)
            for x in gone:
                del reference[x]
        else:
            cache.clear_seq(seq_id)
            for x in [x for x in reference if x[0] == seq_id]:
                del reference[x]
        assert len(cache) == len(reference)
    for s in range(4):
        for r in range(4):
            assert cache.outcomes(s, r) == sorted((x[2], x[3]) for x in reference if x[:2] == (s, r))
    stats = cache.stats()
    assert list(stats.lookups_by_k) == lookups and list(stats.hits_by_k) == hits
    assert stats.entries == len(reference) and stats.misses == sum(lookups) - sum(hits)
    return hits, lookups


def test_near_miss_keys_are_misses() -> None:
    cache = SpeculationCache(num_draft=K, vocab_size=V)
    cache.put(_chain(1, 5, 2, 4))
    assert cache.get(1, 5, 2, 4) is not None
    for near in [(0, 5, 2, 4), (2, 5, 2, 4), (1, 4, 2, 4), (1, 6, 2, 4), (1, 5, 1, 4), (1, 5, 3, 4), (1, 5, 2, 3), (1, 5, 2, 5)]:
        assert cache.get(*near) is None, near


# ---------------------------------------------------------------- stats


def test_stats_overall_by_k_and_by_sequence() -> None:
    cache = SpeculationCache(num_draft=K, vocab_size=V)
    cache.put(_chain(0, 0, 0, 1))
    cache.put(_chain(0, 0, 3, 2, probs=False))
    cache.put(_chain(1, 0, 0, 1))
    assert cache.get(0, 0, 0, 1) is not None  # hit k=0
    assert cache.get(0, 0, 0, 2) is None  # miss k=0
    assert cache.get(0, 0, 3, 2) is not None  # hit k=3
    assert cache.get(1, 0, 1, 1) is None  # miss k=1, other sequence
    stats = cache.stats()
    assert (stats.lookups, stats.hits, stats.misses) == (4, 2, 2) and stats.hit_rate == 0.5
    assert stats.lookups_by_k == (2, 1, 0, 1) and stats.hits_by_k == (1, 0, 0, 1)
    assert stats.hit_rate_by_k == (0.5, 0.0, 0.0, 1.0) and stats.entries == 3
    seq0 = cache.stats(0)
    assert (seq0.lookups, seq0.hits, seq0.entries) == (3, 2, 2)
    final = cache.clear_seq(0)
    assert (final.lookups, final.hits, final.hits_by_k) == (3, 2, (1, 0, 0, 1))
    assert cache.stats(0).lookups == 0 and cache.stats().lookups == 4 and len(cache) == 1
    assert cache.stats(7).hit_rate == 0.0


def test_deterministic_chain_is_one_hot_for_the_verifier() -> None:
    chain = _chain(2, 1, 0, 3, probs=False)
    probs = chain.proposal_probs(V)
    assert probs.shape == (K, V) and torch.equal(probs.argmax(-1), chain.tokens) and probs.sum() == K
    soft = _chain(2, 1, 0, 3)
    assert soft.proposal_probs(V) is soft.probs


# ---------------------------------------------------------------- validation


def test_keys_and_chains_are_validated() -> None:
    cache = SpeculationCache(num_draft=K, vocab_size=V)
    for bad in [(-1, 0, 0, 0), (0, -1, 0, 0), (0, 0, -1, 0), (0, 0, K + 1, 0), (0, 0, 0, V), (0, 0, 0, 1.0), (True, 0, 0, 0)]:
        with pytest.raises(ValueError):
            cache.get(*bad)
    assert cache.stats().lookups == 0  # rejected lookups are not counted
    assert cache.get(torch.tensor(0), 0, 0, torch.tensor(1)) is None  # int-likes are fine
    key = ChainKey(0, 0, 0, 0)
    bad_chains = [
        CachedChain(key, torch.zeros(K + 1, dtype=torch.long)),  # wrong length
        CachedChain(key, torch.zeros(K)),  # float tokens
        CachedChain(key, torch.tensor([0, 1, V])),  # token out of vocab
        CachedChain(key, torch.zeros(K, dtype=torch.long), torch.zeros(K, V + 1)),  # probs width
        CachedChain(key, torch.zeros(K, dtype=torch.long), torch.zeros(K - 1, V)),  # probs rows
        CachedChain(ChainKey(0, 0, K + 1, 0), torch.zeros(K, dtype=torch.long)),  # k beyond K
    ]
    for chain in bad_chains:
        with pytest.raises(ValueError):
            cache.put(chain)
    assert len(cache) == 0
    with pytest.raises(ValueError):
        SpeculationCache(num_draft=0)


def test_concurrent_puts_and_gets() -> None:
    cache = SpeculationCache(num_draft=K, vocab_size=V)

    def writer(seq_id: int) -> None:
        for round_id in range(20):
            for t in range(V):
                cache.put(_chain(seq_id, round_id, round_id % (K + 1), t))

    def reader(seq_id: int) -> None:
        for round_id in range(20):
            for t in range(V):
                got = cache.get(seq_id, round_id, round_id % (K + 1), t)
                assert got is None or got.state == (seq_id, round_id, round_id % (K + 1), t)

    threads = [threading.Thread(target=f, args=(s,)) for s in range(3) for f in (writer, reader)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(cache) == 3 * 20 * V and cache.stats().lookups == 3 * 20 * V


# ---------------------------------------------------------------- which outcomes to pre-draft


def test_candidate_outcomes_example() -> None:
    sent = [2, 0]
    probs = torch.tensor([
        [0.1, 0.2, 0.4, 0.3],  # position 1: order 2, 3, 1, 0; the draft sent 2
        [0.5, 0.25, 0.25, 0.0],  # position 2: order 0, 1, 2, 3 (tie: lower id first); sent 0
        [0.1, 0.1, 0.1, 0.7],  # position 3 (after the last sent token): order 3, 0, 1, 2
    ])
    ranked = ranked_tokens(probs, 4)
    assert ranked.tolist() == [[2, 3, 1, 0], [0, 1, 2, 3], [3, 0, 1, 2]]
    assert candidate_outcomes(sent, ranked, [2, 1, 2]) == [(0, 3), (0, 1), (1, 1), (2, 3), (2, 0)]
    assert candidate_outcomes(sent, ranked, [0, 0, 1]) == [(2, 3)]
    assert candidate_outcomes(torch.tensor(sent), ranked[:, :2], [2, 2, 2]) == [(0, 3), (1, 1), (2, 3), (2, 0)]
    assert candidate_rank(sent, ranked, 0, 3) == 0 and candidate_rank(sent, ranked, 0, 1) == 1
    assert candidate_rank(sent, ranked, 0, 2) is None  # the rejected token is never the bonus
    assert candidate_rank(sent, ranked, 2, 2) == 3
    with pytest.raises(ValueError):
        candidate_outcomes(sent, ranked, [1, 1])
    with pytest.raises(ValueError):
        candidate_outcomes(sent, ranked[:2], [1, 1, 1])


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 4).flatmap(
        lambda k: st.tuples(
            st.just(k),
            st.integers(2, 7).flatmap(
                lambda v: st.tuples(
                    st.just(v),
                    st.lists(st.lists(st.integers(0, 9), min_size=v, max_size=v), min_size=k + 1, max_size=k + 1),
                    st.lists(st.integers(0, v - 1), min_size=k, max_size=k),
                    st.lists(st.integers(0, v + 1), min_size=k + 1, max_size=k + 1),
                )
            ),
        )
    )
)
def test_candidate_outcomes_properties(case) -> None:
    k, (v, weights, sent, fan_out) = case
    probs = torch.tensor(weights, dtype=torch.float64) + 1e-3
    probs = probs / probs.sum(-1, keepdim=True)
    ranked = ranked_tokens(probs, v)
    outcomes = candidate_outcomes(sent, ranked, fan_out)
    assert len(set(outcomes)) == len(outcomes)
    for j in range(k + 1):
        at_j = [t for kk, t in outcomes if kk == j]
        available = v - 1 if j < k else v
        assert len(at_j) == min(fan_out[j], available)
        if j < k:
            assert sent[j] not in at_j  # never the token the draft sent at j
        # the top of the draft's order: nothing left out is likelier than what was taken
        left_out = [t for t in range(v) if t not in at_j and (j == k or t != sent[j])]
        if at_j and left_out:
            assert min(probs[j, at_j]) >= max(probs[j, left_out])
        for t in range(v):
            rank = candidate_rank(sent, ranked, j, t)
            assert ((j, t) in outcomes) == (rank is not None and rank < fan_out[j])
