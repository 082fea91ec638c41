"""Tests for ssd.speculation.verify: exactness of rejection sampling, by enumeration.

The exact check: a small vocabulary, a target p and a draft q that depend on the prefix of
already generated tokens (random probability tables indexed by the prefix). For one round we
enumerate every draft sequence d (weight prod_j q(d_j | d_<j)) and compute the probability of each
outcome (accepted length n, bonus t) twice: analytically from the verifier's own pieces
(acceptance_prob, residual), and by driving `verify()` itself over an exact partition of the
uniforms' space (every cell on which the verifier's decision is constant, weighted by its
volume). Then for every sequence x of length m + 1 (m = tokens proposed):
    P_SD(x) = sum over emitted e prefix of x of P(e) * P_target(x[len(e):] | e)  ==  P_target(x).
Deliberately broken verifiers (residual replaced by p; ratio using the wrong q) must fail it.
"""
from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable

import numpy as np
import pytest
import torch

import ssd.speculation.verify as verify_module
from ssd.layers.sampler import logits_to_probs
from ssd.speculation.verify import (
    VerifyResult,
    acceptance_prob,
    residual,
    verify,
    verify_with_generators,
)

torch.set_num_threads(1)

Table = dict[tuple[int, ...], np.ndarray]  # prefix -> next-token distribution (float64, sums to 1)


# ---------------------------------------------------------------- probability tables


def _distribution(kind: str, vocab: int, rng: np.random.Generator) -> np.ndarray:
    if kind == "random":
        return rng.dirichlet(np.ones(vocab))
    if kind == "one_hot":
        return np.eye(vocab)[rng.integers(vocab)]
    if kind == "sparse":  # random zeros, at least one token kept
        keep = rng.random(vocab) < 0.5
        keep[rng.integers(vocab)] = True
        probs = rng.dirichlet(np.ones(vocab)) * keep
        return probs / probs.sum()
    if kind == "filtered":  # through the real sampler: temperature, top-k, top-p
        logits = torch.tensor(rng.normal(size=(1, vocab)) * 2)
        temperature = torch.tensor([rng.uniform(0.3, 1.5)])
        top_k, top_p = torch.tensor([int(rng.integers(0, vocab))]), torch.tensor([rng.uniform(0.5, 1.0)])
        probs = logits_to_probs(logits, temperature, top_k, top_p)[0].double().numpy()
        return probs / probs.sum()
    raise ValueError(kind)


def _table(kind: str, vocab: int, depth: int, rng: np.random.Generator) -> Table:
    """A distribution for every prefix of length <= depth."""
    return {
        prefix: _distribution(kind, vocab, rng)
        for length in range(depth + 1)
        for prefix in itertools.product(range(vocab), repeat=length)
    }


def _saguaro(q: Table, fan_out: int, c: float) -> Table:
    """q' proportional to q with its top-F tokens scaled by C (the design's Saguaro sampling)."""
    out = {}
    for prefix, probs in q.items():
        scaled = probs.copy()
        scaled[np.argsort(-probs, kind="stable")[:fan_out]] *= c
        out[prefix] = scaled / scaled.sum()
    return out


def _target_prob(p: Table, prefix: tuple[int, ...], suffix: tuple[int, ...]) -> float:
    prob = 1.0
    for i, token in enumerate(suffix):
        prob *= p[prefix + suffix[:i]][token]
    return prob


# ---------------------------------------------------------------- one round, enumerated


class Round:
    """Every draft sequence of one round as a batch: row b proposes drafts[b] (m tokens)."""

    def __init__(
        self, p: Table, q_sample: Table, q_verify: Table, vocab: int, k: int, m: int, rng: np.random.Generator
    ) -> None:
        self.vocab, self.k, self.m = vocab, k, m
        self.drafts = list(itertools.product(range(vocab), repeat=m))
        n = len(self.drafts)
        self.weight = torch.tensor([_target_prob(q_sample, (), d) for d in self.drafts], dtype=torch.float64)
        # positions beyond m are junk the verifier must ignore
        target = rng.dirichlet(np.ones(vocab), size=(n, k + 1))
        draft = rng.dirichlet(np.ones(vocab), size=(n, k))
        tokens = rng.integers(vocab, size=(n, k))
        for b, d in enumerate(self.drafts):
            for j in range(m + 1):
                target[b, j] = p[d[:j]]
            for j in range(m):
                draft[b, j] = q_verify[d[:j]]
                tokens[b, j] = d[j]
        self.target_probs = torch.tensor(target)
        self.draft_probs = torch.tensor(draft)
        self.draft_tokens = torch.tensor(tokens)
        self.num_draft = torch.full((n,), m, dtype=torch.long)


