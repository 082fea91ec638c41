"""auto's price of a worker (SSD) round: cache hit probabilities, the learned waits, and the K the
worker rounds' chooser picks with them (pure functions; no model)."""
from __future__ import annotations

import random

import pytest

from ssd.speculation.chooser import Chooser, CostModel, best_plan
from ssd.speculation.worker_wait import Mean, WorkerWait, hit_probability


def test_hit_probability():
    assert hit_probability([0.8], [2], 0.9, 0.1) == pytest.approx(0.9 * 0.64 + 0.1 * 0.36)
    assert hit_probability([0.8, 0.5], [2, 1], 1.0, 0.0) == pytest.approx(0.64 * 0.5)
    assert hit_probability([0.8, 0.5], [2, 0], 1.0, 0.0) == pytest.approx(0.64)   # no lookup, no miss
    assert hit_probability([], [], 0.9, 0.1) == 1.0


def test_mean_is_a_running_mean_then_an_exponential_average():
    m = Mean(1.0, weight=2.0, alpha=0.25)
    m.add(4.0)                      # (2 * 1 + 4) / 3
    assert m.value == pytest.approx(2.0)
    m.add(2.0)                      # 4 observations' worth: capped from here on
    assert m.value == pytest.approx(2.0)
    m.add(6.0)
    assert m.value == pytest.approx(2.0 + 0.25 * 4.0)


def test_learns_hit_rates_and_waits_from_rounds():
    rng = random.Random(0)
    w = WorkerWait()
    for _ in range(400):
        full = rng.random() < 0.6
        w.observe_lookup(full, rng.random() < (0.95 if full else 0.05))
        k = rng.choice([1, 2, 4])
        hit = rng.random() < 0.6
        w.observe_round(hit, k, 0.05 * rng.uniform(0.9, 1.1) + (0 if hit else 0.4 * k))
    assert w.h_full.value == pytest.approx(0.95, abs=0.08)
    assert w.h_part.value == pytest.approx(0.05, abs=0.08)
    assert w.hit_s.value == pytest.approx(0.05, abs=0.01)
    assert w.per_token_s.value == pytest.approx(0.4, abs=0.05)
    assert w.expected([0.8], [0]) == 0.0
    p = hit_probability([0.8], [3], w.h_full.value, w.h_part.value)
    assert w.expected([0.8], [3]) == pytest.approx(w.hit_s.value + (1 - p) * 3 * w.per_token_s.value)


def ssd_model(per_token_s: float) -> CostModel:
    m = CostModel(worker=WorkerWait(h_full=0.92, h_part=0.05, hit_s=0.02, per_token_s=per_token_s))
    m.unit = 1.0
    m.target.set([0.7, 0.2])        # verify rows are dear with the target on one core (as measured)
    return m


@pytest.mark.parametrize("per_token_s, acceptance, want", [
    (0.0, 0.85, 4),     # negative control: drafting priced as free, the old model, asks for the longest
    (0.4, 0.85, 2),     # the miss wait of a drafting core (as measured on the default pair): shorter
    (0.4, 0.97, 4),     # ... unless nearly everything is accepted, so nearly every round hits
    (0.4, 0.60, 1),
])
def test_the_worker_rounds_k_weighs_the_wait_on_a_miss(per_token_s, acceptance, want):
    assert best_plan([acceptance], [4], ssd_model(per_token_s)) == [want]


def test_a_batch_misses_when_any_lookup_misses():
    """Each extra sequence at the longest K adds a chance of a miss for the whole batch: the worker
    chooser shortens the drafts of a large batch before a small one's."""
    m = ssd_model(0.4)
    one = best_plan([0.9], [4], m)
    many = best_plan([0.9] * 6, [4] * 6, m)
    assert max(many) < max(one)


def test_a_chooser_plan_predicts_the_wait():
    ch = Chooser(4, cost=ssd_model(0.4))
    ch.cost.unit = 0.1
    plan = ch.plan([1], [4])
    m = ch.cost
    acc = [ch._acc(1).value]
    assert ch.predicted_s == pytest.approx(0.1 * (m.worker.expected(acc, plan) + m.target_s(plan[0] + 1)))


