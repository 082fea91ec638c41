"""The speculation cache's keying (a chain is served only for its sequence, round and outcome,
checked against a reference model) and the candidate-outcome helpers."""
from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ssd.speculation.worker.cache import (
    Chain,
    SpeculationCache,
    candidate_outcomes,
    candidate_rank,
    ranked_tokens,
)

torch.set_num_threads(1)

K, V = 3, 6

# ---------------------------------------------------------------- keying never crosses

keys = st.tuples(st.integers(0, 3), st.integers(0, 3), st.integers(0, K), st.integers(0, V - 1))
ops = st.lists(st.tuples(st.sampled_from(["put", "put", "get", "get", "get", "drop"]), keys), max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_cache_serves_only_the_chain_built_for_the_exact_key(operations) -> None:
    _check_against_reference(operations)


def test_long_seeded_run_against_reference() -> None:
    rng = random.Random(0)
    operations = [(rng.choices(["put", "get", "drop"], [8, 12, 0.5])[0],
                   (rng.randrange(3), rng.choices([0, 1], [12, 1])[0], rng.randrange(K + 1), rng.randrange(3)))
                  for _ in range(3000)]
    found, lookups = _check_against_reference(operations)
    assert 0.1 * lookups < found < 0.9 * lookups


def _check_against_reference(operations) -> tuple[int, int]:
    """Every get returns the chain put under exactly that (seq, round, accepted, bonus), or None; a put
    for a newer round of a sequence retires its older round; regions always return to the pool."""
    regions = 4 * (K + 1) * V
    cache = SpeculationCache(num_regions=regions, k=K)
    ref: dict[int, tuple[int, dict]] = {}
    found = lookups = 0
    for op, (seq, rnd, acc, bonus) in operations:
        if op == "put":
            if seq in ref and ref[seq][0] != rnd:
                del ref[seq]
            held = ref.setdefault(seq, (rnd, {}))[1]
            chain = Chain(acc, bonus, K, torch.Generator(), [seq, rnd, acc])
            if (acc, bonus) in held:
                with pytest.raises(KeyError):
                    cache.put(seq, rnd, chain)
                continue
            chain.region = cache.take_region()
            cache.put(seq, rnd, chain)
            held[(acc, bonus)] = chain
        elif op == "get":
            want = ref[seq][1].get((acc, bonus)) if seq in ref and ref[seq][0] == rnd else None
            assert cache.get(seq, rnd, acc, bonus) is want
            lookups += 1
            found += want is not None
        else:
            assert cache.drop(seq) == len(ref.pop(seq, (0, {}))[1])
        assert cache.free_regions == regions - sum(len(c) for _, c in ref.values()) == regions - len(cache)
    return found, lookups


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