def outcomes_from_pieces(r: Round, residual_fn: Callable = residual) -> torch.Tensor:
    """P(n, t | d) [N, m+1, V] computed directly from acceptance_prob and residual."""
    m = r.m
    tok = r.draft_tokens[:, :m, None]
    alpha = acceptance_prob(r.target_probs[:, :m].gather(-1, tok)[..., 0], r.draft_probs[:, :m].gather(-1, tok)[..., 0])
    out = torch.zeros(len(r.drafts), m + 1, r.vocab, dtype=torch.float64)
    reach = torch.ones(len(r.drafts), dtype=torch.float64)  # P(first n accepted)
    for n in range(m):
        bonus = residual_fn(r.target_probs[:, n], r.draft_probs[:, n])
        out[:, n] = (reach * (1 - alpha[:, n]))[:, None] * bonus
        reach = reach * alpha[:, n]
    out[:, m] = reach[:, None] * r.target_probs[:, m]
    return out


def outcomes_from_verify(r: Round) -> torch.Tensor:
    """P(n, t | d) [N, m+1, V] by running verify() on every cell of an exact partition of [0,1)^(K+1).

    Accept coordinate j is cut at alpha_j (verify accepts iff u < alpha_j; checked separately at the
    boundary). The bonus coordinate is cut at every CDF value of every distribution the bonus could
    be drawn from, right or wrong (p_j, q_j, residuals), so the bonus is constant on each cell.
    """
    n, k, vocab = len(r.drafts), r.k, r.vocab
    tok = r.draft_tokens[..., None]
    alpha = acceptance_prob(r.target_probs[:, :k].gather(-1, tok)[..., 0], r.draft_probs.gather(-1, tok)[..., 0])
    below = torch.tensor(list(itertools.product([True, False], repeat=k)), dtype=torch.bool).reshape(-1, k)
    accept_u = torch.where(below, alpha[:, None] / 2, (1 + alpha[:, None]) / 2)  # [N, 2^K, K]
    accept_w = torch.where(below, alpha[:, None], 1 - alpha[:, None]).prod(-1)  # [N, 2^K]

    dists = torch.cat([r.target_probs, r.draft_probs, residual(r.target_probs[:, :k], r.draft_probs)], dim=1)
    cdf = (dists.cumsum(-1) / dists.sum(-1, keepdim=True)).flatten(1).clamp(0, 1)
    ends = torch.tensor([[0.0, 1.0]], dtype=torch.float64).expand(n, 2)
    cuts = torch.cat([ends, cdf], dim=1).sort(-1).values
    bonus_u = (cuts[:, 1:] + cuts[:, :-1]) / 2  # [N, M]
    bonus_w = cuts[:, 1:] - cuts[:, :-1]

    a, mb = accept_u.shape[1], bonus_u.shape[1]
    rows = torch.arange(n).repeat_interleave(a * mb)
    result = verify(
        r.target_probs[rows],
        r.draft_probs[rows],
        r.draft_tokens[rows],
        accept_u[:, :, None, :].expand(n, a, mb, k).reshape(-1, k),
        bonus_u[:, None, :].expand(n, a, mb).reshape(-1),
        num_draft=r.num_draft[rows],
    )
    weight = (accept_w[:, :, None] * bonus_w[:, None, :]).reshape(-1)
    out = torch.zeros(n, r.m + 1, vocab, dtype=torch.float64)
    out.index_put_((rows, result.accepted_len, result.bonus_token), weight, accumulate=True)
    return out