def test_worker_rounds_draft_at_least_one_token_and_pick_the_best_such_plan():
    """A worker with nothing out has nothing to pre-draft for: worker rounds plan with floor=1. Where a
    plain round would win, the best plan of at least one token is taken (not a plain one forced up)."""
    m = ssd_model(0.55)
    assert best_plan([0.3], [4], m) == [0]                       # the control: without the floor
    assert best_plan([0.3], [4], m, floor=1) == [1]
    assert best_plan([0.3, 0.3], [4, 0], m, floor=1) == [1, 0]   # a cap of 0 stays 0
    ch = Chooser(4, cost=m, floor=1, hysteresis=0.1, plain_probe_every=0)   # as step.py makes it
    assert all(min(ch.plan([1, 2], [4, 4])) >= 1 for _ in range(40))


def test_the_local_regime_is_predicted_with_the_catch_up_of_its_draft():
    """auto_ssd's prediction of a local stint (worker apart): the worker rounds' target line, one draft
    step per draft token, and the catch-up of a draft that sat out the worker rounds, spread over the
    stint. The control: without the catch-up price the prediction does not change with how far
    behind the draft is."""
    from ssd.speculation.chooser import local_cost, rate

    worker = CostModel(worker=WorkerWait())
    worker.unit = 0.1
    acc, caps, stint = [0.8], [4], [16]

    def predicted(catch_up, behind):
        m = local_cost(worker, 0.3, catch_up)
        plan = best_plan(acc, caps, m, [behind], stint)
        return rate(plan, acc, m, [behind], stint)

    assert predicted(0.0, 500) == pytest.approx(predicted(0.0, 0))            # the control
    in_step, one_stint, a_prompt = predicted(0.02, 0), predicted(0.02, 40), predicted(0.02, 500)
    plain = 1.0 / worker.target_s(1)          # a stint of plain steps: what a far-behind draft is worth
    assert in_step > one_stint >= a_prompt == pytest.approx(plain) and plain < 0.8 * in_step


def test_a_longer_ask_than_the_last_teaches_neither_hit_rates_nor_the_miss_wait():
    """A chain pre-drafted at the last length is too short for a longer ask: that miss says nothing of
    how often the worker guesses the outcome, and its wait (the chain finished just in time) is not a
    miss's. The control: the same miss at the last length is learned."""
    from types import SimpleNamespace as NS

    from ssd.speculation.step import SpeculativeStep
    from ssd.speculation.worker.messages import Source

    def observe(last_k, k):
        ch = Chooser(4, cost=CostModel(worker=WorkerWait()), floor=1)
        ch.cost.unit = 0.1
        seq = NS(spec_state=NS(num_draft=last_k, accepted=last_k))
        proposal = NS(sources=[Source.PARTIAL], tokens=[[7] * k])
        SpeculativeStep._observe_wait(NS(worker_chooser=ch), [seq], proposal, 0.01, 0)
        w = ch.cost.worker
        return w.h_full.n, w.per_token_s.n

    prior = observe(0, 1)                   # no speculation last round: no lookup, a wait observed
    assert observe(3, 3) == (prior[0] + 1, prior[1])     # the control: a lookup and a wait learned
    assert observe(2, 3) == (prior[0], prior[1] - 1)     # grown: neither


