"""mode="auto": choose every round, per sequence, how many draft tokens to verify (0 = a plain target
step), from an online cost model and each request's measured acceptance (docs/ARCHITECTURE.md 4.1).

The model: a target forward over R rows costs a + b R (TargetLine in in-process rounds: a level that
follows the machine and a relative row cost b / a learnt from consecutive rounds, with a table of
log costs per row count learnt from them too, where the cost per row grows with the rows); drafting costs c
per draft step plus d per row of it (a plan with K_b tokens for sequence b runs max K_b steps, step j
over the sequences with K_b > j). A sequence with per-token acceptance a_b and K_b draft tokens commits
E(a_b, K_b) = (1 - a_b^(K_b+1)) / (1 - a_b) tokens in expectation. The chooser maximizes
sum_b E(a_b, K_b) / time(plan): first the best common K, then coordinate ascent per sequence. It
keeps the previous plan unless the new one is predicted at least `hysteresis` faster, and now and
then probes one draft token for a sequence it runs without drafts, so its acceptance stays measured
(only where drafting could pay for it at all: see OPTIMISTIC_ACCEPTANCE); a sequence whose estimate
is still uncertain enough that drafting may pay is drafted for every round (see EXPLORE_Z).
Everything is measured from the rounds the engine runs anyway: no extra forwards.

Exactness does not depend on any of this: every plan is verified by the same exact rejection sampling.
"""
from __future__ import annotations

import bisect
import math

import torch

from ssd.speculation.worker_wait import WorkerWait


def expected_tokens(a: float, k: int) -> float:
    """Tokens one round commits in expectation: accepted drafts (geometric, truncated at k) + 1."""
    if a >= 1.0:
        return k + 1.0
    return (1.0 - a ** (k + 1)) / (1.0 - a)


class RLS:
    """Recursive least squares with forgetting: y ~ w . x, one observation at a time. The prior w0 has
    weight 1 (in the caller's units); forgetting lets the fit follow drifting timings, and the
    covariance is bounded so directions the data does not excite do not wind up."""

    def __init__(self, prior: list[float], forget: float = 0.97, max_trace: float = 100.0):
        self.w = torch.tensor(prior, dtype=torch.float64)
        self.P = torch.eye(len(prior), dtype=torch.float64)
        self.forget, self.max_trace = forget, max_trace
        self._w = list(prior)          # plain floats: predict() runs hundreds of times per round

    def update(self, x: list[float], y: float) -> None:
        x = torch.tensor(x, dtype=torch.float64)
        Px = self.P @ x
        gain = Px / (self.forget + x @ Px)
        self.w = self.w + gain * (y - x @ self.w)
        self.P = (self.P - torch.outer(gain, Px)) / self.forget
        tr = float(self.P.trace())
        if tr > self.max_trace:
            self.P *= self.max_trace / tr
        self._w = self.w.tolist()

    def set(self, w: list[float]) -> None:
        self.w = torch.tensor(w, dtype=torch.float64)
        self._w = list(w)

    def predict(self, x: list[float]) -> float:
        return sum(a * b for a, b in zip(self._w, x))


def pair_split(n0: int, n1: int) -> tuple[float, float]:
    """How a pair's error is shared between its two row counts, known from n0 and n1 pairs before:
    in inverse proportion to 1 + n."""
    w0, w1 = 1.0 / (1 + n0), 1.0 / (1 + n1)
    return w0 / (w0 + w1), w1 / (w0 + w1)