def exactness_error(p: Table, r: Round, outcomes: torch.Tensor) -> float:
    """max over x in V^(m+1) of |P_SD(x) - P_target(x)|."""
    emitted: dict[tuple[int, ...], float] = {}
    joint = (r.weight[:, None, None] * outcomes).numpy()
    for b, d in enumerate(r.drafts):
        for n, t in zip(*np.nonzero(joint[b])):
            e = d[:n] + (int(t),)
            emitted[e] = emitted.get(e, 0.0) + joint[b, n, t]
    assert abs(sum(emitted.values()) - 1) < 1e-9
    error = 0.0
    for x in itertools.product(range(r.vocab), repeat=r.m + 1):
        sd = sum(emitted.get(x[:i], 0.0) * _target_prob(p, x[:i], x[i:]) for i in range(1, r.m + 2))
        error = max(error, abs(sd - _target_prob(p, (), x)))
    return error


CASES = [
    # (vocab, K, m = tokens proposed, p kind, q kind)
    (3, 1, 1, "random", "random"),
    (4, 2, 2, "random", "random"),
    (4, 3, 3, "random", "random"),
    (3, 4, 4, "random", "random"),
    (4, 3, 3, "random", "one_hot"),  # deterministic proposals
    (3, 4, 4, "random", "one_hot"),
    (4, 3, 3, "random", "sparse"),  # q has zeros where p > 0
    (4, 3, 3, "sparse", "random"),  # p has zeros where q > 0
    (4, 3, 3, "sparse", "sparse"),
    (4, 3, 3, "one_hot", "random"),  # temperature 0 target
    (4, 3, 3, "one_hot", "one_hot"),  # greedy target, greedy draft
    (4, 3, 3, "filtered", "filtered"),  # through logits_to_probs with temperature/top-k/top-p
    (4, 3, 1, "random", "random"),  # num_draft < K
    (3, 4, 2, "random", "one_hot"),
    (4, 2, 0, "random", "random"),
]


@pytest.mark.parametrize("vocab,k,m,p_kind,q_kind", CASES)
def test_one_round_is_exactly_the_target(vocab: int, k: int, m: int, p_kind: str, q_kind: str) -> None:
    rng = np.random.default_rng(zlib.crc32(repr((vocab, k, m, p_kind, q_kind)).encode()))
    p = _table(p_kind, vocab, m, rng)
    q = _table(q_kind, vocab, max(m - 1, 0), rng)
    r = Round(p, q, q, vocab, k, m, rng)
    from_pieces = outcomes_from_pieces(r)
    from_verify = outcomes_from_verify(r)
    torch.testing.assert_close(from_verify, from_pieces, rtol=0, atol=1e-12)
    assert exactness_error(p, r, from_verify) < 1e-9


def test_saguaro_proposal_is_exact_when_verified_with_what_was_sampled() -> None:
    rng = np.random.default_rng(10)
    p, q = _table("random", 4, 3, rng), _table("random", 4, 2, rng)
    q_prime = _saguaro(q, fan_out=2, c=0.3)
    r = Round(p, q_prime, q_prime, 4, 3, 3, rng)
    assert exactness_error(p, r, outcomes_from_verify(r)) < 1e-9


# ---------------------------------------------------------------- the checker can fail