def test_handing_sequences_back_to_the_worker_is_priced_per_token_it_prefills():
    """A worker round that first prefills what it does not hold of the contexts teaches the price per
    token prefilled, net of the round's miss wait; it does not teach the miss wait (the control: the same round without
    a hand-back does)."""
    from types import SimpleNamespace as NS

    from ssd.speculation.step import SpeculativeStep
    from ssd.speculation.worker.messages import Source

    w = WorkerWait(hit_s=0.02, per_token_s=0.3)
    for _ in range(100):
        w.observe_retake(400, 2, 0.02 + 2 * 0.3 + 400 * 0.01)
    assert w.retake_s.value == pytest.approx(0.01, rel=1e-3)

    def observe(retaken):
        ch = Chooser(4, cost=CostModel(worker=WorkerWait()), floor=1)
        ch.cost.unit = 0.1
        seq = NS(spec_state=NS(num_draft=0, accepted=0))
        SpeculativeStep._observe_wait(NS(worker_chooser=ch), [seq], NS(sources=[Source.NEURAL], tokens=[[7, 7]]),
                                      0.5, retaken)
        w = ch.cost.worker
        return w.retake_s.n, w.per_token_s.n

    assert observe(0) == (1.0, 3.0)          # the control: a miss wait learned, no hand-back price
    assert observe(300) == (2.0, 2.0)


class _Seq:
    def __init__(self, seq_id: int, tokens: int, detached: bool, held: int = 0):
        from types import SimpleNamespace as NS
        self.seq_id, self.tokens, self.spec_state = seq_id, tokens, NS(detached=detached, worker_held=held)

    def __len__(self) -> int:
        return self.tokens

    def remaining_tokens(self) -> int:
        return 64


def _step(apart: bool):
    """What SpeculativeStep.predicted_rate reads, with both regimes' fits measured: worker rounds with the
    target on 1 thread (unit 0.2 s), local rounds on 2 (unit 0.12 s)."""
    from types import SimpleNamespace as NS

    wc = Chooser(4, cost=CostModel(worker=WorkerWait()), floor=1, plain_probe_every=0)
    wc.cost.unit = 0.2
    for _ in range(5):
        wc.cost.worker.observe_round(False, 2, 0.6)
    local = Chooser(4, shares_acceptance=wc)
    local.cost.unit = 0.12
    from ssd.speculation.step import SpeculativeStep

    step = NS(worker_chooser=wc, chooser=local, regime=NS(dwell=16), num_draft=lambda s: 4,
              worker=NS(prefill_s_per_token=lambda: None),
              proposer=NS(behind=lambda seqs: [0] * len(seqs)), worker_prefills_always=apart,
              thread_split=None if apart else (1, 2), thread_slowdown=None, draft_prefill_per_token=None)
    step._worker_bound = lambda seqs, acc, caps, *a: SpeculativeStep._worker_bound(step, seqs, acc, caps, *a)
    return step


@pytest.mark.parametrize("prefill, dearer", [(None, False), (0.002, False), (0.016, True)])
def test_a_local_visit_prices_its_drafts_catch_up_at_least_at_the_workers_measured_prefill(prefill, dearer):
    """Worker apart: a lazy in-process draft catches up on what it missed before it drafts; where the local
    rounds have not measured that, the worker's measured prefill per token (the same draft on one core; in
    seconds, unit 0.2 s here: 0.016 s is 0.08 units) is its price if it is dearer than theirs (0.02 units,
    the prior). The controls: unmeasured, or cheaper (0.01 units), it changes nothing."""
    from types import SimpleNamespace as NS

    from ssd.speculation.regime import LOCAL
    from ssd.speculation.step import SpeculativeStep

    step = _step(apart=True)
    step.proposer = NS(behind=lambda seqs: [40] * len(seqs))     # one stint's worth of tokens behind
    seqs = [_Seq(0, 200, True)]
    before = SpeculativeStep.predicted_rate(step, seqs, LOCAL)
    if prefill is not None:
        step.worker = NS(prefill_s_per_token=lambda: prefill)
    after = SpeculativeStep.predicted_rate(step, seqs, LOCAL)
    assert (after < 0.95 * before) if dearer else after == pytest.approx(before)


