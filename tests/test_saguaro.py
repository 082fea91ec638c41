"""Tests for Saguaro sampling and the fast backup: exactness by enumeration, and their pieces.

The exact check reuses tests/test_verify.py's machinery: context-dependent probability tables on a
small vocabulary, every draft sequence of a round enumerated with its probability under the
distribution the draft sampled from, and `verify()` driven over an exact partition of its
uniforms (`Round`, `outcomes_from_verify`). From the emitted tokens' distribution we extend every
emitted prefix with the target until length L and compare with the target's own distribution on
V^L. On top of one round we check a whole SSD step of two rounds: round 1 drafted with Saguaro
sampling, its outcome looked up among the cache's candidates (`candidate_outcomes`), and round 2
proposed by the cached chain on a hit or by the n-gram fast backup (one-hot) on a miss.
"""
from __future__ import annotations

import itertools
import zlib

import numpy as np
import pytest
import torch
from test_verify import Round, outcomes_from_verify

from ssd.speculation.backup import ngram_proposal, onehot_probs
from ssd.speculation.worker.cache import candidate_outcomes, ranked_tokens
from ssd.speculation.fanout import geometric_fanout
from ssd.speculation.saguaro import saguaro_proposal, top_mask, top_ranks

torch.set_num_threads(1)

Table = dict[tuple[int, ...], np.ndarray]


def _prefixes(vocab: int, max_len: int):
    for length in range(max_len + 1):
        yield from itertools.product(range(vocab), repeat=length)


def _table(vocab: int, depth: int, rng: np.random.Generator, sparse: bool = False) -> Table:
    table = {}
    for prefix in _prefixes(vocab, depth):
        probs = rng.dirichlet(np.ones(vocab))
        if sparse:  # a few rows with support <= 2: Saguaro with C = 0 falls back to q there
            keep = rng.random(vocab) < 0.5
            keep[rng.integers(vocab)] = True
            probs = probs * keep / (probs * keep).sum()
        table[prefix] = probs
    return table


def _saguaro_all(q: Table, fan_outs, c: float) -> dict[int, Table]:
    """q' at every prefix of q, for each fan-out F in fan_outs (one batched call per F)."""
    prefixes = list(q)
    stacked = torch.tensor(np.stack([q[pre] for pre in prefixes]))
    out = {}
    for f in sorted(set(fan_outs)):
        scaled = saguaro_proposal(stacked, f, c).numpy()
        out[f] = dict(zip(prefixes, scaled))
    return out


def _saguaro_table(q_all: dict[int, Table], fan_out: int | list[int], prefix: tuple[int, ...], depth: int, vocab: int) -> Table:
    """The draft's q' for a round starting after `prefix`: position j (0-based) uses F_j (or F)."""
    return {
        pre: q_all[fan_out if isinstance(fan_out, int) else fan_out[len(pre)]][prefix + pre]
        for pre in _prefixes(vocab, depth - 1)
    }


def _shift(table: Table, prefix: tuple[int, ...], depth: int, vocab: int) -> Table:
    return {pre: table[prefix + pre] for pre in _prefixes(vocab, depth)}


def _onehot_table(tokens: list[int], vocab: int) -> Table:
    eye = np.eye(vocab)
    return {pre: eye[tokens[len(pre)]] for pre in _prefixes(vocab, len(tokens) - 1)}


def _emitted(r: Round, outcomes: torch.Tensor) -> dict[tuple[int, ...], float]:
    """Probability of each emitted token tuple (accepted drafts + bonus) of one round."""
    joint = (r.weight[:, None, None] * outcomes).numpy()
    out: dict[tuple[int, ...], float] = {}
    for b, d in enumerate(r.drafts):
        for n, t in zip(*np.nonzero(joint[b])):
            e = d[:n] + (int(t),)
            out[e] = out.get(e, 0.0) + joint[b, n, t]
    return out


def _one_round(p: Table, q_sample: Table, q_verify: Table, vocab: int, k: int, rng: np.random.Generator):
    r = Round(p, q_sample, q_verify, vocab, k, k, rng)
    return r, outcomes_from_verify(r)