def test_checker_detects_residual_replaced_by_p(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(11)
    p, q = _table("random", 4, 2, rng), _table("random", 4, 1, rng)
    r = Round(p, q, q, 4, 2, 2, rng)
    broken_pieces = outcomes_from_pieces(r, residual_fn=lambda p_j, q_j: p_j)
    assert exactness_error(p, r, broken_pieces) > 1e-3
    monkeypatch.setattr(verify_module, "residual", lambda p_j, q_j: p_j)
    broken_verify = outcomes_from_verify(r)
    torch.testing.assert_close(broken_verify, broken_pieces, rtol=0, atol=1e-12)
    assert exactness_error(p, r, broken_verify) > 1e-3


def test_checker_detects_ratio_with_the_wrong_q() -> None:
    rng = np.random.default_rng(12)
    p, q = _table("random", 4, 3, rng), _table("random", 4, 2, rng)
    other = _table("random", 4, 2, rng)
    r = Round(p, q, other, 4, 3, 3, rng)
    assert exactness_error(p, r, outcomes_from_verify(r)) > 1e-3
    # the Saguaro pitfall: sample from q' but verify with the unmodified q
    q_prime = _saguaro(q, fan_out=2, c=0.3)
    r = Round(p, q_prime, q, 4, 3, 3, rng)
    assert exactness_error(p, r, outcomes_from_verify(r)) > 1e-3


def test_checker_detects_deterministic_proposal_treated_as_sampled() -> None:
    """An argmax draft verified with its soft q (instead of the one-hot it really used)."""
    rng = np.random.default_rng(13)
    p, q = _table("random", 4, 3, rng), _table("random", 4, 2, rng)
    one_hot = {prefix: np.eye(4)[int(np.argmax(probs))] for prefix, probs in q.items()}
    r = Round(p, one_hot, one_hot, 4, 3, 3, rng)
    assert exactness_error(p, r, outcomes_from_verify(r)) < 1e-9
    r = Round(p, one_hot, q, 4, 3, 3, rng)
    assert exactness_error(p, r, outcomes_from_verify(r)) > 1e-3


# ---------------------------------------------------------------- the pieces and the boundaries


def test_acceptance_prob_and_residual_pieces() -> None:
    p = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0])
    q = torch.tensor([0.25, 0.4, 0.4, 0.0, 0.0])
    torch.testing.assert_close(acceptance_prob(p, q), torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0]))
    torch.testing.assert_close(residual(p, q), torch.tensor([0.25, 0.0, 0.0, 0.3, 0.0]) / 0.55)
    torch.testing.assert_close(residual(p, p), p)  # zero mass: fall back to p
    one_hot = torch.tensor([0.0, 0.0, 1.0, 0.0, 0.0])
    torch.testing.assert_close(residual(p, one_hot), torch.tensor([0.5, 0.0, 0.0, 0.3, 0.0]) / 0.8)


def test_verify_decides_exactly_at_u_equal_alpha() -> None:
    """Accept iff u < alpha: u = alpha rejects, the float just below accepts."""
    gen = torch.Generator().manual_seed(14)
    batch, k, vocab = 32, 4, 7
    target = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen, dtype=torch.float64), -1)
    draft = torch.softmax(torch.randn(batch, k, vocab, generator=gen, dtype=torch.float64), -1)
    tokens = torch.randint(vocab, (batch, k), generator=gen)
    tok = tokens[..., None]
    alpha = acceptance_prob(target[:, :k].gather(-1, tok)[..., 0], draft.gather(-1, tok)[..., 0])
    assert (alpha > 0).all()
    just_below = torch.nextafter(alpha, torch.zeros_like(alpha))
    position = torch.arange(k)
    for j in range(k + 1):
        u = torch.where(position < j, just_below, torch.where(position == j, alpha, just_below))
        result = verify(target, draft, tokens, u, torch.full((batch,), 0.5, dtype=torch.float64))
        assert (result.accepted_len == j).all()


def test_zero_draft_positions_bonus_from_first_target() -> None:
    target = torch.tensor([[[0.0, 1.0, 0.0]], [[0.2, 0.0, 0.8]]])
    no_tokens = torch.zeros(2, 0, dtype=torch.long)
    result = verify(target, torch.zeros(2, 0, 3), no_tokens, torch.zeros(2, 0), torch.tensor([0.3, 0.1]))
    assert result.accepted_len.tolist() == [0, 0] and result.bonus_token.tolist() == [1, 0]


def test_shape_mismatch_is_reported() -> None:
    with pytest.raises(ValueError, match="draft_tokens"):
        wrong_tokens = torch.zeros(2, 3, dtype=torch.long)
        verify(torch.ones(2, 3, 5) / 5, torch.ones(2, 2, 5) / 5, wrong_tokens, torch.zeros(2, 2), torch.zeros(2))


# ---------------------------------------------------------------- greedy and generators


