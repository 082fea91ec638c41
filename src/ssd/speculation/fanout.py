"""Geometric fan-out: how many bonus-token candidates to pre-draft per outcome (docs/ARCHITECTURE.md 1.1).

While the target verifies a round of K draft tokens, the draft pre-drafts the next round for the
outcomes v = (k, t) it thinks likely: k accepted tokens, bonus token t. The fan-out F_k is the
number of bonus candidates t cached for "k accepted"; the budget B = sum_k F_k is the number of
chains per sequence per round.

Model (the paper's, and ours):

- per-token acceptance a in (0, 1), independent across positions, so the number of accepted
  tokens is truncated-geometric: P(k) = a^k (1 - a) for k < K and P(K) = a^K;
- a power-law miss curve: with F candidates the bonus token is among them with probability
  1 - miss(F), miss(F) = F^(-r), r > 0; with no candidate there is no hit.

The modelled hit rate sum_k P(k) (1 - F_k^-r) is concave in F_k, and maximizing it subject to
sum_k F_k = B (Lagrange: P(k) r F_k^(-r-1) = lambda) gives

    F_k proportional to P(k)^(1/(1+r)),  i.e.
    F_k = F_0 a^(k/(1+r))                          for k < K,
    F_K = F_0 a^(K/(1+r)) (1 - a)^(-1/(1+r)),      F_0 = B / sum of the factors above.

Note the pure power law gives one candidate (F = 1) no modelled hits: miss(1) = 1. Real draft
models do better than that at F = 1 (the draft's top token is often the bonus), which is why the
integer plan keeps at least one candidate per outcome by default (`min_each`); the miss-curve fit
below is the best pure power law through (1, 1), so it leans on F >= 2.

Everything here except the two estimators is a pure function.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Sequence

__all__ = [
    "AcceptanceEstimator",
    "MissCurveEstimator",
    "budget_from_timings",
    "continuous_fanout",
    "geometric_fanout",
    "modelled_hit_rate",
    "outcome_probs",
    "uniform_fanout",
]

logger = logging.getLogger(__name__)


# ---------------------------------------------------------------- the model


def _check_model(a: float, r: float, num_draft: int) -> None:
    if not 0.0 < a < 1.0:
        raise ValueError(f"acceptance rate a must be in (0, 1), got {a}")
    if not r > 0.0 or math.isinf(r):
        raise ValueError(f"miss-curve exponent r must be a positive finite number, got {r}")
    if num_draft < 0:
        raise ValueError(f"K (draft tokens per round) must be >= 0, got {num_draft}")


def outcome_probs(a: float, num_draft: int) -> list[float]:
    """P(k) for k = 0..K accepted tokens: a^k (1 - a) for k < K, a^K for k = K (sums to 1)."""
    if not 0.0 < a < 1.0:
        raise ValueError(f"acceptance rate a must be in (0, 1), got {a}")
    if num_draft < 0:
        raise ValueError(f"K must be >= 0, got {num_draft}")
    return [a**k * (1.0 - a) for k in range(num_draft)] + [a**num_draft]


def modelled_hit_rate(fan_out: Sequence[float], a: float, r: float, num_draft: int) -> float:
    """sum_k P(k) (1 - F_k^-r): the modelled probability that the real outcome is cached.

    F_k = 0 (nothing cached) hits with probability 0; a fractional F_k < 1 (continuous plans only)
    is treated the same, since 1 - F^-r < 0 there.
    """
    _check_model(a, r, num_draft)
    if len(fan_out) != num_draft + 1:
        raise ValueError(f"fan-out has {len(fan_out)} entries, expected K + 1 = {num_draft + 1}")
    probs = outcome_probs(a, num_draft)
    return sum(p * _hit(f, r) for p, f in zip(probs, fan_out))


def _hit(f: float, r: float) -> float:
    return 0.0 if f <= 1.0 else 1.0 - f ** (-r)


# ---------------------------------------------------------------- planners


def continuous_fanout(a: float, r: float, num_draft: int, budget: float) -> list[float]:
    """The real-valued hit-maximizing plan F_0..F_K (closed form in the module docstring)."""
    _check_model(a, r, num_draft)
    if budget < 0:
        raise ValueError(f"budget must be >= 0, got {budget}")
    e = 1.0 / (1.0 + r)
    factors = [a ** (k * e) for k in range(num_draft)] + [a ** (num_draft * e) * (1.0 - a) ** (-e)]
    f0 = budget / sum(factors)
    return [f0 * x for x in factors]


def uniform_fanout(budget: int, num_draft: int) -> list[int]:
    """budget spread evenly over the K + 1 outcomes; the remainder goes to the smallest k first."""
    if budget < 0 or num_draft < 0:
        raise ValueError(f"budget and K must be >= 0, got {budget} and {num_draft}")
    base, extra = divmod(budget, num_draft + 1)
    return [base + (1 if k < extra else 0) for k in range(num_draft + 1)]


def geometric_fanout(
    a: float, r: float, num_draft: int, budget: int, *, min_each: int = 1, polish: bool = True
) -> list[int]:
    """The integer plan F_0..F_K: non-negative, summing to budget exactly.

    1. Round the continuous plan by largest remainder (floor everything, then hand the missing
       units to the largest fractional parts; ties to the smaller k, the likelier outcome).
    2. If budget >= (K + 1) * min_each, raise every F_k to min_each, taking units from the largest
       entries; otherwise min_each is dropped (there is not enough budget for it).
    3. polish: move single units between outcomes while that strictly raises the modelled hit rate.
       Above the floor min_each >= 1 the objective is separable and concave, so the result is the
       exact integer optimum of the model under the floor (with min_each = 0 it is a local one).
    """
    _check_model(a, r, num_draft)
    if budget < 0 or min_each < 0:
        raise ValueError(f"budget and min_each must be >= 0, got {budget} and {min_each}")
    n = num_draft + 1
    cont = continuous_fanout(a, r, num_draft, budget)
    plan = [math.floor(x) for x in cont]
    missing = budget - sum(plan)  # in [0, K] up to rounding of the continuous sum
    by_fraction = sorted(range(n), key=lambda k: (plan[k] - cont[k], k))
    for i in range(missing):
        plan[by_fraction[i % n]] += 1

    floor = min_each if budget >= n * min_each else 0
    for k in range(n):
        while plan[k] < floor:
            donor = max((j for j in range(n) if plan[j] > floor), key=lambda j: (plan[j], j))
            plan[donor] -= 1
            plan[k] += 1

    if polish:
        plan = _polish(plan, outcome_probs(a, num_draft), r, floor)
    assert sum(plan) == budget and min(plan) >= 0, plan
    return plan


def _polish(plan: list[int], probs: list[float], r: float, floor: int) -> list[int]:
    """Pairwise unit exchanges while the best +1 gain beats the cheapest -1 loss elsewhere."""
    plan = list(plan)
    n = len(plan)
    for _ in range(sum(plan) * n + 1):  # each move strictly improves: this bound is never reached
        gains = [probs[k] * (_hit(plan[k] + 1, r) - _hit(plan[k], r)) for k in range(n)]
        up = max(range(n), key=lambda k: (gains[k], -k))
        donors = [j for j in range(n) if j != up and plan[j] > floor]
        if not donors:
            break
        losses = {j: probs[j] * (_hit(plan[j], r) - _hit(plan[j] - 1, r)) for j in donors}
        down = min(donors, key=lambda j: (losses[j], -j))
        if gains[up] <= losses[down] * (1.0 + 1e-12) + 1e-300:
            break
        plan[up] += 1
        plan[down] -= 1
    return plan


# ---------------------------------------------------------------- budget from timings


def budget_from_timings(
    verify_s: float,
    draft_step_s: float,
    num_draft: int,
    batch: int,
    *,
    row_cost: float = 1.0,
    overhead_s: float = 0.0,
    safety: float = 0.9,
    max_budget: int = 256,
) -> int:
    """Chains per sequence per round (B) that the draft can pre-draft within one verification.

    Cost model. All candidate chains of all `batch` sequences are decoded together, one batched
    draft forward per chain position, so one round of pre-drafting is K batched steps over
    R = batch * B rows. A step over R rows takes

        t(R) = draft_step_s * (1 + row_cost * (R - 1)),

    where draft_step_s is the measured time of a one-row decode step and row_cost in [0, 1] is the
    marginal cost of an extra row relative to it (about 1 on a CPU, where a step is compute-bound;
    near 0 on a GPU while the step is memory-bound). We need
    K * t(R) + overhead_s <= safety * verify_s, which gives the largest such R, divided among the
    sequences. The extra token a k = K chain feeds first (the last sent draft token) is ignored.

    Returns an int in [0, max_budget]; 0 means not even one chain per sequence fits (pre-drafting
    cannot hide behind verification at these timings). With row_cost = 0 any fitting budget is as
    cheap as one chain, so max_budget is returned whenever one step fits.
    """
    if verify_s < 0 or draft_step_s <= 0 or overhead_s < 0:
        raise ValueError(
            f"need verify_s >= 0, draft_step_s > 0, overhead_s >= 0; got {verify_s}, {draft_step_s}, {overhead_s}"
        )
    if num_draft < 1 or batch < 1 or max_budget < 0:
        raise ValueError(f"need K >= 1, batch >= 1, max_budget >= 0; got {num_draft}, {batch}, {max_budget}")
    if not 0.0 <= row_cost <= 1.0 or not 0.0 < safety <= 1.0:
        raise ValueError(f"need row_cost in [0, 1] and safety in (0, 1]; got {row_cost}, {safety}")
    step_allowed = (safety * verify_s - overhead_s) / num_draft
    if step_allowed < draft_step_s:
        return 0
    if row_cost == 0.0:
        return max_budget
    rows = 1.0 + (step_allowed / draft_step_s - 1.0) / row_cost
    return int(min(max_budget, math.floor(rows / batch + 1e-9)))


# ---------------------------------------------------------------- online estimators


class AcceptanceEstimator:
    """Per-token acceptance a, from the accepted lengths of verified rounds.

    A round that accepts n of its num_draft tokens tried n + 1 positions and failed the last one
    (n + 0 failures if all were accepted): a = accepted / tried is the maximum-likelihood estimate
    under the geometric model. Counts decay by `decay` per round (1.0: plain counts; 0.98: an
    effective memory of ~50 rounds) and start from a prior of `prior_weight` tried positions at
    `prior_rate`. The estimate is clamped into [eps, 1 - eps] so the planner always gets a valid a.
    """

    def __init__(
        self, prior_rate: float = 0.7, prior_weight: float = 4.0, decay: float = 0.98, eps: float = 1e-3
    ) -> None:
        if not 0.0 < prior_rate < 1.0 or prior_weight < 0 or not 0.0 < decay <= 1.0 or not 0.0 < eps < 0.5:
            raise ValueError("need prior_rate in (0, 1), prior_weight >= 0, decay in (0, 1], eps in (0, 0.5)")
        self.prior_rate, self.prior_weight, self.decay, self.eps = prior_rate, prior_weight, decay, eps
        self.accepted = 0.0
        self.tried = 0.0

    def observe(self, accepted_len: int, num_draft: int) -> None:
        if not 0 <= accepted_len <= num_draft:
            raise ValueError(f"accepted_len {accepted_len} outside [0, num_draft = {num_draft}]")
        self.accepted = self.decay * self.accepted + accepted_len
        self.tried = self.decay * self.tried + accepted_len + (1 if accepted_len < num_draft else 0)

    @property
    def rate(self) -> float:
        prior = self.prior_weight
        if self.tried + prior <= 0:
            return min(1.0 - self.eps, max(self.eps, self.prior_rate))
        raw = (self.accepted + prior * self.prior_rate) / (self.tried + prior)
        return min(1.0 - self.eps, max(self.eps, raw))


class MissCurveEstimator:
    """The miss-curve exponent r of miss(F) = F^-r, from observed hits and misses.

    Data: per fan-out F = 1..max_fan_out, a count of tries and of misses. Two ways in:

    - `observe_rank(rank)`: the zero-based rank of the real bonus token among the draft's
      candidates for its k (`cache.candidate_rank`; None if it was not among them: rank the
      draft's top max_fan_out + 1 tokens at least, so that None really means rank >= max_fan_out).
      One rank
      answers "would F candidates have hit?" for every F at once: hit iff rank < F.
    - `observe_hit(fan_out, hit)`: one lookup made with fan_out candidates.

    Fit: weighted least squares of log miss(F) on log F through the origin (the model has
    miss(1) = 1), over F >= 2, each point weighted by the inverse delta-method variance of its
    log-rate, n m / (1 - m); rates use a continuity correction (misses + 1/2) / (tries + 1). Only
    points with at least min_count hits and min_count misses enter the fit (a rate estimated from
    a handful of rare events biases the log), unless no point has that many. The fit is shrunk
    toward prior_r with the weight of prior_weight observations against the best-observed
    fan-out's tries, then clamped to [r_min, r_max]. Counts decay by `decay` per
    observation (1.0: plain counts).
    """

    def __init__(
        self,
        max_fan_out: int = 32,
        prior_r: float = 0.7,
        prior_weight: float = 20.0,
        decay: float = 1.0,
        r_min: float = 0.05,
        r_max: float = 5.0,
        min_count: int = 5,
    ) -> None:
        if max_fan_out < 2 or not 0 < r_min <= prior_r <= r_max or prior_weight < 0 or not 0.0 < decay <= 1.0:
            raise ValueError("need max_fan_out >= 2, 0 < r_min <= prior_r <= r_max, prior_weight >= 0, decay in (0, 1]")
        self.max_fan_out, self.prior_r, self.prior_weight = max_fan_out, prior_r, prior_weight
        self.decay, self.r_min, self.r_max, self.min_count = decay, r_min, r_max, min_count
        self.tries = [0.0] * (max_fan_out + 1)  # index F; F = 0 unused
        self.misses = [0.0] * (max_fan_out + 1)

    def _age(self) -> None:
        if self.decay < 1.0:
            self.tries = [x * self.decay for x in self.tries]
            self.misses = [x * self.decay for x in self.misses]

    def observe_rank(self, rank: int | None) -> None:
        if rank is not None and rank < 0:
            raise ValueError(f"rank must be >= 0 or None, got {rank}")
        self._age()
        for f in range(1, self.max_fan_out + 1):
            self.tries[f] += 1.0
            if rank is None or rank >= f:
                self.misses[f] += 1.0

    def observe_hit(self, fan_out: int, hit: bool) -> None:
        if fan_out < 1:
            return  # nothing cached: no information about the curve
        f = min(fan_out, self.max_fan_out)
        self._age()
        self.tries[f] += 1.0
        self.misses[f] += 0.0 if hit else 1.0

    def miss_rates(self) -> dict[int, float]:
        """Empirical miss(F) for every F with data (no correction)."""
        return {f: self.misses[f] / self.tries[f] for f in range(1, self.max_fan_out + 1) if self.tries[f] > 0}

    @property
    def r(self) -> float:
        points = [f for f in range(2, self.max_fan_out + 1) if self.tries[f] > 0]
        informative = [
            f for f in points
            if min(self.misses[f], self.tries[f] - self.misses[f]) >= self.min_count
        ]
        sxy = sxx = 0.0
        for f in informative or points:
            n = self.tries[f]
            m = (self.misses[f] + 0.5) / (n + 1.0)
            x, y = math.log(f), math.log(m)
            w = n * m / (1.0 - m)
            sxy -= w * x * y
            sxx += w * x * x
        n_eff = max((self.tries[f] for f in points), default=0.0)
        if sxx <= 0 or n_eff <= 0:
            return self.prior_r
        fitted = sxy / sxx
        shrunk = (n_eff * fitted + self.prior_weight * self.prior_r) / (n_eff + self.prior_weight)
        clamped = min(self.r_max, max(self.r_min, shrunk))
        if clamped != shrunk:
            logger.debug("miss-curve exponent %.3f clamped to %.3f", shrunk, clamped)
        return clamped