def exactness_error(p: Table, emitted: dict[tuple[int, ...], float], vocab: int, length: int) -> float:
    """max over x in V^length of |P(x) - P_target(x)|, every emitted e extended by the target.

    Mass is carried level by level as a vector over V^l (lexicographic prefix order).
    """
    assert abs(sum(emitted.values()) - 1) < 1e-9
    sd, target = np.zeros(1), np.ones(1)
    for level in range(length):
        step = np.stack([p[pre] for pre in itertools.product(range(vocab), repeat=level)])  # [V^l, V]
        sd = (sd[:, None] * step).reshape(-1)
        target = (target[:, None] * step).reshape(-1)
        for i, x in enumerate(itertools.product(range(vocab), repeat=level + 1)):
            sd[i] += emitted.get(x, 0.0)
    assert all(len(e) <= length for e in emitted)
    return float(np.abs(sd - target).max())


def _rng(*key) -> np.random.Generator:
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


# ---------------------------------------------------------------- one round with Saguaro sampling


@pytest.mark.parametrize("vocab,k", [(3, 1), (4, 2), (3, 3), (4, 3)])
@pytest.mark.parametrize("c", [1.0, 0.5, 0.0])
@pytest.mark.parametrize("fan_out", [1, 2])
def test_saguaro_round_is_exact_when_verified_with_q_prime(vocab: int, k: int, c: float, fan_out: int) -> None:
    rng = _rng(vocab, k, c, fan_out)
    p, q = _table(vocab, k, rng), _table(vocab, k - 1, rng, sparse=(vocab, k) == (4, 2))
    q_prime = _saguaro_table(_saguaro_all(q, [fan_out], c), fan_out, (), k, vocab)
    emitted = _emitted(*_one_round(p, q_prime, q_prime, vocab, k, rng))
    assert exactness_error(p, emitted, vocab, k + 1) < 1e-9
    if c < 1:  # negative control: the draft sampled q' but the verifier was given q
        wrong = _emitted(*_one_round(p, q_prime, q, vocab, k, rng))
        assert exactness_error(p, wrong, vocab, k + 1) > 1e-3


def test_saguaro_with_fan_out_per_position_is_exact() -> None:
    rng = _rng("per position")
    vocab, k = 4, 3
    p, q = _table(vocab, k, rng), _table(vocab, k - 1, rng)
    q_prime = _saguaro_table(_saguaro_all(q, [2, 1, 3], 0.25), [2, 1, 3], (), k, vocab)
    assert exactness_error(p, _emitted(*_one_round(p, q_prime, q_prime, vocab, k, rng)), vocab, k + 1) < 1e-9
    assert exactness_error(p, _emitted(*_one_round(p, q_prime, q, vocab, k, rng)), vocab, k + 1) > 1e-3


# ---------------------------------------------------------------- the fast backup


@pytest.mark.parametrize("vocab,k", [(3, 2), (4, 3), (3, 4)])
def test_ngram_one_hot_round_is_exact(vocab: int, k: int) -> None:
    rng = _rng("ngram", vocab, k)
    context = [2, 0, 1, 2, 0]
    tokens = ngram_proposal(context, k, n=2)
    assert tokens == [1, 2, 0, 1][:k]
    p, q = _table(vocab, k, rng), _table(vocab, k - 1, rng)
    one_hot = _onehot_table(tokens, vocab)
    r, outcomes = _one_round(p, one_hot, one_hot, vocab, k, rng)
    assert r.weight.sum() == 1 and torch.equal(r.draft_probs[r.weight.argmax()], onehot_probs(tokens, vocab, torch.float64))
    assert exactness_error(p, _emitted(r, outcomes), vocab, k + 1) < 1e-9
    # negative control: a deterministic proposal verified as if drawn from a soft q
    assert exactness_error(p, _emitted(*_one_round(p, one_hot, q, vocab, k, rng)), vocab, k + 1) > 1e-3


# ---------------------------------------------------------------- a whole SSD step: two rounds