class TargetLine:
    """The target forward's time over R rows, a f(R), fitted as two things that change at different
    rates. The level a follows the machine's speed (an exponential average of y / f(R), weight
    `level_alpha`); the shape f is a property of the kernels and is learnt only from consecutive rounds
    with different row counts (same machine phase): a line 1 + rho R, rho the relative cost of a row as
    a ratio of exponential sums, rho = sum(y - y0) / sum(y0 R - y R0), signed by R - R0; and a table g of
    log f at the row counts seen in pairs, which lets f bend where the line cannot.

    A plain least-squares line (RLS with forgetting) confounds level and rows on a shared VM: a 2-core
    host's speed moves +-50% in phases of many rounds, and the chooser's draft lengths change with those
    phases, so rows run in a slow phase looked dear. Measured there (auto at batch 1, MT-Bench): the
    line's slope was 38% of a 1-row forward per row, where forcing K = 0..4 in turn (every K sees every
    phase) measured 18-22% (1 to 5 rows, three runs); the steep line made auto choose K = 1 and plain
    rounds where K = 2 is best.

    The table: on one thread the target's cost per row grows with the rows (paper placement: about 13 ms
    per row from 1 to 4 rows, 19 from 4 to 8), so the line, fitted over a run's pairs (batch tails of 1-3
    rows, rounds of 4 and 8 at batch 4), priced a plain round at batch 4 10-20% too dear during streaks
    of K=1 rounds, and auto drafted where K=1 was about 13% slower than plain. A pair moves g at its two
    row counts towards the measured log ratio log(y / y0): by the whole error at a row count's first pair,
    then as a mean, down to `shape_rate` of it; the row count known from fewer pairs takes the larger
    part (`pair_split`). A pair that misses by more than `shape_clip` (in log) is left out, as one across
    a change of the machine's speed. Between row counts in the table log f is linear; beyond them it
    follows the line's slope. Every round the table fades towards the line by `shape_decay`, so a row
    count that noise made dear, which the chooser then avoids (no pairs to correct it), does not stay
    so: a table of measured absolute costs per row count lost 5-10% at batch 1 that way (it was phases,
    not rows; scripts/auto_trace_sim.py). When the shape moves, the level keeps its prediction at the
    row count it last followed."""

    def __init__(self, prior: tuple[float, float] = (1.0, 0.1), level_alpha: float = 0.15,
                 pair_decay: float = 0.98, prior_rows: float = 4.0, shape_rate: float = 0.2,
                 shape_clip: float = 0.25, shape_decay: float = 0.998):
        self.a, self.rho = prior[0], prior[1] / prior[0]
        self.level_alpha, self.pair_decay = level_alpha, pair_decay
        self.shape_rate, self.shape_clip, self.shape_decay = shape_rate, shape_clip, shape_decay
        self.prior_rows = prior_rows
        self.num, self.den = self.rho * prior_rows, prior_rows      # the prior: worth `prior_rows` rows
        self.prev: tuple[int, float] | None = None
        self.levels = 0                  # observations of the level so far (a mean until 1 / level_alpha)
        self.g: dict[int, float] = {}    # log f at the row counts seen in pairs
        self.pairs: dict[int, int] = {}  # pairs learnt from at each of those row counts
        self._keys: list[int] = []       # sorted keys of g

    @property
    def w(self) -> torch.Tensor:
        """The line (a, a rho), without the table."""
        return torch.tensor([self.a, self.a * self.rho], dtype=torch.float64)

    def set(self, w: list[float], at: float = 1.0) -> None:
        """A given line w0 + w1 R (as the prior of its row cost), and an empty table. Its relative row cost
        is bounded as `update` bounds it, and the level then keeps the line's value at `at` rows: a
        least-squares line fitted on noisy rounds can have a negative slope (1 + rho R then has no log:
        a batch of 32 rows raised a math domain error) or a negative or near-zero intercept (taken as the
        level, it predicted forwards of nearly no time: auto_ssd predicted the local regime at 35 and
        17882 tok/s at batch 1 where it measured 19, and visited it on that). A line that is not positive
        at `at` rows is ignored."""
        value = w[0] + w[1] * at
        if value <= 0:
            return
        self.rho = min(max(w[1] / w[0], 0.0), 2.0) if w[0] > 0 else 2.0
        self.a = value / (1.0 + self.rho * at)
        self.num, self.den = self.rho * self.prior_rows, self.prior_rows
        self.g, self.pairs, self._keys = {}, {}, []

    def scaled(self, factor: float) -> "TargetLine":
        """A copy whose forwards all take `factor` times as long (the same shape)."""
        m = TargetLine((self.a * factor, self.a * factor * self.rho), prior_rows=self.prior_rows)
        m.g, m.pairs, m._keys = dict(self.g), dict(self.pairs), list(self._keys)
        return m

    def _line(self, rows: float) -> float:
        return math.log(1.0 + self.rho * rows)

    def log_shape(self, rows: float) -> float:
        """log f(rows): the table where rows were seen in pairs, linear between them, the line's slope
        (in log) beyond them."""
        keys, g = self._keys, self.g
        if not keys:
            return self._line(rows)
        if rows <= keys[0]:
            return g[keys[0]] + self._line(rows) - self._line(keys[0])
        if rows >= keys[-1]:
            return g[keys[-1]] + self._line(rows) - self._line(keys[-1])
        hi = bisect.bisect_left(keys, rows)
        k0, k1 = keys[hi - 1], keys[hi]
        t = (rows - k0) / (k1 - k0)
        return g[k0] + t * (g[k1] - g[k0])

    def shape(self, rows: float) -> float:
        return math.exp(self.log_shape(rows))

    def predict(self, x: list[float]) -> float:
        return self.a * x[0] * self.shape(x[1])

    def _learn_pair(self, r0: int, y0: float, r1: int, y1: float) -> None:
        for r in (r0, r1):
            if r not in self.g:
                self.g[r] = self.log_shape(r)
                self.pairs[r] = 0
                self._keys = sorted(self.g)
        if y0 <= 0 or y1 <= 0:
            return
        err = math.log(y1 / y0) - (self.g[r1] - self.g[r0])
        if abs(err) > self.shape_clip:
            return           # more than noise: a pair across a change of the machine's speed, most likely
        # a mean over a row count's first pairs, then an exponential average; the row count known from
        # fewer pairs takes the larger part (a batch's tail of 1-3 rows otherwise moved the 4-row value
        # that its K=1 rounds at 8 rows had been measured against)
        n0, n1 = self.pairs[r0], self.pairs[r1]
        rate = max(self.shape_rate, 1.0 / (1 + min(n0, n1)))
        s0, s1 = pair_split(n0, n1)
        self.g[r1] += rate * err * s1
        self.g[r0] -= rate * err * s0
        self.pairs[r0] += 1
        self.pairs[r1] += 1

    def update(self, x: list[float], y: float) -> None:
        rows = x[1]
        if self.prev is not None and self.prev[0] != rows:
            r0, y0 = self.prev
            before = self.shape(r0)
            sign = 1.0 if rows > r0 else -1.0
            self.num = self.pair_decay * self.num + sign * (y - y0)
            self.den = self.pair_decay * self.den + sign * (y0 * rows - y * r0)
            if self.den > 1e-9:
                self.rho = min(max(self.num / self.den, 0.0), 2.0)
            if self.shape_rate:
                self._learn_pair(int(r0), y0, int(rows), y)
            # the level keeps its prediction at the row count it last followed; the shape moved around it
            # (otherwise a shape learnt in one pair shifts every prediction until the level catches up)
            self.a *= before / self.shape(r0)
        for r in self._keys:            # the table fades towards the line
            line = self._line(r)
            self.g[r] = line + self.shape_decay * (self.g[r] - line)
        self.prev = (rows, y)
        self.levels += 1
        alpha = max(self.level_alpha, 1.0 / self.levels)
        self.a += alpha * (y / self.shape(rows) - self.a)


CATCH_UP_PRIOR = 0.02      # a draft's catch-up per missed token, in units of a target forward (see CostModel)
# The unit of a cost model: the median of its first UNIT_ROUNDS target forwards (per row count, by the
# prior line); of those, one more than COLD_FACTOR times the unit is left out of the fit. An engine's
# first forward can be cold: auto_ssd's first worker round verified 2 rows in about 1.26 s in the
# equal placement, where the following ones took about 0.1 s; as the unit, it put the prior line 10x too high, and
# the least-squares fit of worker rounds compromised with a negative row cost and asked for K = 6.
UNIT_ROUNDS = 3
COLD_FACTOR = 3.0


