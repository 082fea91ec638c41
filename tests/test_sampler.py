"""Tests for ssd.layers.sampler: logits -> probabilities -> tokens."""
from __future__ import annotations

import itertools

import numpy as np
import torch
from scipy import stats

from ssd.layers.sampler import inverse_cdf_sample, logits_to_probs, sample, uniforms

torch.set_num_threads(1)


def _params(rows: list[tuple[float, int, float]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    temperature, top_k, top_p = zip(*rows)
    return torch.tensor(temperature), torch.tensor(top_k), torch.tensor(top_p)


def _reference_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Naive float64 version of the documented semantics, one row at a time."""
    vocab = len(logits)
    if temperature == 0:
        out = np.zeros(vocab)
        out[int(np.argmax(logits))] = 1.0  # np.argmax: first maximum
        return out
    z = logits / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    order = sorted(range(vocab), key=lambda t: (-probs[t], t))
    kept = order[:top_k] if 0 < top_k < vocab else order
    if top_p < 1:
        mass = sum(probs[t] for t in kept)
        chosen, cum = [], 0.0
        for t in kept:
            chosen.append(t)
            cum += probs[t] / mass
            if cum >= top_p:
                break
        kept = chosen
    out = np.zeros(vocab)
    out[kept] = probs[kept]
    return out / out.sum()


def _top_p_is_ambiguous(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> bool:
    """True when float32 rounding could legitimately move the top-p cut (mass within 1e-5 of top_p)."""
    if temperature == 0 or top_p >= 1:
        return False
    z = logits / temperature
    probs = np.sort(np.exp(z - z.max()))[::-1]
    if 0 < top_k < len(probs):
        probs = probs[:top_k]
    cum = np.cumsum(probs / probs.sum())
    return bool(np.any(np.abs(cum - top_p) < 1e-5))


def test_temperature_scaling_matches_softmax() -> None:
    logits = torch.randn(5, 17, generator=torch.Generator().manual_seed(0)) * 3
    temperature = torch.tensor([1.0, 0.5, 2.0, 0.05, 7.0])
    probs = logits_to_probs(logits, temperature, torch.zeros(5, dtype=torch.long), torch.ones(5))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, torch.softmax(logits / temperature[:, None], dim=-1))


def test_low_precision_logits_give_float32_probs() -> None:
    logits = torch.randn(3, 11).to(torch.bfloat16)
    probs = logits_to_probs(logits, torch.ones(3), torch.zeros(3, dtype=torch.long), torch.ones(3))
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs.sum(-1), torch.ones(3))


def test_matches_reference_on_mixed_batches() -> None:
    gen = torch.Generator().manual_seed(1)
    vocab = 13
    temperatures = [0.0, 0.3, 1.0, 1.7]
    top_ks = [0, 1, 2, 5, vocab - 1, vocab, vocab + 4]
    top_ps = [1.0, 0.999, 0.9, 0.5, 0.1, 1e-6]
    combos = list(itertools.product(temperatures, top_ks, top_ps))
    for trial in range(3):
        logits = torch.randn(len(combos), vocab, generator=gen) * (1 + trial)
        perm = torch.randperm(len(combos), generator=gen).tolist()
        rows = [combos[i] for i in perm]
        probs = logits_to_probs(logits, *_params(rows)).double().numpy()
        checked = 0
        for b, (t, k, p) in enumerate(rows):
            row = logits[b].double().numpy()
            if _top_p_is_ambiguous(row, t, k, p):
                continue
            expected = _reference_row(row, t, k, p)
            np.testing.assert_array_equal(probs[b] > 0, expected > 0, err_msg=f"support, params {(t, k, p)}")
            np.testing.assert_allclose(probs[b], expected, atol=2e-6, err_msg=f"params {(t, k, p)}")
            checked += 1
        assert checked > 0.9 * len(rows)


def test_top_k_ties_keep_exactly_k_lowest_ids_first() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0, 3.0, 3.0, 2.0]] * 3)
    probs = logits_to_probs(logits, torch.ones(3), torch.tensor([2, 3, 5]), torch.ones(3))
    assert (probs > 0).sum(-1).tolist() == [2, 3, 5]
    assert torch.nonzero(probs[0]).flatten().tolist() == [1, 2]
    assert torch.nonzero(probs[1]).flatten().tolist() == [1, 2, 4]
    assert torch.nonzero(probs[2]).flatten().tolist() == [1, 2, 4, 5, 6]
    torch.testing.assert_close(probs[1, [1, 2, 4]], torch.full((3,), 1 / 3))
    # a long run of exact ties: the kept set is still the k (or top-p) lowest token ids
    flat = torch.zeros(2, 4096)
    probs = logits_to_probs(flat, torch.ones(2), torch.tensor([10, 0]), torch.tensor([1.0, 0.5]))
    assert torch.nonzero(probs[0]).flatten().tolist() == list(range(10))
    assert torch.nonzero(probs[1]).flatten().tolist() == list(range(2048))


def test_top_p_keeps_smallest_covering_set_and_at_least_one() -> None:
    probs_in = torch.tensor([[0.1, 0.4, 0.2, 0.3]])
    logits = probs_in.log().repeat(4, 1)
    top_p = torch.tensor([1e-9, 0.4, 0.65, 0.95])
    probs = logits_to_probs(logits, torch.ones(4), torch.zeros(4, dtype=torch.long), top_p)
    assert [torch.nonzero(r).flatten().tolist() for r in probs] == [[1], [1], [1, 3], [0, 1, 2, 3]]
    torch.testing.assert_close(probs[2], torch.tensor([0.0, 4 / 7, 0.0, 3 / 7]))
    # mass exactly equal to top_p (exact in float): the set that reaches it is enough
    no_k = torch.zeros(2, dtype=torch.long)
    even = logits_to_probs(torch.zeros(2, 4), torch.ones(2), no_k, torch.tensor([0.5, 0.75]))
    assert [torch.nonzero(r).flatten().tolist() for r in even] == [[0, 1], [0, 1, 2]]


def test_top_k_then_top_p_uses_renormalized_mass() -> None:
    logits = torch.tensor([[0.1, 0.4, 0.2, 0.3]]).log()
    # after top-2: {1: 4/7, 3: 3/7}; top_p 0.5 keeps only token 1 (4/7 >= 0.5)
    probs = logits_to_probs(logits, torch.ones(1), torch.tensor([2]), torch.tensor([0.5]))
    assert torch.nonzero(probs[0]).flatten().tolist() == [1]


def test_greedy_is_one_hot_at_first_max_whatever_the_filters() -> None:
    logits = torch.tensor([[0.0, 2.0, 5.0, 5.0, 1.0]] * 3)
    probs = logits_to_probs(logits, torch.zeros(3), torch.tensor([0, 1, 3]), torch.tensor([1.0, 0.2, 0.9]))
    torch.testing.assert_close(probs, torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0]] * 3))


def test_masked_logits_get_zero_probability() -> None:
    logits = torch.tensor([[0.0, float("-inf"), 1.0, float("-inf")]] * 2)
    probs = logits_to_probs(logits, torch.tensor([1.0, 0.7]), torch.tensor([0, 3]), torch.tensor([1.0, 0.99]))
    assert (probs[:, [1, 3]] == 0).all()
    torch.testing.assert_close(probs.sum(-1), torch.ones(2))


def test_uniforms_per_row_generators() -> None:
    u = uniforms([torch.Generator().manual_seed(3), None, torch.Generator().manual_seed(3)], 4)
    assert u.shape == (3, 4) and u.dtype == torch.float64
    assert torch.equal(u[0], u[2]) and ((u >= 0) & (u < 1)).all()
    assert torch.equal(u[0], torch.rand(4, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))


def test_seeded_sampling_ignores_batch_mates_and_order() -> None:
    gen = torch.Generator().manual_seed(4)
    probs = torch.softmax(torch.randn(6, 50, generator=gen), dim=-1)

    def draw(order: list[int], seeds: dict[int, int]) -> dict[int, list[int]]:
        gens = {i: torch.Generator().manual_seed(s) for i, s in seeds.items()}
        out: dict[int, list[int]] = {i: [] for i in order}
        for _ in range(20):
            tokens = sample(probs[order], [gens.get(i) for i in order])
            for i, t in zip(order, tokens.tolist()):
                out[i].append(t)
        return out

    alone = draw([2], {2: 123})[2]
    crowded = draw([5, 0, 2, 3], {2: 123, 0: 9, 3: 77})[2]
    reordered = draw([2, 3, 1], {2: 123, 1: 5})[2]
    assert alone == crowded == reordered
    assert len(set(alone)) > 1


def test_greedy_rows_return_argmax() -> None:
    probs = torch.zeros(4, 9)
    probs[torch.arange(4), torch.tensor([0, 8, 3, 3])] = 1.0
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    for _ in range(5):
        assert sample(probs, gens).tolist() == [0, 8, 3, 3]


def test_never_returns_zero_probability_tokens() -> None:
    probs = torch.tensor(
        [[0.0, 0.3, 0.0, 0.7, 0.0, 0.0], [0.0, 0.0, 1e-30, 0.0, 0.0, 0.0], [0.0, 0.5, 0.5, 0.0, 0.0, 0.0]]
    )
    extremes = [0.0, 1e-300, 0.3, 0.5, 1 - 2**-53, 1.0]
    for u in extremes:
        tokens = inverse_cdf_sample(probs, torch.full((3,), u, dtype=torch.float64))
        assert (probs[torch.arange(3), tokens] > 0).all(), u
    assert inverse_cdf_sample(probs, torch.ones(3, dtype=torch.float64)).tolist() == [3, 2, 2]
    assert inverse_cdf_sample(probs, torch.zeros(3, dtype=torch.float64)).tolist() == [1, 2, 1]
    # rounding-heavy rows: many tiny masses after a large one, unnormalized float32
    gen = torch.Generator().manual_seed(5)
    rough = torch.rand(64, 1000, generator=gen) ** 8 * (torch.rand(64, 1000, generator=gen) < 0.3)
    rough[:, 0] += 1e4
    for u in extremes:
        tokens = inverse_cdf_sample(rough, torch.full((64,), u, dtype=torch.float64))
        assert (rough[torch.arange(64), tokens] > 0).all(), u


def test_empirical_frequencies_match_probs() -> None:
    torch.manual_seed(6)
    target = torch.tensor([0.05, 0.3, 0.0, 0.15, 0.4, 0.1], dtype=torch.float64)
    n = 20000
    tokens = sample(target.repeat(n, 1), [None] * n)
    shared = torch.Generator().manual_seed(7)
    tokens_gen = sample(target.repeat(n, 1), [shared] * n)
    for drawn in (tokens, tokens_gen):
        counts = torch.bincount(drawn, minlength=6).double().numpy()
        assert counts[2] == 0
        expected = n * target.numpy() / target.numpy().sum()
        support = expected > 0
        result = stats.chisquare(counts[support], expected[support])
        assert result.pvalue > 1e-3, result