def test_a_worker_visit_is_predicted_with_the_prefill_of_the_contexts_handed_back():
    """auto_ssd's prediction of a worker stint: the worker rounds' fits, plus the prefill of what the worker
    does not hold of the contexts (prompts that arrived in local stints; of a sequence it dropped in one,
    the tokens beyond the prefix it still has cached), spread over the stint. The control: sequences the
    worker holds cost nothing to hand back."""
    from ssd.speculation.chooser import expected_tokens
    from ssd.speculation.step import SpeculativeStep

    step = _step(apart=False)
    wait = step.worker_chooser.cost.worker
    wait.retake_s.value = 0.01                              # units per token it prefills
    held = [_Seq(i, 300, False) for i in range(4)]
    back = [_Seq(i, 300, True) for i in range(4)]
    cost, acc = step.worker_chooser.cost, step.worker_chooser.acceptance([0, 1, 2, 3])
    plan = best_plan(acc, [4] * 4, cost, floor=1)
    tokens, per_round = sum(expected_tokens(a, k) for a, k in zip(acc, plan)), cost.time_s(plan, 0.0, acc)
    assert SpeculativeStep.predicted_rate(step, held, "worker") == pytest.approx(tokens / per_round / 0.2)
    assert SpeculativeStep.predicted_rate(step, back, "worker") == pytest.approx(
        tokens / (per_round + 0.01 * 1200 / 16) / 0.2)
    dropped = [_Seq(i, 300, True, held=280) for i in range(4)]   # 20 tokens each committed since the drop
    assert SpeculativeStep.predicted_rate(step, dropped, "worker") == pytest.approx(
        tokens / (per_round + 0.01 * 80 / 16) / 0.2)


def test_the_bound_on_a_first_worker_visit_prices_the_prefill_of_the_contexts_it_is_handed():
    """Equal placement, before any worker round: the bound on a visit is all-hit rounds on the slower
    target plus the worker's prefill of the contexts it does not hold (at the in-process draft's fastest
    prefill per token, slowed as the target is), spread over the stint. The controls: contexts the
    worker holds, or no draft prefill measured yet, give the all-hit bound alone."""
    from ssd.speculation.chooser import all_hit_cost, expected_tokens
    from ssd.speculation.step import SpeculativeStep

    step = _step(apart=False)
    step.thread_slowdown = 1.6
    step.worker_chooser.cost.worker = WorkerWait()         # no worker round yet: the bound predicts it
    held = [_Seq(0, 400, False)]
    back = [_Seq(0, 400, True)]
    acc = step.worker_chooser.acceptance([0])
    bound = all_hit_cost(step.chooser.cost, 1.6)
    plan = best_plan(acc, [4], bound, floor=1)
    tokens, per_round = expected_tokens(acc[0], plan[0]), bound.time_s(plan, 0.0, acc)
    all_hit = tokens / per_round / 0.12
    assert SpeculativeStep.predicted_rate(step, back, "worker") == pytest.approx(all_hit)    # none measured
    SpeculativeStep._observe_draft_prefill(step, [], 1.0)
    assert step.draft_prefill_per_token is None                                            # nothing fed
    for fed, cached, secs in ((200, 0, 0.8), (300, 100, 0.5), (100, 0, 0.9)):
        SpeculativeStep._observe_draft_prefill(step, [_Fed(fed, cached)], secs)
    assert step.draft_prefill_per_token == pytest.approx(0.0025)                           # the least of 4, 2.5, 9 ms
    assert SpeculativeStep.predicted_rate(step, held, "worker") == pytest.approx(all_hit)
    got = SpeculativeStep.predicted_rate(step, back, "worker")
    assert got == pytest.approx(tokens / (per_round + 0.0025 * 1.6 * 400 / 0.12 / 16) / 0.12)
    assert got < 0.85 * all_hit


class _Fed:
    def __init__(self, tokens: int, cached: int):
        self.tokens, self.num_cached = tokens, [0, cached]

    def __len__(self) -> int:
        return self.tokens