def ssd_two_rounds(
    p: Table, q: Table, vocab: int, k: int, fan_out: list[int], c: float, prompt: list[int],
    rng: np.random.Generator, verify_with_q_prime: bool = True,
) -> tuple[dict[tuple[int, ...], float], float]:
    """Emitted distribution of two SSD rounds and the probability that round 2 hit the cache.

    Round 1: the draft samples K tokens from q' (Saguaro, F_j at position j) and the verifier
    checks them. The cache holds chains for candidate_outcomes(d, ranking of q, F). Round 2 after
    outcome (n, t): on a hit the cached chain (drafted from q' given the emitted prefix), on a miss
    the n-gram fast backup over prompt + emitted (one-hot), or the draft itself if no n-gram.
    """
    def proposal(prefix: tuple[int, ...], from_cache: bool) -> tuple[Table, Table]:
        tokens = None if from_cache else ngram_proposal(prompt + list(prefix), k)
        if tokens is not None:
            table = _onehot_table(tokens, vocab)
            return table, table
        sampled = _saguaro_table(q_all, fan_out, prefix, k, vocab)
        return sampled, sampled if verify_with_q_prime else _shift(q, prefix, k - 1, vocab)

    q_all = _saguaro_all(q, fan_out, c)
    second: dict[tuple[tuple[int, ...], bool], dict[tuple[int, ...], float]] = {}
    sampled, verified = proposal((), from_cache=True)
    r1, out1 = _one_round(p, sampled, verified, vocab, k, rng)
    joint = (r1.weight[:, None, None] * out1).numpy()
    total: dict[tuple[int, ...], float] = {}
    hit_prob = 0.0
    for b, d in enumerate(r1.drafts):
        ranked = ranked_tokens(torch.tensor(np.stack([q[d[:j]] for j in range(k + 1)])), vocab)
        cached = set(candidate_outcomes(d, ranked, fan_out))
        for n, t in zip(*np.nonzero(joint[b])):
            e, hit = d[:n] + (int(t),), (int(n), int(t)) in cached
            hit_prob += joint[b, n, t] * hit
            if (e, hit) not in second:
                p_e = _shift(p, e, k, vocab)
                second[(e, hit)] = _emitted(*_one_round(p_e, *proposal(e, from_cache=hit), vocab, k, rng))
            for e2, w2 in second[(e, hit)].items():
                total[e + e2] = total.get(e + e2, 0.0) + joint[b, n, t] * w2
    return total, hit_prob


SSD_CASES = [(3, 2, c) for c in (1.0, 0.5, 0.0)] + [(4, 2, c) for c in (1.0, 0.5, 0.0)] + [(3, 3, 0.5)]


@pytest.mark.parametrize("vocab,k,c", SSD_CASES)
def test_ssd_step_with_saguaro_cache_and_fast_backup_is_exact(vocab: int, k: int, c: float) -> None:
    rng = _rng("ssd", vocab, k, c)
    p, q = _table(vocab, 2 * k + 1, rng), _table(vocab, 2 * k, rng)
    fan_out = geometric_fanout(0.6, 0.8, k, k + 2)
    prompt = [1, 0, 2, 1, 0]
    emitted, hit_prob = ssd_two_rounds(p, q, vocab, k, fan_out, c, prompt, rng)
    assert 0.01 < hit_prob < 0.99  # both the cached chain and the fast backup carry real mass
    assert exactness_error(p, emitted, vocab, 2 * k + 2) < 1e-9
    if c < 1:
        wrong, _ = ssd_two_rounds(p, q, vocab, k, fan_out, c, prompt, rng, verify_with_q_prime=False)
        assert exactness_error(p, wrong, vocab, 2 * k + 2) > 1e-3


def test_saguaro_raises_the_cache_hit_rate() -> None:
    """Not a contract, a sanity check of the mechanism on one fixed instance: C = 0 puts the
    residual on the cached candidates. (Hit rate need not be monotone in C: a lower C also lowers
    acceptance, and when the draft sends a top-F token the candidate list reaches one rank deeper,
    to a token Saguaro did not scale.)"""
    rng = _rng("hit rate")
    vocab, k = 3, 2
    p, q = _table(vocab, 2 * k + 1, rng), _table(vocab, 2 * k, rng)
    hits = [ssd_two_rounds(p, q, vocab, k, [1, 1, 1], c, [1, 0, 2], np.random.default_rng(0))[1] for c in (1.0, 0.0)]
    assert hits[1] > hits[0] + 0.1


# ---------------------------------------------------------------- saguaro_proposal itself


