"""Tests for ssd.speculation.fanout: the geometric planner, the budget model, the online estimators."""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from ssd.speculation.fanout import (
    AcceptanceEstimator,
    MissCurveEstimator,
    budget_from_timings,
    continuous_fanout,
    geometric_fanout,
    modelled_hit_rate,
    outcome_probs,
    uniform_fanout,
)

torch.set_num_threads(1)

GRID = list(itertools.product([0.3, 0.5, 0.7, 0.9], [0.3, 0.7, 1.5], [1, 2, 4, 6]))


# ---------------------------------------------------------------- the continuous solution


@pytest.mark.parametrize("a,r,k", GRID)
def test_continuous_plan_is_the_closed_form(a: float, r: float, k: int) -> None:
    budget = 40.0
    plan = continuous_fanout(a, r, k, budget)
    assert len(plan) == k + 1 and math.isclose(sum(plan), budget, rel_tol=1e-12)
    f0 = plan[0]
    for j in range(k):
        assert math.isclose(plan[j], f0 * a ** (j / (1 + r)), rel_tol=1e-12)
    assert math.isclose(plan[k], f0 * a ** (k / (1 + r)) * (1 - a) ** (-1 / (1 + r)), rel_tol=1e-12)
    # proportional to P(k)^(1/(1+r)), and the Lagrange condition P(k) r F_k^(-r-1) = const holds
    probs = outcome_probs(a, k)
    assert math.isclose(sum(probs), 1.0, rel_tol=1e-12)
    ratios = [f / p ** (1 / (1 + r)) for f, p in zip(plan, probs)]
    assert max(ratios) / min(ratios) - 1 < 1e-12
    marginal = [p * r * f ** (-r - 1) for p, f in zip(probs, plan)]
    assert max(marginal) / min(marginal) - 1 < 1e-12


def test_continuous_plan_is_a_maximum_of_the_model() -> None:
    """Budget-preserving perturbations never raise the modelled hit rate (all F_k >= 1 here)."""
    rng = np.random.default_rng(0)
    checked = 0
    for a, r, k in GRID:
        plan = np.array(continuous_fanout(a, r, k, 200.0))
        if plan.min() <= 1.2:
            continue
        checked += 1
        best = modelled_hit_rate(plan.tolist(), a, r, k)
        for _ in range(20):
            step = rng.normal(size=k + 1)
            step -= step.mean()
            moved = plan + 0.5 * step * plan.min() / np.abs(step).max()
            assert modelled_hit_rate(moved.tolist(), a, r, k) <= best + 1e-12
    assert checked >= 0.75 * len(GRID)


def test_modelled_hit_rate_values() -> None:
    a, r = 0.6, 1.0
    probs = outcome_probs(a, 2)
    assert probs == pytest.approx([0.4, 0.24, 0.36])
    assert modelled_hit_rate([0, 1, 4], a, r, 2) == pytest.approx(0.36 * 0.75)  # F=0 and F=1: no hits
    assert modelled_hit_rate([2, 2, 2], a, r, 2) == pytest.approx(0.5)
    with pytest.raises(ValueError):
        modelled_hit_rate([1, 1], a, r, 2)
    for bad in [(0.0, 1.0), (1.0, 1.0), (0.5, 0.0), (0.5, -1.0)]:
        with pytest.raises(ValueError):
            continuous_fanout(*bad, 2, 10)


# ---------------------------------------------------------------- the integer plan


@pytest.mark.parametrize("a,r,k", GRID)
def test_integer_plan_sums_to_budget_and_beats_uniform(a: float, r: float, k: int) -> None:
    for budget in sorted({k + 1, 2 * (k + 1), 16, 40, 100}):
        plan = geometric_fanout(a, r, k, budget)
        uniform = uniform_fanout(budget, k)
        assert sum(plan) == budget == sum(uniform)
        assert min(plan) >= 1  # budget >= K + 1 here: min_each = 1 holds
        hit, hit_uniform = modelled_hit_rate(plan, a, r, k), modelled_hit_rate(uniform, a, r, k)
        assert hit >= hit_uniform - 1e-12
        # exact integer optimum above the floor: no single unit move helps
        for i, j in itertools.permutations(range(k + 1), 2):
            if plan[j] > 1:
                moved = list(plan)
                moved[i] += 1
                moved[j] -= 1
                assert modelled_hit_rate(moved, a, r, k) <= hit + 1e-12


def test_integer_plan_strictly_beats_uniform_where_outcomes_differ() -> None:
    better = 0
    for a, r, k in GRID:
        if k < 2:
            continue
        plan, uniform = geometric_fanout(a, r, k, 40), uniform_fanout(40, k)
        better += modelled_hit_rate(plan, a, r, k) > modelled_hit_rate(uniform, a, r, k) + 1e-6
    assert better >= 0.9 * sum(1 for *_, k in GRID if k >= 2)


def test_unpolished_plan_is_largest_remainder_rounding() -> None:
    for a, r, k in GRID:
        for budget in [0, 1, 3, 7, 16, 41]:
            cont = continuous_fanout(a, r, k, budget)
            plan = geometric_fanout(a, r, k, budget, min_each=0, polish=False)
            assert sum(plan) == budget and min(plan) >= 0
            assert all(abs(f - c) < 1 for f, c in zip(plan, cont))
            polished = geometric_fanout(a, r, k, budget, min_each=0)
            assert sum(polished) == budget
            assert modelled_hit_rate(polished, a, r, k) >= modelled_hit_rate(plan, a, r, k) - 1e-12