@pytest.mark.parametrize("one_hot_draft", [False, True])
def test_greedy_target_accepts_common_prefix_with_argmax(one_hot_draft: bool) -> None:
    gen = torch.Generator().manual_seed(15 + one_hot_draft)
    batch, k, vocab = 256, 5, 6
    logits = torch.randn(batch * (k + 1), vocab, generator=gen)
    zeros = torch.zeros(batch * (k + 1))
    target = logits_to_probs(logits, zeros, zeros.long(), zeros + 1).reshape(batch, k + 1, vocab)
    argmax = logits.argmax(-1).reshape(batch, k + 1)
    random_tokens = torch.randint(vocab, (batch, k), generator=gen)
    tokens = torch.where(torch.rand(batch, k, generator=gen) < 0.75, argmax[:, :k], random_tokens)
    if one_hot_draft:
        draft = torch.nn.functional.one_hot(tokens, vocab).float()
    else:
        draft = torch.softmax(torch.randn(batch, k, vocab, generator=gen), -1)
    num_draft = torch.randint(k + 1, (batch,), generator=gen)
    accept_u, bonus_u = torch.rand(batch, k, generator=gen), torch.rand(batch, generator=gen)
    result = verify(target, draft, tokens, accept_u, bonus_u, num_draft)

    matches = (tokens == argmax[:, :k]) & (torch.arange(k) < num_draft[:, None])
    expected_len = matches.long().cumprod(-1).sum(-1)
    assert torch.equal(result.accepted_len, expected_len)
    assert torch.equal(result.bonus_token, argmax[torch.arange(batch), expected_len])
    assert (expected_len < num_draft).any() and (expected_len == num_draft).any() and (num_draft < k).any()


def _random_round(seed: int, batch: int, k: int = 4, vocab: int = 9) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    target = torch.softmax(torch.randn(batch, k + 1, vocab, generator=gen), -1)
    draft = torch.softmax(torch.randn(batch, k, vocab, generator=gen) * 0.5, -1)
    tokens = torch.multinomial(draft.reshape(-1, vocab), 1, generator=gen).reshape(batch, k)
    return target, draft, tokens


def test_seeded_verification_ignores_batch_mates_and_order() -> None:
    target, draft, tokens = _random_round(16, batch=5)

    def run(order: list[int], seeds: dict[int, int]) -> list[tuple[int, int]]:
        gens = {i: torch.Generator().manual_seed(s) for i, s in seeds.items()}
        picked: list[tuple[int, int]] = []
        for _ in range(30):
            row_gens = [gens.get(i) for i in order]
            result: VerifyResult = verify_with_generators(target[order], draft[order], tokens[order], row_gens)
            at = order.index(3)
            picked.append((int(result.accepted_len[at]), int(result.bonus_token[at])))
        return picked

    alone = run([3], {3: 42})
    assert alone == run([0, 3, 4], {3: 42, 0: 1}) == run([4, 2, 1, 3], {3: 42, 4: 1, 2: 1})
    assert len(set(alone)) > 3


def test_generators_give_k_accept_uniforms_then_the_bonus_uniform() -> None:
    target, draft, tokens = _random_round(18, batch=3)
    seeds = [7, 8, 9]
    result = verify_with_generators(target, draft, tokens, [torch.Generator().manual_seed(s) for s in seeds])
    u = torch.stack([torch.rand(5, dtype=torch.float64, generator=torch.Generator().manual_seed(s)) for s in seeds])
    expected = verify(target, draft, tokens, u[:, :4], u[:, 4])
    assert torch.equal(result.accepted_len, expected.accepted_len)
    assert torch.equal(result.bonus_token, expected.bonus_token)


def test_a_row_consumes_uniforms_by_its_own_num_draft_not_its_batch_mates() -> None:
    """Row b draws num_draft[b] + 1 uniforms: the same alone (K = its num_draft) as next to a mate
    that drafts more (K = the mate's), so a seeded request's stream ignores its batch mates."""
    target, draft, tokens = _random_round(17, batch=2)
    g_alone, g_row = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    alone = verify_with_generators(target[1:, :2], draft[1:, :1], tokens[1:, :1], [g_alone])
    mixed = verify_with_generators(target, draft, tokens, [torch.Generator().manual_seed(9), g_row],
                                   num_draft=torch.tensor([draft.shape[1], 1]))
    assert torch.equal(torch.rand(3, generator=g_alone), torch.rand(3, generator=g_row))
    assert int(alone.accepted_len[0]) == int(mixed.accepted_len[1])
    assert int(alone.bonus_token[0]) == int(mixed.bonus_token[1])