def test_saguaro_proposal_values() -> None:
    q = torch.tensor([0.1, 0.4, 0.3, 0.2], dtype=torch.float64)
    assert saguaro_proposal(q, 2, 1.0) is q
    assert saguaro_proposal(q, 0, 0.0) is q
    torch.testing.assert_close(saguaro_proposal(q, 2, 0.5), torch.tensor([0.1, 0.2, 0.15, 0.2], dtype=torch.float64) / 0.65)
    torch.testing.assert_close(saguaro_proposal(q, 1, 0.0), torch.tensor([1 / 6, 0.0, 0.5, 1 / 3], dtype=torch.float64))
    ties = torch.full((4,), 0.25)
    torch.testing.assert_close(saguaro_proposal(ties, 2, 0.0), torch.tensor([0.0, 0.0, 0.5, 0.5]))
    assert top_ranks(ties).tolist() == [0, 1, 2, 3]
    torch.testing.assert_close(saguaro_proposal(q, 4, 0.3), q)  # every token scaled alike


def test_top_mask_equals_the_sorted_rank_rule_with_ties() -> None:
    """The top-k-based mask the draft uses per step names the same tokens as a full stable sort."""
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        v = int(torch.randint(1, 40, (1,), generator=g))
        q = torch.randint(0, 4, (3, v), generator=g).float()          # many ties, zeros
        f = torch.randint(0, v + 2, (3,), generator=g)
        assert torch.equal(top_mask(q, f), top_ranks(q) < f[:, None])
        one = torch.tensor(int(torch.randint(0, v + 1, (1,), generator=g)))
        assert torch.equal(top_mask(q, one), top_ranks(q) < one)


def test_saguaro_proposal_falls_back_per_row_and_takes_fan_out_per_position() -> None:
    q = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0], [0.2, 0.5, 0.3]])
    out = saguaro_proposal(q, 2, 0.0)
    torch.testing.assert_close(out[:2], q[:2])  # nothing left outside the top 2: q itself
    torch.testing.assert_close(out[2], torch.tensor([1.0, 0.0, 0.0]))
    per_row = saguaro_proposal(q[2:].expand(3, 3), torch.tensor([0, 1, 2]), 0.0)
    torch.testing.assert_close(per_row, torch.tensor([[0.2, 0.5, 0.3], [0.4, 0.0, 0.6], [1.0, 0.0, 0.0]]))
    batch = torch.softmax(torch.randn(2, 3, 5, generator=torch.Generator().manual_seed(0)), -1)
    out = saguaro_proposal(batch, torch.tensor([1, 2, 3]), 0.5)
    assert out.shape == batch.shape
    torch.testing.assert_close(out.sum(-1), torch.ones(2, 3))
    for bad_c in (-0.1, 1.5):
        with pytest.raises(ValueError):
            saguaro_proposal(q, 1, bad_c)
    with pytest.raises(ValueError):
        saguaro_proposal(q, -1, 0.5)


# ---------------------------------------------------------------- ngram_proposal itself


def test_ngram_proposal_matching_rules() -> None:
    assert ngram_proposal([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]  # n=3 fails, n=2 matches
    assert ngram_proposal([1, 2, 7, 1, 2, 8, 1, 2], 1, n=2) == [8]  # the most recent occurrence
    assert ngram_proposal([5, 1, 2, 9, 6, 1, 2, 7, 5, 1, 2], 1) == [9]  # the longest suffix first
    assert ngram_proposal([1, 2, 1, 2], 5, n=2) == [1, 2, 1, 2, 1]  # continues periodically
    assert ngram_proposal([3, 3], 3) == [3, 3, 3]
    assert ngram_proposal([1, 2, 3], 2) is None
    assert ngram_proposal([], 2) is None and ngram_proposal([4], 2) is None
    assert ngram_proposal([1, 2, 1], 0) == []
    with pytest.raises(ValueError):
        ngram_proposal([1, 2], 2, n=0)


def test_onehot_probs() -> None:
    probs = onehot_probs([2, 0, 2], 4)
    assert probs.shape == (3, 4) and probs.dtype == torch.float32
    assert probs.argmax(-1).tolist() == [2, 0, 2] and probs.sum().item() == 3
    assert onehot_probs(torch.tensor([1]), 2, torch.float64).dtype == torch.float64
    assert onehot_probs([], 5).shape == (0, 5)
    with pytest.raises(ValueError):
        onehot_probs([5], 5)