def test_small_budgets_drop_the_floor() -> None:
    plan = geometric_fanout(0.8, 0.5, 4, 3)
    assert sum(plan) == 3 and min(plan) >= 0
    assert geometric_fanout(0.8, 0.5, 4, 0) == [0] * 5
    assert geometric_fanout(0.5, 1.0, 0, 7) == [7]
    assert uniform_fanout(7, 2) == [3, 2, 2]
    assert min(geometric_fanout(0.95, 0.5, 4, 10, min_each=2)) >= 2


def test_high_acceptance_favours_all_accepted() -> None:
    plan = geometric_fanout(0.9, 0.7, 4, 40)
    assert plan[-1] == max(plan)
    low = geometric_fanout(0.2, 0.7, 4, 40)
    assert low[:4] == sorted(low[:4], reverse=True) and low[0] == max(low)


# ---------------------------------------------------------------- budget


def test_budget_model_and_monotonicity() -> None:
    # linear rows: K * t(R) <= 0.9 * verify -> R <= 0.9 * 0.1 / (4 * 0.001) = 22.5 -> 22 rows
    assert budget_from_timings(0.1, 0.001, 4, 1) == 22
    assert budget_from_timings(0.1, 0.001, 4, 2) == 11
    assert budget_from_timings(0.1, 0.001, 4, 1, row_cost=0.5) == 44
    assert budget_from_timings(0.1, 0.001, 4, 1, row_cost=0.0) == 256
    assert budget_from_timings(0.001, 0.001, 4, 1) == 0  # not even one step fits
    assert budget_from_timings(10.0, 0.001, 4, 1) == 256  # capped
    base = dict(verify_s=0.05, draft_step_s=0.002, num_draft=3, batch=2)
    grid = {
        "verify_s": np.linspace(0.0, 0.5, 40),
        "draft_step_s": np.linspace(1e-4, 0.02, 40),
        "num_draft": range(1, 9),
        "batch": range(1, 9),
    }
    increasing = {"verify_s": True, "draft_step_s": False, "num_draft": False, "batch": False}
    for name, values in grid.items():
        budgets = [budget_from_timings(**{**base, name: v}) for v in values]
        assert all(0 <= b <= 256 for b in budgets)
        pairs = list(zip(budgets, budgets[1:]))
        assert all((x <= y) if increasing[name] else (x >= y) for x, y in pairs), (name, budgets)
        assert budgets[0] != budgets[-1]
    costs = [budget_from_timings(0.05, 0.002, 3, 1, row_cost=c) for c in np.linspace(0, 1, 11)]
    assert costs == sorted(costs, reverse=True)
    overheads = [budget_from_timings(0.05, 0.002, 3, 1, overhead_s=o) for o in np.linspace(0, 0.05, 11)]
    assert overheads == sorted(overheads, reverse=True)
    with pytest.raises(ValueError):
        budget_from_timings(0.1, 0.0, 4, 1)


# ---------------------------------------------------------------- estimators


def test_acceptance_estimator_recovers_rate_and_tracks_change() -> None:
    rng = np.random.default_rng(1)

    def rounds(est: AcceptanceEstimator, a: float, n: int, k: int = 4) -> None:
        for _ in range(n):
            accepted = 0
            while accepted < k and rng.random() < a:
                accepted += 1
            est.observe(accepted, k)

    counts = AcceptanceEstimator(decay=1.0)
    assert counts.rate == pytest.approx(0.7)  # the prior alone
    rounds(counts, 0.8, 4000)
    assert counts.rate == pytest.approx(0.8, abs=0.01)
    ema = AcceptanceEstimator(decay=0.97)
    rounds(ema, 0.8, 500)
    rounds(ema, 0.3, 300)
    assert ema.rate == pytest.approx(0.3, abs=0.07)
    sure = AcceptanceEstimator(decay=1.0)
    for _ in range(100):
        sure.observe(4, 4)
    assert 0.99 < sure.rate <= 1 - sure.eps
    with pytest.raises(ValueError):
        sure.observe(5, 4)


def _power_law_ranks(r: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """Ranks with P(rank >= F) = F^-r exactly for integer F >= 1: floor of a Pareto(r) draw."""
    u = 1.0 - rng.random(n)  # (0, 1]
    return np.floor(u ** (-1.0 / r)).astype(np.int64)


@pytest.mark.parametrize("true_r", [0.3, 0.8, 1.5, 3.0])
def test_miss_curve_estimator_recovers_r_from_ranks(true_r: float) -> None:
    rng = np.random.default_rng(int(true_r * 100))
    est = MissCurveEstimator(max_fan_out=32)
    for rank in _power_law_ranks(true_r, 4000, rng):
        est.observe_rank(int(rank) if rank < 10**6 else None)
    assert est.r == pytest.approx(true_r, rel=0.05)
    miss = est.miss_rates()
    assert miss[1] == 1.0 and miss[4] == pytest.approx(4**-true_r, abs=0.03)


def test_miss_curve_estimator_from_hits_prior_and_clamp() -> None:
    rng = np.random.default_rng(7)
    est = MissCurveEstimator(prior_r=0.7)
    assert est.r == 0.7  # no data: the prior
    est.observe_hit(0, False)  # F = 0 carries no information
    assert est.r == 0.7
    true_r = 1.2
    for f, rank in zip(rng.integers(2, 17, 6000), _power_law_ranks(true_r, 6000, rng)):
        est.observe_hit(int(f), bool(rank < f))
    assert est.r == pytest.approx(true_r, rel=0.08)
    few = MissCurveEstimator(prior_r=0.7, prior_weight=20)
    for _ in range(5):
        few.observe_rank(0)  # always hits: r would be huge
    assert 0.7 < few.r < few.r_max  # shrunk toward the prior
    never = MissCurveEstimator()
    for _ in range(500):
        never.observe_rank(None)  # never hits: r -> 0
    assert never.r == never.r_min