def test_where_local_rounds_take_the_cores_back_the_local_regime_is_predicted_from_its_own_rounds():
    """Equal placement (the target has more threads in local rounds): the local regime's prediction comes
    from the local rounds' fits, and is None until they have measured a round, however well the worker
    rounds are measured. The control: with the worker apart it comes from the worker rounds' fits."""
    from ssd.speculation.chooser import rate
    from ssd.speculation.step import SpeculativeStep

    seqs = [_Seq(0, 100, False)]
    step = _step(apart=False)
    local = step.chooser.cost
    want = rate(best_plan([0.6], [4], local, [0], [16]), [0.6], local, [0], [16]) / 0.12
    assert SpeculativeStep.predicted_rate(step, seqs, "local") == pytest.approx(want)
    local.unit = None
    assert SpeculativeStep.predicted_rate(step, seqs, "local") is None
    apart = _step(apart=True)
    apart.chooser.cost.unit = None
    assert SpeculativeStep.predicted_rate(apart, seqs, "local") is not None


def test_the_worker_regime_is_predicted_after_a_stint_that_mostly_hit():
    """A first worker stint of 16 rounds (three of them set the cost model's unit) that hit the
    speculation cache 80% of the time saw two misses: the worker regime is predicted after it, so its
    next visit can be pruned. The control: counting misses (the old criterion) leaves it unpredicted,
    and its probe 128 rounds later ran at half the local regime's rate (equal placement, AVX-512 host)."""
    from ssd.speculation.step import SpeculativeStep

    step = _step(apart=False)
    wait = step.worker_chooser.cost.worker = WorkerWait()
    for i in range(13):
        wait.observe_round(i % 6 != 5, 2, 0.05 if i % 6 != 5 else 0.6)
    assert wait.per_token_s.n < 5                              # the control: two misses after the prior's two
    got = SpeculativeStep.predicted_rate(step, [_Seq(0, 100, False)], "worker")
    assert got is not None and got > 0
    fresh = _step(apart=False)
    fresh.worker_chooser.cost.worker = WorkerWait()
    for _ in range(4):
        fresh.worker_chooser.cost.worker.observe_round(True, 2, 0.05)
    assert SpeculativeStep.predicted_rate(fresh, [_Seq(0, 100, False)], "worker") is None   # 4 rounds: not yet


@pytest.mark.parametrize("acceptance, batch, slower", [
    (0.5, 1, True),      # chat-like acceptance: even all-hit rounds on the slower target lose
    (0.5, 4, True),
    (0.95, 1, False),    # code-like: all-hit rounds could win, so the worker may be visited
])
def test_where_ssd_rounds_take_the_targets_cores_an_unvisited_worker_is_bounded_by_all_hit_rounds(
        acceptance, batch, slower):
    """The equal placement, before the worker has run a round: its rate is bounded by rounds that all hit
    the speculation cache (no wait, no hand-over) on a target `thread_slowdown` times slower than in local
    rounds (measured at start). A first visit there ran at about 0.5x the local regime (AVX-512 host,
    MT-Bench); where even the bound is more than the prune margin (10%) below the local rate it is not
    run. The controls: with no measured slowdown, or the worker on cores of its own (no thread split),
    there is no prediction (as before); with slowdown 1 the bound is above the plain rate."""
    from ssd.speculation.chooser import AcceptanceEstimate, rate
    from ssd.speculation.step import SpeculativeStep

    step = _step(apart=False)
    step.worker_chooser.cost = CostModel(worker=WorkerWait())      # no worker round yet
    local = step.chooser.cost
    local.target.set([1.0, 0.2])            # a row costs 20% of a 1-row forward (measured 18-22% there)
    seqs = [_Seq(i, 100, False) for i in range(batch)]
    for i in range(batch):
        step.chooser.per_seq[i] = AcceptanceEstimate(acceptance, strength=100.0)
    assert SpeculativeStep.predicted_rate(step, seqs, "worker") is None           # the control: not measured
    step.thread_slowdown = 1.5
    bound = SpeculativeStep.predicted_rate(step, seqs, "worker")
    plain = rate([0] * batch, [acceptance] * batch, local) / local.unit
    assert (bound * 1.1 < plain) == slower
    step.thread_slowdown = 1.0
    assert SpeculativeStep.predicted_rate(step, seqs, "worker") > plain
    apart = _step(apart=True)
    apart.worker_chooser.cost = CostModel(worker=WorkerWait())
    apart.thread_slowdown = 1.5
    assert SpeculativeStep.predicted_rate(apart, seqs, "worker") is None