class CostModel:
    """Target forward time a + b R; draft time c per step + d per row + e per catch-up token (a draft
    that sat out plain rounds first feeds the tokens it missed). Fitted in units of a typical early
    target forward (see UNIT_ROUNDS; so the priors below are relative): extra rows cost 20% of a step
    in local rounds (measured: 18-22% per row from 1 to 5 rows on 2 threads, about 23% from 1 to 4 on
    one; with 10%, worth 4 rows of pairs, a fresh engine at batch 4 on one thread drafted K=1 for its
    first two batches, where plain was faster) and 10% in SSD rounds, a draft step 30%, a draft row 3%, a catch-up token 2% (catching up is one batched draft forward over
    the missed tokens, like a prefill; a 10% prior kept auto from ever drafting for short answers, so
    the term was never measured). The draft's terms are fitted relative to the target line's current
    level (see `level`), so they follow the machine's speed with it. With `worker` (SSD rounds of
    auto_ssd) drafting is instead the expected wait for the draft worker (worker_wait.py)."""


    def __init__(self, worker: WorkerWait | None = None):
        self.unit: float | None = None
        self._first: list[tuple[int, float]] = []      # target forwards seen before the unit is set
        # the level/row split for the in-process rounds, where it was measured to help (equal placement,
        # batch 1); SSD rounds keep the least-squares line: with TargetLine there, auto_ssd ran 0.88x
        # SSD k=2 on HumanEval in the paper placement against 0.97x with the line, in a same-process
        # A/B (12 prompts; 0.99x overall, within noise), and the two bench runs agreed on HumanEval
        self.target = RLS([1.0, 0.1]) if worker is not None else TargetLine((1.0, 0.2))
        self.forget_draft()
        # the least a catch-up token costs (units; 0: the fit alone), whatever the fit says: auto_ssd with the
        # worker apart sets the worker's measured prefill per token (see SpeculativeStep.decode)
        self.catch_up_floor = 0.0
        # SSD rounds: the worker drafts during the verify; the target waits for it only on a cache miss
        self.worker = worker

    def target_s(self, rows: int) -> float:
        return max(self.target.predict([1.0, rows]), 1e-3)

    def level(self) -> float:
        """The machine's current speed as the target line's level measures it (in-process rounds; 1 in
        SSD rounds). The in-process draft's costs are fitted relative to it: both models run on the same
        cores, and the level is measured every round where the draft is measured only in rounds that
        draft. Fitted in absolute units, a draft measured in a slow phase kept that price in the next
        fast one (the target level fell to 0.6 of it), so drafting looked 1.5x dearer than it was,
        auto ran plain rounds, and with nothing drafted the price never moved: a fresh engine ran 98% of
        an MT-Bench set plain (equal placement, batch 1, AVX-512 host), where SD k=2 is 1.17x AR."""
        return max(self.target.a, 1e-3) if isinstance(self.target, TargetLine) else 1.0

    def forget_draft(self) -> None:
        """Back to the priors of the in-process draft's costs (see Chooser._stale_probe)."""
        self.draft = RLS([0.3, 0.03, CATCH_UP_PRIOR])

    def set_draft(self, step: float, row: float, catch_up: float) -> None:
        """The draft's costs per step, per row and per catch-up token, in units at the current level."""
        lv = self.level()
        self.draft.set([step / lv, row / lv, catch_up / lv])

    def draft_coefficients(self) -> list[float]:
        """(step, row, catch-up token) costs of the in-process draft at the current level."""
        lv = self.level()
        return [w * lv for w in self.draft.w.tolist()]

    def _draft_split(self) -> list[float]:
        """The draft's fitted (step, row, catch-up token) costs, its rows priced at least like the target's.
        Rounds of one drafting row (batch 1) measure only step + row (steps = rows there), and the split
        between the two drifts with noise: in runs at batch 4 after batch 1 (equal placement, default
        pair, HumanEval; single-row probes and a few drafted rows) the fitted row went from 0.14 to 0.03
        of a target forward within two batches, where forced rounds of four drafting rows fitted a row at
        0.23-0.59 of a step at the ends of seven of eight such batches (0.10 at one; the target's extra row:
        0.28-0.39 of its fixed cost there, `TargetLine.rho`): of the order of rho, so rho is the floor. A
        row below rho times the step is taken as that share of their fitted sum: one row costs what was
        fitted (batch 1 is unchanged), R rows grow with R as the target's forwards do (the same kernels
        on the same cores; extra rows are compute-bound). In one such run this priced all-row K = 1 rounds
        at batch 4 at 0.93 of plain on average (at most 1.06) where the raw split said 0.95 (at most
        1.10); forced, those rounds measured 0.83-0.91 of plain."""
        step, row, catch = self.draft._w
        rho = self.target.rho if isinstance(self.target, TargetLine) else 0.0
        if step > 0 and row < rho * step:
            one = step + row
            step, row = one / (1.0 + rho), one * rho / (1.0 + rho)
        return [step, row, catch]

    def draft_s(self, num_draft: list[int], catch_up: float = 0.0, acceptance: list[float] | None = None) -> float:
        steps = max(num_draft, default=0)
        if self.worker is not None:
            return self.worker.expected(acceptance or [0.0] * len(num_draft), num_draft)
        if not steps:
            return 0.0
        step, row, catch = self._draft_split()
        t = max(step * steps + row * sum(num_draft) + catch * catch_up, 0.0) * self.level()
        return t + self.catch_up_floor_extra() * catch_up

    def catch_up_floor_extra(self) -> float:
        """What `catch_up_floor` adds to each catch-up token over the fitted price (0 without a floor)."""
        if self.catch_up_floor <= 0:
            return 0.0
        return max(self.catch_up_floor - self.draft._w[2] * self.level(), 0.0)

    def time_s(self, num_draft: list[int], catch_up: float = 0.0, acceptance: list[float] | None = None) -> float:
        """Predicted time (in units of the cost model, see UNIT_ROUNDS) of a round with this plan, whose
        drafts first feed `catch_up` tokens they missed (`acceptance`: per sequence, for a worker's
        cache hits)."""
        return self.draft_s(num_draft, catch_up, acceptance) + self.target_s(sum(k + 1 for k in num_draft))

    def observe_target(self, rows: int, seconds: float) -> None:
        if self.unit is None:
            self._first.append((rows, max(seconds, 1e-6)))
            if len(self._first) < UNIT_ROUNDS:
                return
            ratios = [s / self.target_s(r) for r, s in self._first]
            self.unit = sorted(ratios)[len(ratios) // 2]
            first, self._first = self._first, []
            for (r, s), q in zip(first, ratios):
                if q <= COLD_FACTOR * self.unit:
                    self.target.update([1.0, r], s / self.unit)
            return
        self.target.update([1.0, rows], seconds / self.unit)

    def observe_draft(self, num_draft: list[int], seconds: float, catch_up: int = 0) -> None:
        if max(num_draft, default=0) and self.unit is not None and self.worker is None:
            self.draft.update([max(num_draft), sum(num_draft), catch_up], seconds / self.unit / self.level())

    def observe_wait(self, all_hit: bool, k: int, seconds: float) -> None:
        """A worker round's wait for its proposal (see WorkerWait.observe_round)."""
        if self.worker is not None and self.unit is not None:
            self.worker.observe_round(all_hit, k, seconds / self.unit)

    def observe_retake(self, tokens: int, k: int, seconds: float) -> None:
        """A worker round that first prefilled `tokens` tokens of context (see WorkerWait.observe_retake)."""
        if self.worker is not None and self.unit is not None:
            self.worker.observe_retake(tokens, k, seconds / self.unit)


def local_cost(worker_rounds: CostModel, draft_step: float, catch_up: float = 0.0, at: float = 1.0) -> CostModel:
    """The in-process draft's rounds as the worker rounds' fits see them (same units): the same target
    line (exact at `at` rows, bounded in shape: TargetLine.set), and drafting that takes `draft_step` per
    step and `catch_up` per token it missed, in series with the target (auto_ssd with the worker on cores
    of its own: the target has the same threads in both regimes)."""
    m = CostModel()
    m.unit = worker_rounds.unit
    m.target.set(worker_rounds.target.w.tolist(), at)
    m.set_draft(draft_step, 0.0, catch_up)
    return m


def all_hit_cost(local: CostModel, slowdown: float) -> CostModel:
    """An optimistic model of SSD rounds where they take cores from the target (the equal placement),
    before the worker has run any: the local rounds' target line (same units) made `slowdown` times
    slower (the target on fewer threads, see thread_scaling.py), and no drafting time at all (every
    round a cache hit, no wait, no prefill of the contexts handed to the worker). No worker round can
    be faster than that, so a worker regime whose best plan under it is clearly slower than the local
    regime's measured rate need not be visited."""
    m = CostModel()
    m.unit = local.unit
    m.target = local.target.scaled(slowdown)
    m.draft.set([0.0, 0.0, 0.0])
    return m


def catch_up_share(num_draft: list[int], acceptance: list[float], behind: list[int] | None,
                   remaining: list[int] | None) -> float:
    """Catch-up tokens charged to one round (`behind` given: the in-process draft, which can fall behind).
    Two parts, for each sequence that drafts:

    - what it already missed: `behind` tokens it pays once when it drafts again, which serves the rest of
      its request, so each round carries the share behind / (rounds left at that draft length) =
      behind * E(a, K) / remaining (a plain round leaves the same tokens to pay: this share is neutral
      between them);
    - the lag this plan leaves: a round that accepts all K drafts never fed the last one to the draft, so
      the next drafting round feeds it first, a^K tokens expected. Drafting goes on after a drafting round,
      so that token is paid, round after round: it is charged in full (spread over the request, it was
      charged about 5% of its cost at batch 1 on code, where a K=1 draft was behind by it in 169 of 190
      rounds, 2.2 ms of a 17 ms draft, and the short plans, which leave it most often, looked cheapest)."""
    if behind is None:
        return 0.0
    rem = remaining or [1] * len(behind)
    return sum(t * min(1.0, expected_tokens(a, k) / max(r, 1)) + a ** k
               for t, k, a, r in zip(behind, num_draft, acceptance, rem) if k > 0)


def rate(num_draft: list[int], acceptance: list[float], cost: CostModel, behind: list[int] | None = None,
         remaining: list[int] | None = None) -> float:
    """Predicted committed tokens per unit of time of a plan."""
    catch = catch_up_share(num_draft, acceptance, behind, remaining)
    return sum(expected_tokens(a, k) for a, k in zip(acceptance, num_draft)) / cost.time_s(num_draft, catch, acceptance)


def concave_increments(xs: list[float]) -> list[float]:
    """The increments of the least concave majorant of the prefix sums of `xs` (pool adjacent
    violators): non-increasing, and every prefix sums to at least that of `xs`."""
    blocks: list[list[float]] = []          # [sum, count]
    for x in xs:
        blocks.append([x, 1])
        while len(blocks) > 1 and blocks[-2][0] * blocks[-1][1] < blocks[-1][0] * blocks[-2][1]:
            total, n = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += n
    return [total / n for total, n in blocks for _ in range(n)]


def plain_is_best(acceptance: list[float], caps: list[int], cost: CostModel, behind: list[int] | None = None,
                  remaining: list[int] | None = None) -> bool:
    """Whether no plan that drafts can be predicted faster than a plain round: a sufficient test (False
    where it cannot tell), cheaper than best_plan's search, which it lets skip (at batch 4 on a 2-core
    host, in stretches of plain rounds, that search was most of auto's own time per round: about 0.9 ms,
    for two best_plan calls of 31 plans each).

    A plan beats the plain round's rate r only if its tokens exceed r times its time. Charge each draft
    token its row's costs at that rate: the j-th token of row b adds a_b^j tokens (E(a, k) - 1 is the sum
    of the first k) and costs r times a draft row, the first one also r times the least catch-up its row
    can carry (catch_up_share at K = 1 behind and at the cap lagging). For plans of s steps, a row's
    first k charged increments (k <= s) sum to at most those of the least concave majorant of its first
    s (`concave_increments`), which fall with k, so over all rows the N largest of those bound what any
    plan of N tokens gains; such a plan also runs s draft steps and a target forward over rows + N rows.
    If for every s and N the rows plus that bound stay below r times those, no plan reaches r. Plans of
    STEP_TIERS steps or more are bounded together (majorants over the whole caps, STEP_TIERS steps): a
    few sorts instead of one per K, for some tightness (in random cases the test decided 37% of them
    where one tier per K decided 41%). In-process drafting with non-negative fitted costs only (with a
    worker, or a negative coefficient, False)."""
    if cost.worker is not None or not any(caps):
        return False
    step, row, catch = cost._draft_split()
    if step < 0 or row < 0 or catch < 0:
        return False
    rows, lv = len(caps), cost.level()
    r = rate([0] * rows, acceptance, cost, behind, remaining) * (1.0 - 1e-9)
    per_row, per_catch = r * lv * row, r * (lv * catch + cost.catch_up_floor_extra())
    rem = remaining or [1] * rows
    charged = []
    for b, (a, c) in enumerate(zip(acceptance, caps)):
        if c > 0:
            least_catch = behind[b] * min(1.0, expected_tokens(a, 1) / max(rem[b], 1)) + a ** c if behind else 0.0
            charged.append([a - per_row - per_catch * least_catch] + [a ** j - per_row for j in range(2, c + 1)])
    forward: list[float] = []               # r times the target's forward over rows + 1, 2, ... rows
    kmax = max(caps)
    for steps in range(1, min(kmax, STEP_TIERS) + 1):
        # plans of exactly `steps` steps; the last tier: of at least that many (each row's majorant over
        # its whole cap bounds its every prefix)
        last = steps == min(kmax, STEP_TIERS)
        increments = sorted((x for xs in charged for x in concave_increments(xs if last else xs[:steps])),
                            reverse=True)
        gained, fixed = float(rows), r * lv * step * steps
        for n, x in enumerate(increments, 1):
            gained += x
            while len(forward) < n:
                forward.append(r * cost.target_s(rows + len(forward) + 1))
            if gained >= fixed + forward[n - 1]:
                return False
    return True


# plain_is_best bounds plans of 1, 2, ... steps one by one up to this many, and all longer ones at once
STEP_TIERS = 3


def prefill_pays(acceptance: list[float], plan: list[int], cost: CostModel, feed: int, remaining: int) -> bool:
    """Whether prefilling the in-process draft with a new request's `feed` prompt tokens costs less than
    drafting by `plan` saves over its `remaining` tokens: the plan's time per committed token of the
    batch against a plain round's, times those tokens, against the model's price of a token the draft
    takes in (a catch-up token: the same batched draft forward as a prefill, at least the worker's
    measured prefill per token where auto_ssd set that floor). A draft left lazy is not lost: the
    chooser can still catch it up and draft where that pays later. Paper placement, batch 4 on an AVX2
    host (twenty-ninth session): auto ran 99% plain rounds on MT-Bench after prefilling drafts for 8.6 s
    of 119 (TTFT 15.9 s against AR's 13.5); a plan of K = 1 at batch 4 saves a few % of 64 tokens' time,
    a prompt of a few hundred tokens costs the draft about a second on one core. Applied only there
    (SpeculativeStep.prefill): in the equal placement at batch 1 it left drafts lazy that SD's prefill
    repaid (auto 0.85-0.89x SD k=2), so its price or gain is off there."""
    if remaining <= 0 or not any(plan):
        return False
    gain = 1.0 / rate([0] * len(plan), acceptance, cost) - 1.0 / rate(plan, acceptance, cost)
    price = cost.draft_s([1], catch_up=1.0) - cost.draft_s([1])
    return gain * remaining >= max(price, 0.0) * feed


def best_plan(acceptance: list[float], caps: list[int], cost: CostModel, behind: list[int] | None = None,
              remaining: list[int] | None = None, passes: int = 2, floor: int = 0) -> list[int]:
    """Per-sequence draft lengths (each <= its cap, and >= min(floor, cap)) maximizing the predicted rate
    (all 0 at once where `plain_is_best` shows that no drafting plan can beat a plain round)."""
    if floor == 0 and plain_is_best(acceptance, caps, cost, behind, remaining):
        return [0] * len(caps)
    r = lambda p: rate(p, acceptance, cost, behind, remaining)   # noqa: E731
    kmax = max(caps, default=0)
    plans = [[min(k, c) for c in caps] for k in range(min(floor, kmax), kmax + 1)]
    plan = max(plans, key=r)
    best = r(plan)
    for _ in range(passes):
        improved = False
        for b, cap in enumerate(caps):
            for k in range(min(floor, cap), cap + 1):
                if k == plan[b]:
                    continue
                trial = plan[:b] + [k] + plan[b + 1:]
                rt = r(trial)
                if rt > best * (1 + 1e-9):
                    plan, best, improved = trial, rt, True
        if not improved:
            break
    return plan


PRIOR_ROUNDS = 8.0


def prior_strength(global_evidence: float, between: float | None = None) -> float:
    """How many rounds of a new request's own evidence the engine-wide acceptance is worth as its prior.

    A request's acceptance differs from the engine-wide rate (code 0.8-0.95, chat 0.4-0.65 with the
    default pair): that spread alone is worth `between` rounds (PRIOR_ROUNDS; a weaker prior let the
    first rejection, often in the very first round, drop a request that accepts 80% below the point
    where drafting pays). The engine-wide rate is itself uncertain, `global_evidence` rounds' worth
    (a fresh engine: its 0.6 guess, worth 4): the two variances add, so the prior is worth
    1 / (1 / (between + 1) + 1 / (global_evidence + 1)) - 1 rounds, `between` once the engine has
    measured much and about 2-4 on a fresh engine. With a full-strength 0.6 prior a fresh engine's first
    code request drafted one token per round for 10-20 rounds while its estimate climbed to where two
    paid (its decode ran at 0.81-0.90 of SD k=2)."""
    between = PRIOR_ROUNDS if between is None else between
    return max(1.0 / (1.0 / (between + 1.0) + 1.0 / (max(global_evidence, 0.0) + 1.0)) - 1.0, 0.0)

# A probe of a draft far behind (see Chooser._catch_up_affordable) may cost at most this share of the
# plain rounds left in its request.
FAR_PROBE_SHARE = 0.1

# A probe re-measures the acceptance of a request the chooser stopped drafting for; it is worth its
# round only if some acceptance would make drafting for that request pay. This is about the best a
# draft does (the default pair on code: 0.81-0.88 per token at K <= 4): when even it would not draft
# (large batches whose verify rows cost more than they commit), no probe is run. On a 2-core AVX2 host
# the probes of such batches cost auto 4-8% against AR (a draft catch-up of up to 16 tokens, a draft
# step and an extra verify row every 16 rounds).
OPTIMISTIC_ACCEPTANCE = 0.95

# A chooser that has not drafted for this many rounds prefills the next request's draft anyway
# (eager_prefills: one of a batch) and drafts one token for a sequence whose draft is near, whatever its
# cost model predicts, with the draft's fitted costs back at their priors (Chooser._stale_probe): a lazy draft is
# behind by its whole prompt, too far for a probe or an exploration to be affordable, and an ordinary
# probe runs only where the model says drafting could pay, so with a model that says it never does
# (fitted on the 8-token warm-up) nothing is measured again. Seen twice in a row in equal-placement
# grids: auto ran every batch-1 HumanEval round plain from the first request on (0.89-0.91x SD), where
# the previous run of the same settings drafted in 72-95% of its batch-1 rounds. The cost: at most one
# request's draft prefill and one draft token per so many rounds, and a few rounds at the draft's priors.
STALE_ROUNDS = 64

# A request the plan leaves without drafts is drafted for (one token) while drafting would pay at its
# acceptance EXPLORE_Z standard deviations up (AcceptanceEstimate.upper): a plain round measures nothing,
# so a request whose estimate fell after two early rejections stayed plain for the rest of its answer,
# re-measured only by a probe every 16 rounds (auto ran 36% of its MT-Bench rows plain in the equal
# placement at batch 1, where SD k=2 was 1.17x AR). The loss of such a round is bounded by how close
# drafting is to paying; with evidence the bound tightens and a request that does not pay stays plain.
EXPLORE_Z = 1.0

# Exploration asks, for each request the plan leaves plain, whether drafting would pay were that request
# at its optimistic acceptance and its batch mates at their estimates. Until the twenty-fifth session it
# put every plain row at its optimistic acceptance at once: a batch of fresh requests (each at an
# engine-wide rate of about 0.93 on a prior of at most eight rounds, so 0.999 one deviation up) paid
# together where none paid alone, and in the equal placement at batch 4 (AR 1.35x SD k=2) every new
# batch was explored, all rows in one round, lazy drafts caught up on their whole prompts for it (one
# such round took 1087 ms against 56 for a plain one). At batch 1 there is one row: the two tests agree, and a fresh engine still drafts.
EXPLORE_ALONE = True


class AcceptanceEstimate:
    """Per-token acceptance of one request: accepted / (accepted + rejections), with a prior of
    `strength` rounds at the engine-wide rate, and decay so it follows a request that changes."""

    def __init__(self, prior: float, strength: float = 2.0):
        self.acc = prior * strength
        self.rej = (1 - prior) * strength

    def observe(self, proposed: int, accepted: int, decay: float = 0.95) -> None:
        if proposed <= 0:
            return
        self.acc = decay * self.acc + accepted
        self.rej = decay * self.rej + (accepted < proposed)

    @property
    def value(self) -> float:
        return min(max(self.acc / max(self.acc + self.rej, 1e-9), 0.0), 0.999)

    def upper(self, z: float) -> float:
        """The estimate plus z standard deviations of a Beta posterior with these (decayed) counts: what
        the request may still accept, given how little was measured."""
        p, n = self.value, self.acc + self.rej
        return min(p + z * math.sqrt(p * (1.0 - p) / (n + 1.0)), 0.999)


def plain_probe_offset(every: int, probe_every: int) -> int:
    """The round (mod `every`) of the plain probe: a quarter into the cycle, moved by one where that
    would always fall on a one-token probe round (a common divisor of the two periods divides it), which
    takes precedence: with every = 64 and probe_every = 16, round 16 of 64 would never run a plain probe."""
    if not every:
        return 0
    off, g = every // 4, math.gcd(every, probe_every)
    return off + 1 if g > 1 and off % g == 0 else off


# The margin a new plan needs over the one in place (in-process rounds). Changing K there costs nothing (no
# state depends on it), so the margin only damps flapping between plans the model cannot tell apart. At
# 3% it kept whichever K came first: at batch 1 on code, K=1 and K=2 are predicted within 1-4% of each
# other, and auto kept K=1 in 76-80% of its rounds in some runs and K=2 in 64% in others; SD k=2 was
# 3-5% faster than auto on the same four prompts (decode time), auto's K=1 rounds 2% slower per token.
LOCAL_HYSTERESIS = 0.01


# A longer ask in worker rounds is taken where it pays over this many rounds (or the requests' ends, if
# sooner) with its one-off cost charged (the worker first finishes the shorter chains it pre-drafted:
# WorkerWait.grow_wait). A flat 10% margin instead kept K=1 where K=2 was predicted 5% faster (per-token
# acceptance 0.7): auto ran 18-49% of its batch-1 worker rounds at K=1 in the paper placement (fixed SSD
# k=2 measured 0-8% faster than k=1 there). Alone, this change measured within noise of the margin.
GROW_ROUNDS = 16


class Chooser:
    """shares_acceptance: another chooser whose per-request acceptance estimates this one reads and
    updates (auto_ssd: the chooser of worker rounds fits its own verify costs, with the target on
    fewer cores, but not a second copy of every request's acceptance)."""

    def __init__(self, k: int, hysteresis: float = LOCAL_HYSTERESIS, probe_every: int = 16, probe_behind: int | None = None,
                 cost: CostModel | None = None, shares_acceptance: "Chooser | None" = None,
                 plain_probe_every: int = 32, floor: int = 0, hysteresis_down: float | None = None,
                 explore_z: float = EXPLORE_Z):
        self.k, self.hysteresis, self.probe_every = k, hysteresis, probe_every
        self.explore_z = explore_z      # 0: no exploration (see EXPLORE_Z)
        # the margin a plan that only shortens drafts needs (worker rounds: a shorter ask is served from
        # the chains pre-drafted at the longer length, a longer one misses them)
        self.hysteresis_down = hysteresis if hysteresis_down is None else hysteresis_down
        self.floor = floor              # draft at least this many tokens where the cap allows (worker rounds: 1)
        # probe only drafts at most this far behind (None: any, where `could_pay` holds with the
        # catch-up charged; a limit of 16 made a lazy draft, behind by its whole prompt, unreachable:
        # the request decoded plain to its end, and with nothing drafted the engine-wide acceptance
        # that decides the next prefills never moved again)
        self.probe_behind = probe_behind
        self._probed: dict[int, int] = {}     # seq_id -> round of its last one-token probe
        # every this many rounds a plan that drafts runs one plain round instead: it keeps the target's
        # cost at the plain row count measured (a chooser that always drafts fits its cost line at
        # K+1 rows per request only and may overestimate a plain step). 0: never
        self.plain_probe_every = plain_probe_every
        self.plain_probe_at = plain_probe_offset(plain_probe_every, probe_every)
        self.cost = cost or CostModel()
        other = shares_acceptance
        self.global_acc = other.global_acc if other else AcceptanceEstimate(0.6, strength=4.0)
        self.per_seq: dict[int, AcceptanceEstimate] = other.per_seq if other else {}
        self.last: dict[int, int] = {}
        self.rounds = 0
        self.drafted_at = 0             # the last round it planned a draft for (see STALE_ROUNDS)
        self.stale_prefill_at = 0       # the last round eager_prefills prefilled one draft for staleness alone
        self.predicted_tokens = 0.0     # of the last plan: expected tokens and predicted seconds
        self.predicted_s = 0.0
        self.plain_probes = 0
        self.probes = 0                 # one-token probes run, and those skipped (drafting could not pay)
        self.probes_skipped = 0
        self.explorations = 0           # sequence-rounds drafted for on an optimistic acceptance (EXPLORE_Z)

    def _acc(self, seq_id: int) -> AcceptanceEstimate:
        if seq_id not in self.per_seq:
            g = self.global_acc
            self.per_seq[seq_id] = AcceptanceEstimate(g.value, strength=prior_strength(g.acc + g.rej))
        return self.per_seq[seq_id]

    def acceptance(self, seq_ids: list[int]) -> list[float]:
        """Each request's per-token acceptance estimate."""
        return [self._acc(i).value for i in seq_ids]

    def plan(self, seq_ids: list[int], caps: list[int], behind: list[int] | None = None,
             remaining: list[int] | None = None) -> list[int]:
        """Draft lengths for this round; behind[b]: tokens b's draft must catch up on before it drafts;
        remaining[b]: tokens b may still produce (spreads a catch-up over the rest of the request)."""
        self.rounds += 1
        behind = behind or [0] * len(seq_ids)
        acc = self.acceptance(seq_ids)
        new = best_plan(acc, caps, self.cost, behind, remaining, floor=self.floor)
        old = [max(min(self.last.get(i, k), c), min(self.floor, c)) for i, k, c in zip(seq_ids, new, caps)]
        shorter = all(n <= o for n, o in zip(new, old))
        margin = self.hysteresis_down if shorter else self.hysteresis
        gain = rate(new, acc, self.cost, behind, remaining) if shorter else \
            self._rate_after_growing(new, old, acc, behind, remaining)
        if gain < rate(old, acc, self.cost, behind, remaining) * (1 + margin):
            new = old
        explored = self._explore(seq_ids, new, caps, behind, remaining) if self.explore_z > 0 else 0
        if self.rounds % self.probe_every == 0:          # keep acceptance measured where we stopped drafting
            self._probe(seq_ids, new, acc, caps, behind, remaining)
        if not any(new) and self.rounds - self.drafted_at > STALE_ROUNDS:
            self._stale_probe(seq_ids, new, caps, behind)
        self.last.update(zip(seq_ids, new))     # a plain probe below does not become the plan to keep
        n = self.plain_probe_every
        if n and self.rounds % n == self.plain_probe_at and self.rounds % self.probe_every and any(new):
            new = [0] * len(new)
            self.plain_probes += 1
        else:
            self.explorations += explored
        if any(new):
            self.drafted_at = self.rounds
        self.predicted_tokens = sum(expected_tokens(a, k) for a, k in zip(acc, new))
        catch = sum(t for t, k in zip(behind, new) if k > 0)
        self.predicted_s = self.cost.time_s(new, catch, acc) * (self.cost.unit or 0.0)
        return new

    def _rate_after_growing(self, new: list[int], old: list[int], acc: list[float], behind: list[int],
                            remaining: list[int] | None) -> float:
        """A plan's predicted rate over the rounds it is expected to serve (GROW_ROUNDS at most, fewer where
        the requests end sooner), with the one-off cost of taking it charged once (worker rounds: the chains
        pre-drafted at the old lengths are too short for the new ones, see WorkerWait.grow_wait; nothing
        in in-process rounds)."""
        r = rate(new, acc, self.cost, behind, remaining)
        if self.cost.worker is None or r <= 0:
            return r
        tokens = sum(expected_tokens(a, k) for a, k in zip(acc, new))
        left = max(remaining or [GROW_ROUNDS * (self.k + 1)], default=0)
        rounds = min(float(GROW_ROUNDS), max(left / max(tokens / max(len(new), 1), 1.0), 1.0))
        once = self.cost.worker.grow_wait(acc, old, new)
        return rounds * tokens / (rounds * tokens / r + once)

    def _explore(self, seq_ids: list[int], plan: list[int], caps: list[int], behind: list[int],
                 remaining: list[int] | None) -> int:
        """One draft token for each sequence at 0 that the plan would draft for at its optimistic
        acceptance, its batch mates as estimated (see EXPLORE_ALONE), its catch-up charged; a draft far
        behind only where the catch-up is affordable, as for a probe. -> how many were given one."""
        idle = [b for b, (k, c) in enumerate(zip(plan, caps)) if k == 0 and c > 0]
        if not idle:
            return 0
        acc = self.acceptance(seq_ids)
        upper = {b: self._acc(seq_ids[b]).upper(self.explore_z) for b in idle}
        trial = list(acc)
        for b in idle:
            trial[b] = upper[b]
        # every idle row optimistic at once first: one best_plan for the batch, and a row that does not
        # pay even then (its mates' drafting would share its steps) is taken not to pay alone either
        hopeful = best_plan(trial, caps, self.cost, behind, remaining, floor=self.floor)
        explored = 0
        for b in idle:
            if hopeful[b] == 0 or not self._catch_up_affordable(b, len(plan), behind, remaining):
                continue
            if EXPLORE_ALONE and len(idle) > 1:
                alone = list(acc)
                alone[b] = upper[b]
                if best_plan(alone, caps, self.cost, behind, remaining, floor=self.floor)[b] == 0:
                    continue
            plan[b] = 1
            explored += 1
        return explored

    def _probe(self, seq_ids: list[int], plan: list[int], acc: list[float], caps: list[int], behind: list[int],
               remaining: list[int] | None) -> None:
        """One draft token for the sequence at 0 whose turn it is (the one considered longest ago, so one
        request does not take every probe of a batch), if a probe could switch it to drafting
        (`could_pay`; one such check per probe round: it costs a best_plan)."""
        limit = self.probe_behind
        idle = [b for b, (k, c) in enumerate(zip(plan, caps))
                if k == 0 and c > 0 and (limit is None or behind[b] <= limit)]
        if not idle:
            return
        b = self._next_to_probe(seq_ids, idle)
        if self.could_pay(b, acc, caps, behind, remaining) and self._catch_up_affordable(b, len(plan), behind, remaining):
            plan[b] = 1
            self.probes += 1
        else:
            self.probes_skipped += 1

    def _next_to_probe(self, seq_ids: list[int], candidates: list[int]) -> int:
        """Of these batch rows, the one whose sequence was probed longest ago (so one request does not take
        every probe of a batch); it is marked probed now."""
        b = min(candidates, key=lambda i: self._probed.get(seq_ids[i], -1))
        self._probed[seq_ids[b]] = self.rounds
        return b

    def _stale_probe(self, seq_ids: list[int], plan: list[int], caps: list[int], behind: list[int]) -> None:
        """One draft token, whether or not the cost model expects it to pay, for a sequence whose draft is
        near (not a lazy one): after STALE_ROUNDS rounds without a draft the estimates that keep every
        round plain (the draft's cost, from its priors again; the acceptance; the price of extra rows)
        are measured again."""
        near = [b for b, c in enumerate(caps) if c > 0 and behind[b] <= self.probe_every]
        if near:
            # the draft's fitted costs go back to their priors: one measurement moves a fit that says a
            # step costs five forwards only to 4.3 (a forced cold fit, default pair, equal placement)
            self.cost.forget_draft()
            plan[self._next_to_probe(seq_ids, near)] = 1
            self.probes += 1

    def _catch_up_affordable(self, b: int, rows: int, behind: list[int], remaining: list[int] | None) -> bool:
        """A probe of a draft further behind than the rounds between probes (a lazy draft that never took
        its prompt) pays a long catch-up before it learns anything; where the request then turns out not
        to pay, that is lost. It is run only where it costs at most FAR_PROBE_SHARE of the plain rounds
        the rest of the request takes, so a lost far probe costs at most that."""
        if behind[b] <= self.probe_every:
            return True
        left = remaining[b] if remaining else 1
        catch = self.cost.draft_s([1], behind[b]) - self.cost.draft_s([1])
        return catch <= FAR_PROBE_SHARE * left * self.cost.target_s(rows)

    def could_pay(self, b: int, acc: list[float], caps: list[int], behind: list[int],
                  remaining: list[int] | None) -> bool:
        """Whether sequence b would be drafted for if it accepted OPTIMISTIC_ACCEPTANCE per token (its
        batch mates as estimated, its catch-up charged): a probe of b can change the plan only then."""
        trial = list(acc)
        trial[b] = max(trial[b], OPTIMISTIC_ACCEPTANCE)
        return best_plan(trial, caps, self.cost, behind, remaining)[b] > 0

    def would_speculate(self, rows: int) -> bool:
        """Whether a batch of `rows` requests at the engine-wide acceptance, drafts caught up, would draft
        at all under the current cost model. One request's acceptance is taken EXPLORE_Z standard
        deviations up, as for exploration: a fresh engine whose first rounds (a warm-up) accepted badly
        otherwise left the next request's draft lazy, and that request ran plain to its end (its catch-up
        too dear to explore or probe). One, its batch mates at the estimate (see EXPLORE_ALONE), as
        exploration asks: with every row optimistic at once a fresh engine (engine-wide 0.6 on 4 rounds of
        evidence, 0.82 one deviation up) prefilled the draft of every request of its first two batches of
        4 on a 2-core AVX2 host (equal placement, HumanEval), where neither the plan nor exploration then
        drafted for any of them (one probe in 250 rounds): 9 draft prefills of 16 prompts for nothing,
        and those batches ran at 0.75-0.82 of AR. At batch 1 the two agree."""
        return rows >= 1 and any(self._speculation_trial(rows)[1])

    def _speculation_trial(self, rows: int) -> tuple[list[float], list[int]]:
        """would_speculate's acceptances for a batch of `rows` and the plan the cost model makes for them."""
        v = self.global_acc.value
        a = self.global_acc.upper(self.explore_z) if self.explore_z > 0 else v
        trial = [a] + [v] * (rows - 1) if EXPLORE_ALONE else [a] * rows
        return trial, best_plan(trial, [self.k] * rows, self.cost)

    def paid_prefills(self, rows: int, feed: list[int], remaining: list[int]) -> int:
        """Of new requests with these prompt tokens to feed and tokens left, how many the plan of
        would_speculate repays the draft prefill of (prefill_pays), at most as many as it drafts for
        (with one request optimistic, one)."""
        trial, plan = self._speculation_trial(rows)
        return min(sum(prefill_pays(trial, plan, self.cost, f, r) for f, r in zip(feed, remaining)),
                   sum(k > 0 for k in plan))

    def eager_prefills(self, rows: int, new: int, feed: list[int] | None = None,
                       remaining: list[int] | None = None) -> int:
        """How many of `new` arriving requests (in a batch of `rows`) get the in-process draft prefilled
        with their prompt (auto: as SD does, instead of catching it up in the first decode rounds): where
        the batch would draft (would_speculate), those whose prefill the drafting pays for (`feed`: each
        one's tokens for the draft to take in, `remaining`: each one's tokens left to generate; see
        prefill_pays), at most as many as that plan drafts for (without `feed`, all); else one, once in
        STALE_ROUNDS rounds without drafting,
        so the stale probe (`_stale_probe`) has a near draft to measure the estimates that say no with;
        else none. One, not the batch: the probe drafts for one sequence, and at batch 8 (paper placement,
        every round plain) prefilling every new prompt's draft each stretch cost 6-7 s of 50 s per 16
        prompts on the target's one thread (TTFT 13.3 s against AR's 9.7)."""
        if rows < 1 or new < 1:
            return 0
        if self.would_speculate(rows):
            n = new if feed is None or remaining is None else self.paid_prefills(rows, feed, remaining)
            if n:
                return n
        if self.rounds - max(self.drafted_at, self.stale_prefill_at) > STALE_ROUNDS:
            self.stale_prefill_at = self.rounds     # at most one such prefill per STALE_ROUNDS rounds
            return 1
        return 0

    def observe(self, seq_ids: list[int], num_draft: list[int], accepted: list[int], draft_s: float,
                target_s: float, caught_up: int = 0) -> None:
        self.cost.observe_target(sum(k + 1 for k in num_draft), target_s)
        self.cost.observe_draft(num_draft, draft_s, caught_up)
        for i, k, n in zip(seq_ids, num_draft, accepted):
            self._acc(i).observe(k, n)
            self.global_acc.observe(k, n, decay=0.99)

    def forget(self, seq_id: int) -> None:
        self.per_seq.pop(seq_id, None)
        self.last.pop(seq_id, None)
        self._probed.pop(seq_id, None)