def test_the_thread_slowdown_is_the_least_ratio_of_median_times_and_restores_the_threads(monkeypatch):
    """thread_scaling.slowdown with a fake clock: per row count the median time on few threads over the
    median on many, the least of them; torch's thread count is left as it was."""
    import torch

    from ssd.speculation import thread_scaling

    cost = {(1, 1): 1.5, (1, 2): 1.0, (4, 1): 1.8, (4, 2): 1.0, (16, 1): 1.9, (16, 2): 1.0}
    clock = [0.0]
    monkeypatch.setattr(thread_scaling.time, "perf_counter", lambda: clock[0])

    def run(rows):
        clock[0] += cost[(rows, torch.get_num_threads())]

    before = torch.get_num_threads()
    assert thread_scaling.slowdown(run, 1, 2) == pytest.approx(1.5)
    assert torch.get_num_threads() == before


def test_grow_wait_is_the_partial_hit_of_a_longer_ask():
    w = WorkerWait(h_full=0.92, h_part=0.1, hit_s=0.02, per_token_s=0.3)
    p = hit_probability([0.7], [1], 0.92, 0.1)
    assert w.grow_wait([0.7], [1], [3]) == pytest.approx(p * 2 * 0.3)     # two steps more, where it would hit
    assert w.grow_wait([0.7], [2], [2]) == 0.0 and w.grow_wait([0.7], [3], [1]) == 0.0


def _grow_model() -> CostModel:
    m = CostModel(worker=WorkerWait(h_full=0.92, h_part=0.1, hit_s=0.02, per_token_s=0.3))
    m.unit = 1.0
    m.target.set([1.0, 0.1])        # cheap verify rows: K=2 predicted 4.9% faster than K=1 at acceptance 0.7
    return m


@pytest.mark.parametrize("remaining, hysteresis, want", [
    (64, 0.01, [2]),     # K=2 predicted 4.9% faster at 0.7: it pays for its one partial hit within the request
    (64, 0.10, [1]),     # negative control: the old flat 10% margin keeps K=1 (auto ran 18-49% K=1 rounds at b1)
    (8, 0.01, [2]),      # a few rounds left still repay it
    (3, 0.01, [1]),      # one or two rounds left do not: the one-off wait is charged
])
def test_a_longer_ask_in_worker_rounds_is_priced_once_over_the_rounds_it_serves(remaining, hysteresis, want):
    from ssd.speculation.chooser import AcceptanceEstimate, rate
    m = _grow_model()
    assert rate([2], [0.7], m) / rate([1], [0.7], m) == pytest.approx(1.0486, abs=1e-3)
    ch = Chooser(4, cost=m, floor=1, hysteresis=hysteresis, hysteresis_down=0.03, plain_probe_every=0,
                 probe_every=10**9)
    ch.per_seq[1] = AcceptanceEstimate(0.7, strength=1e6)
    ch.last[1] = 1
    assert ch.plan([1], [4], None, [remaining]) == want


def test_without_the_one_off_wait_a_short_remainder_would_grow():
    """The control of the case above with 3 tokens left: with the partial hit priced at nothing the
    longer ask is taken, so it is the charge that keeps K=1 there."""
    from ssd.speculation.chooser import AcceptanceEstimate
    m = _grow_model()
    m.worker.grow_wait = lambda acc, old, new: 0.0
    ch = Chooser(4, cost=m, floor=1, hysteresis=0.01, hysteresis_down=0.03, plain_probe_every=0, probe_every=10**9)
    ch.per_seq[1] = AcceptanceEstimate(0.7, strength=1e6)
    ch.last[1] = 1
    assert ch.plan([1], [4], None, [3]) == [2]



def test_a_catch_up_floor_prices_a_far_behind_draft_out_of_a_short_stint():
    """Worker apart: the local chooser's catch-up price is at least the worker's measured prefill per token
    (0.07 units here, as measured; the fit's prior is 0.02), as in the local regime's prediction. A lazy
    draft 250 tokens behind then runs plain rounds in a 16-40-token stint and drafts where the request
    has 64 left; one in step drafts either way. The control: without the floor it catches up at once."""
    def plan(floor, behind, remaining):
        m = CostModel()
        m.unit, m.catch_up_floor = 0.055, floor
        m.target.set([1.0, 0.3])
        return best_plan([0.9], [6], m, [behind], [remaining])

    assert plan(0.07, 250, 16) == [0] and plan(0.07, 250, 40) == [0]
    assert plan(0.07, 250, 64)[0] > 0 and plan(0.07, 0, 16)[0] > 0
    assert plan(0.0, 250, 16)[0] > 0                       # the control: the prior's price
    m = CostModel()
    m.catch_up_floor = 0.07
    assert m.draft_s([2], 100) == pytest.approx(m.draft_s([2], 0) + 0.07 * 100)     # the floor, not the fit
    m.catch_up_floor = 0.01
    assert m.draft_s([2], 100) == pytest.approx(m.draft_s([2], 0) + m.draft_coefficients()[2] * 100)


def test_local_rounds_take_the_workers_prefill_price_as_their_catch_up_floor():
    """SpeculativeStep._floor_catch_up: the worker's seconds per token in the local chooser's units; nothing
    while the worker has not reported enough (the control)."""
    from types import SimpleNamespace as NS

    from ssd.speculation.step import SpeculativeStep

    local = Chooser(4)
    local.cost.unit = 0.05
    step = NS(chooser=local, worker=NS(prefill_s_per_token=lambda: None))
    SpeculativeStep._floor_catch_up(step)
    assert local.cost.catch_up_floor == 0.0
    step.worker = NS(prefill_s_per_token=lambda: 0.0035)
    SpeculativeStep._floor_catch_up(step)
    assert local.cost.catch_up_floor == pytest.approx(0.07)


@pytest.mark.parametrize("local_vs_held, loses", [
    (0.8, False),   # the worker wins when it holds the contexts: it keeps prefilling (the trap's case)
    (1.5, True),    # the control: it loses even holding them, so its idle-time prefills are left out
])
def test_the_worker_is_left_idle_only_where_it_loses_even_holding_the_contexts(local_vs_held, loses):
    """SpeculativeStep._worker_loses_anyway: the worker rounds' prediction without the prefill of what the
    worker lacks, against the local regime's prediction for the same requests (prune margin). Priced with
    that prefill (a prompt of 1,200 tokens it never got) the worker looks slower than local in both cases;
    leaving its prefills out on that ground would keep it so."""
    from types import SimpleNamespace as NS

    from ssd.speculation.regime import LOCAL, WORKER
    from ssd.speculation.step import SpeculativeStep

    step = _step(apart=True)
    step.worker_chooser.cost.worker.retake_s.value = 0.01
    seqs = [_Seq(0, 1200, True)]
    held = SpeculativeStep.predicted_rate(step, seqs, WORKER, retake=False)
    with_prefill = SpeculativeStep.predicted_rate(step, seqs, WORKER)
    local = held * local_vs_held
    assert with_prefill < local                  # priced with the prefill it looks slower in both cases
    step.regime = NS(dwell=16, prune=0.1)
    step.predicted_rate = lambda s, r, retake=True: \
        local if r == LOCAL else SpeculativeStep.predicted_rate(step, s, r, retake)
    assert SpeculativeStep._worker_loses_anyway(step, seqs, 1) == loses
    step.predicted_rate = lambda s, r, retake=True: None     # unpredicted: it keeps prefilling
    assert not SpeculativeStep._worker_loses_anyway(step, seqs, 1)
