"""mode="auto" with a draft worker (auto_ssd): the regime policy as a pure class, and the engine
switching between SSD stints (the worker) and local rounds (the in-process draft, per-sequence K)
while staying token-identical to AR, losing the worker without losing a request."""
from __future__ import annotations

import os
import signal
import time

import pytest

from ssd import LLM, SamplingParams
from ssd.speculation.regime import LOCAL, WORKER, RegimePolicy, bucket

from ssd_local import random_chooser, random_regime

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = ["hello world", "abc", "def f(x):\n    return", "abab abab abab", "The quick brown fox"]


# ---------------------------------------------------------------- the thread split


@pytest.mark.parametrize("cores, threads, want, level", [
    ({0, 1}, None, (1, 2), None),           # the worker's core is taken back in local rounds
    ({0, 1, 2}, 2, (1, 2), None),           # --threads counts the target's and the worker's cores
    ({0, 1}, 1, None, "INFO"),              # the paper placement: separate cores, nothing to take back
    ({0}, None, None, "WARNING"),           # one core: target and worker really share it
])
def test_auto_ssd_thread_split_and_what_it_says(monkeypatch, caplog, cores, threads, want, level):
    from types import SimpleNamespace

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))
    cfg = SimpleNamespace(device="cpu", draft_host=None, draft_device=None, num_draft_workers=1, draft_cores=None,
                          threads=threads)
    with caplog.at_level("INFO", logger="ssd.llm"):
        # apart (idle in local rounds, so it prefills then) only where nothing is taken back nor shared
        assert LLM._auto_ssd_threads(cfg) == (want, level == "INFO")
    shares = [r for r in caplog.records if "share cores" in r.getMessage()]
    assert bool(shares) == (level == "WARNING")
    if level == "INFO":
        assert any("take no core back" in r.getMessage() and r.levelname == "INFO" for r in caplog.records)


# ---------------------------------------------------------------- when auto runs draft workers


@pytest.mark.parametrize("kw, want", [
    (dict(), False),                                        # nothing asks for a worker: in-process drafts
    (dict(draft_host="10.0.0.2:29500"), True),              # a remote worker is waited for, not ignored
    (dict(draft_cores=[1]), True),
    (dict(draft_threads=2), True),
    (dict(num_draft_workers=2), True),
    (dict(num_draft_workers=1), False),
    (dict(auto_ssd=True), True),
    (dict(auto_ssd=False), False),
])
def test_worker_settings_turn_auto_ssd_on_in_mode_auto(kw, want):
    from ssd.config import EngineConfig

    assert EngineConfig(model="t", draft="d", **kw).auto_ssd is want       # mode None with a draft: auto


@pytest.mark.parametrize("kw, match", [
    (dict(mode="auto", auto_ssd=False, draft_host="10.0.0.2:29500"), "auto_ssd=False keeps mode 'auto'"),
    (dict(mode="sd", draft_host="10.0.0.2:29500"), "draft_host applies to mode 'ssd' and to 'auto'"),
    (dict(mode="sd", draft_cores=[1], draft_threads=1), "draft_cores, draft_threads applies"),
    (dict(mode="ar", draft_threads=2), "mode 'ar' runs no draft worker"),
])
def test_worker_settings_a_mode_would_ignore_are_an_error(kw, match):
    from ssd.config import EngineConfig

    with pytest.raises(ValueError, match=match):
        EngineConfig(model="t", draft="d", **kw)


def test_the_cli_turns_auto_ssd_on_off_or_leaves_it_to_the_settings():
    from ssd.cli import build_parser

    parse = lambda *a: build_parser().parse_args(["generate", "--prompt", "x", *a]).auto_ssd  # noqa: E731
    assert (parse(), parse("--auto-ssd"), parse("--no-auto-ssd")) == (None, True, False)


def test_auto_with_a_draft_worker_setting_runs_the_worker(tiny_pair, ar_ref):
    """`draft_cores` (or `--draft-host`, ...) in the default mode starts the worker; before, auto
    ignored them and drafted in-process only."""
    target, draft = tiny_pair
    llm = LLM(str(target), draft=str(draft), k=3, dtype="float32", progress=False, kv_cache_gb=0.05,
              worker_timeout_s=20, draft_cores=[max(os.sched_getaffinity(0))])
    try:
        step = llm.engine.step_impl
        assert llm.config.mode == "auto" and llm.config.auto_ssd and step.worker is not None
        # where SSD rounds take the target's cores (a thread split) auto starts local, the worker waiting
        shares = step.thread_split is not None
        assert step.regime.current == (LOCAL if shares else WORKER) and step.regime.worker_waits == shares
        # there the target's slowdown on its SSD-round threads is measured at start (it bounds the worker)
        assert (step.thread_slowdown is not None) == shares
        assert not shares or 0.0 < step.thread_slowdown < float("inf")
        assert llm.generate(PROMPTS[2], GREEDY)[0].token_ids == ar_ref[2]
    finally:
        llm.close()


# ---------------------------------------------------------------- the policy


def run(policy: RegimePolicy, rates: dict[str, float], rounds: int, batch: int = 1) -> list[str]:
    """Drive the policy with a fixed tokens/s per regime; -> the regime of every round."""
    out = []
    for _ in range(rounds):
        r = policy.pick(batch)
        out.append(r)
        policy.observe(batch, 10, 10 / rates[r])
    return out


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [0, 1, 2, 2, 3, 3, 4, 4, 5]


def test_measures_both_then_stays_with_the_faster():
    p = RegimePolicy(dwell=4, probe_every=1000, start=WORKER)
    seq = run(p, {WORKER: 10.0, LOCAL: 20.0}, 40)
    assert seq[:4] == [WORKER] * 4 and seq[4:8] == [LOCAL] * 4      # one stint each to measure
    assert set(seq[8:]) == {LOCAL}                                   # then the faster one
    assert p.rate[(LOCAL, 0)] == pytest.approx(20.0) and p.rate[(WORKER, 0)] == pytest.approx(10.0)
    p = RegimePolicy(dwell=4, probe_every=1000, start=WORKER)
    assert set(run(p, {WORKER: 20.0, LOCAL: 10.0}, 40)[8:]) == {WORKER}


def test_hysteresis_keeps_a_regime_that_is_barely_slower():
    p = RegimePolicy(dwell=4, probe_every=1000, hysteresis=0.05, start=WORKER)
    seq = run(p, {WORKER: 10.0, LOCAL: 10.3}, 40)     # worker, then local 3% faster: local is kept
    assert set(seq[8:]) == {LOCAL}
    p = RegimePolicy(dwell=4, probe_every=1000, hysteresis=0.05, start=LOCAL)
    seq = run(p, {WORKER: 10.3, LOCAL: 10.0}, 40)     # local, then the worker measured 3% faster: kept
    assert seq[4:8] == [WORKER] * 4 and set(seq[8:]) == {WORKER}
    p = RegimePolicy(dwell=4, probe_every=1000, hysteresis=0.10, start=WORKER)
    seq = run(p, {WORKER: 10.0, LOCAL: 10.5}, 40)     # 5% < 10%: after measuring, back is not taken
    assert set(seq[8:]) == {LOCAL}


def probe_starts(seq: list[str], slow: str) -> list[int]:
    return [i for i in range(8, len(seq)) if seq[i] == slow and seq[i - 1] != slow]


def test_probes_the_other_regime_when_its_estimate_is_stale_backing_off_while_it_loses():
    p = RegimePolicy(dwell=4, probe_every=32, max_probe_every=10**6, start=WORKER)
    seq = run(p, {WORKER: 10.0, LOCAL: 20.0}, 600)
    starts = probe_starts(seq, WORKER)
    gaps = [b - a for a, b in zip(starts, starts[1:])]
    assert len(starts) >= 3 and starts[0] < 60              # the first probe after about probe_every
    assert all(g2 > 1.6 * g1 for g1, g2 in zip(gaps, gaps[1:]))   # every lost probe doubles the interval
    assert seq.count(LOCAL) > 0.9 * len(seq)
    # without backoff (max_probe_every = probe_every) probes stay about probe_every apart
    p = RegimePolicy(dwell=4, probe_every=32, max_probe_every=32, start=WORKER)
    starts = probe_starts(run(p, {WORKER: 10.0, LOCAL: 20.0}, 600), WORKER)
    assert len(starts) >= 12 and max(b - a for a, b in zip(starts, starts[1:])) <= 44


def test_a_probe_that_wins_resets_the_interval():
    p = RegimePolicy(dwell=4, probe_every=32, max_probe_every=10**6, start=WORKER)
    rates = {WORKER: 10.0, LOCAL: 20.0}
    run(p, rates, 300)                                       # probes lost: the interval grew
    assert p.interval[(WORKER, 0)] >= 128
    rates[WORKER] = 40.0                                     # the worker becomes the faster regime
    seq = run(p, rates, 400)
    assert seq[-50:].count(WORKER) > 40                      # its next probe wins and it stays
    won = seq.index(WORKER)
    stay = won + seq[won:].index(LOCAL)                      # the first probe of local after the win
    assert stay - won <= 32 + 3 * 4                          # came after the base interval again


@pytest.mark.parametrize("earned", [False, True])
def test_a_regime_left_without_losing_a_probe_is_probed_again_at_its_own_interval(earned):
    """Paper placement, batch 1, `mixed`: the local regime lost its probes (its interval backed off to 256
    rounds); the worker, left for the local regime on slow requests without losing a probe, must be probed
    again at its own interval when the requests turn fast, not after the 256 rounds the local regime's
    lost probes earned. The control (`earned`: the worker's own probes had backed off that far) waits."""
    p = RegimePolicy(dwell=4, probe_every=32, max_probe_every=1024, start=WORKER)
    run(p, {WORKER: 20.0, LOCAL: 15.0}, 400)                 # local probes lose and back off
    assert p.interval[(LOCAL, 0)] >= 128 and (WORKER, 0) not in p.interval
    for _ in range(40):                                      # slow requests: the worker measures 8
        run(p, {WORKER: 8.0, LOCAL: 15.0}, 1)
        if p.current == LOCAL:
            break
    assert p.current == LOCAL and p.probe_rounds_left() is None      # left for a faster regime: no probe
    if earned:
        p.interval[(WORKER, 0)] = 256
    seq = run(p, {WORKER: 24.0, LOCAL: 15.0}, 400)            # fast requests: the worker is 1.6x
    back = seq.index(WORKER)
    assert (back > 200) if earned else (back <= 32 + 2 * 4)
    assert seq[-40:] == [WORKER] * 40                         # its probe wins and it stays
    assert p.interval[(LOCAL, 0)] >= 128                      # the loser's backoff is kept


@pytest.mark.parametrize("batch, worker, unproven", [
    (4, 30.0, True),      # batch 4: measured 25% below the local regime
    (8, 30.0, True),
    (4, 39.0, True),      # slower by less than the prune margin: still not proven
    (4, 44.0, False),     # the control: measured faster at this batch size
    (1, 30.0, False),     # the control: batch 1 follows one request at a time, a loss there is not counted
    (2, 30.0, False),
])
def test_the_worker_must_win_from_batches_of_three_to_prefill_beside_the_target(batch, worker, unproven):
    """RegimePolicy.worker_unproven_at, which makes the step leave the worker idle in local stints (paper
    placement: its prefills beside the target's forwards cost those 5-8% at batch 8 on a 2-vCPU VM, and a local
    regime measured beside them lost to the worker at batch 8 where AR ran 1.2x SSD k=2)."""
    p = RegimePolicy(dwell=4, probe_every=32, start=WORKER)
    assert p.worker_unproven_at(batch) == (batch >= 3)            # nothing measured yet
    run(p, {WORKER: worker, LOCAL: 40.0}, 40, batch=batch)
    assert (p.rate[(WORKER, bucket(batch))], p.rate[(LOCAL, bucket(batch))]) == (worker, 40.0)
    assert p.worker_unproven_at(batch) == unproven
    # a larger batch where neither regime has run yet: not proven there, whatever it measured at this one
    assert p.worker_unproven_at(16)


def test_a_probe_stint_says_how_many_rounds_it_has_left():
    """The local chooser must not invest in a catch-up during a probe it will likely leave."""
    p = RegimePolicy(dwell=4, probe_every=1000, start=WORKER)
    run(p, {WORKER: 20.0, LOCAL: 10.0}, 4)
    assert p.probe_rounds_left() is None                  # the first stint is not a probe
    assert p.pick(1) == LOCAL                             # local is unmeasured: a probe
    assert p.probe_rounds_left() == 4
    p.observe(1, 10, 1.0)
    assert p.probe_rounds_left() == 3
    run(p, {WORKER: 20.0, LOCAL: 10.0}, 3)
    assert p.pick(1) == WORKER and p.probe_rounds_left() is None   # it lost: back, not a probe


def test_the_worker_s_next_visit_is_scheduled_far_off_once_it_lost_and_near_while_it_wins():
    """worker_visit_in (keep_in_step runs only where the worker may serve the running requests again):
    after the worker lost its probes its next visit is a backed-off interval away; where it measures
    faster, a local stint is a probe it returns from within the stint; unmeasured, a visit may come at
    any stint end (0). The control is the winning case: the same question, the opposite answer."""
    p = RegimePolicy(dwell=4, probe_every=32, max_probe_every=10**6, start=WORKER)
    assert p.worker_visit_in(1) == 0                       # it serves now
    run(p, {WORKER: 10.0, LOCAL: 20.0}, 300)               # the worker lost every probe
    assert p.current == LOCAL and p.worker_visit_in(1) > 64
    assert p.worker_visit_in(4) == 0                       # batch 4: not measured there, may come any time
    q = RegimePolicy(dwell=4, probe_every=32, max_probe_every=10**6, start=WORKER)
    run(q, {WORKER: 20.0, LOCAL: 10.0}, 300)               # the worker wins: local stints are probes
    for _ in range(10_000):                                # to the next probe of local (bounded: no hang)
        if q.pick(1) == LOCAL:
            break
        q.observe(1, 10, 0.5)
    assert q.current == LOCAL and q.worker_visit_in(1) <= 4
    q.disable()
    assert q.worker_visit_in(1) > 10**6                    # a lost worker never comes back


def test_leaving_an_unmeasured_regime_for_an_unmeasured_one_is_a_probe():
    """The first stint end at a new batch size, after a stint spent at another one: neither regime has an
    estimate here, the policy leaves the current one, and that first visit is a probe (so the local chooser
    does not start catching the in-process draft up on whole prompts it will likely leave)."""
    p = RegimePolicy(dwell=4, probe_every=1000, start=WORKER)
    run(p, {WORKER: 20.0, LOCAL: 10.0}, 4, batch=1)       # a stint at batch 1 only
    assert p.pick(4) == LOCAL                             # batch 4: the worker is unmeasured here too
    assert p.probe_rounds_left() == 4
    # the control: going to a regime measured faster at this bucket is not a probe
    q = RegimePolicy(dwell=4, probe_every=1000, start=WORKER)
    q.rate[(LOCAL, 2)] = 30.0
    run(q, {WORKER: 20.0, LOCAL: 10.0}, 4, batch=1)
    assert q.pick(4) == LOCAL and q.probe_rounds_left() is None


@pytest.mark.parametrize("min_rounds, revisited", [
    (None, True),   # default (dwell / 4 = 2 rounds): the one round is pooled, the worker stays unmeasured at 4
    (1, False),     # the control: that round alone became the worker's estimate at batch 4, 5 tok/s
])
def test_a_stints_last_round_at_a_new_batch_size_is_not_an_estimate_alone(min_rounds, revisited):
    """A stint's one round after the batch changed (the new prompts' hand-over in it) does not stand for the
    regime at that batch size: the worker, measured 30 tok/s there in fact, is visited there."""
    p = RegimePolicy(dwell=8, probe_every=1000, start=WORKER, min_rounds=min_rounds)
    for _ in range(7):
        p.pick(1)
        p.observe(1, 10, 0.5)                    # 20 tok/s at batch 1
    p.pick(4)
    p.observe(4, 10, 2.0)                        # a batch of 4 arrives: one round with its hand-over
    seq = run(p, {WORKER: 30.0, LOCAL: 20.0}, 24, batch=4)
    assert (WORKER in seq) == revisited
    if revisited:                                # the pooled round counts with the stint that measured it
        assert 5.0 < p.rate[(WORKER, 2)] < 30.0
    else:
        assert p.rate[(WORKER, 2)] == pytest.approx(5.0)


def test_batch_size_buckets_have_their_own_estimates():
    p = RegimePolicy(dwell=4, probe_every=32, start=WORKER)
    run(p, {WORKER: 10.0, LOCAL: 20.0}, 16, batch=1)
    seq = run(p, {WORKER: 30.0, LOCAL: 20.0}, 64, batch=8)     # a new bucket: measured afresh (by a probe,
    assert WORKER in seq[-8:] and p.rate[(WORKER, 3)] > p.rate[(LOCAL, 3)]   # the worker having lost at 1)


@pytest.mark.parametrize("worker_at_1, first_visit_at_8", [
    (30.0, 4),      # the control: the worker won at batch 1: its first visit at batch 8 ends the first stint
    (10.0, 40),     # it lost at batch 1: at batch 8 it waits for a probe interval (32 rounds) first
])
def test_a_regime_that_lost_at_a_smaller_batch_is_visited_later_at_a_larger_one(worker_at_1, first_visit_at_8):
    p = RegimePolicy(dwell=4, probe_every=32, start=LOCAL)
    p.rate.update({(WORKER, 0): worker_at_1, (LOCAL, 0): 20.0})     # as measured at batch 1
    seq = run(p, {WORKER: 5.0, LOCAL: 20.0}, 48, batch=8)
    assert seq.index(WORKER) == first_visit_at_8
    assert (p.deferred > 0) == (worker_at_1 < 20.0)


def run_predicted(policy: RegimePolicy, rates: dict[str, float], guesses: dict[str, float | None],
                  rounds: int, batch: int = 1) -> list[str]:
    out = []
    for _ in range(rounds):
        r = policy.pick(batch, guesses.get)
        out.append(r)
        policy.observe(batch, 10, 10 / rates[r])
    return out


@pytest.mark.parametrize("guess, visits, pruned", [
    (None, True, False),    # the control: no prediction, the local regime is measured and probed
    (17.0, True, True),     # predicted within the margin (10%) of the worker's measured 18: visited; it
                            # measured 10, so later predictions are scaled by 10 / 17 and pruned
    (12.0, False, True),    # predicted clearly slower: never visited (counted as pruned)
])
def test_a_regime_predicted_clearly_slower_is_not_visited(guess, visits, pruned):
    p = RegimePolicy(dwell=4, probe_every=32, start=WORKER)
    seq = run_predicted(p, {WORKER: 18.0, LOCAL: 10.0}, {LOCAL: guess, WORKER: 18.0}, 300)
    assert (LOCAL in seq) == visits
    assert (p.pruned > 0) == pruned


@pytest.mark.parametrize("calibrate", [True, False])
def test_a_regime_that_measured_below_its_prediction_is_predicted_lower_after(monkeypatch, calibrate):
    """The equal placement on an AVX-512 host: the first worker stint measured 8.4 tok/s where the worker
    rounds' fits predicted 13; later predictions of 16-19 were within the prune margin of the local
    regime's 21, so the worker was probed again (another stint at 0.4x). Scaled by how its stint
    measured against the prediction, the probes are pruned. The control (no calibration) probes."""
    import ssd.speculation.regime as regime_mod

    if not calibrate:
        monkeypatch.setattr(regime_mod, "CALIBRATION_RANGE", (1.0, 1.0))
    p = RegimePolicy(dwell=16, probe_every=128, start=WORKER)
    seq = run_predicted(p, {WORKER: 8.4, LOCAL: 21.0}, {WORKER: 13.3, LOCAL: 21.0}, 17)
    assert seq[:16] == [WORKER] * 16
    assert p.calibration[(WORKER, 0)] == pytest.approx(8.4 / 13.3 if calibrate else 1.0)
    seq += run_predicted(p, {WORKER: 8.4, LOCAL: 21.0}, {WORKER: 13.3, LOCAL: 21.0}, 583)
    p2 = run_predicted(p, {WORKER: 8.4, LOCAL: 21.0}, {WORKER: 19.4, LOCAL: 21.0}, 600)
    assert (WORKER in seq[16:] + p2) == (not calibrate)
    if calibrate:    # each skipped probe fades the calibration: a probe runs again within a few intervals
        assert p.calibration[(WORKER, 0)] > 8.4 / 13.3
        assert WORKER in run_predicted(p, {WORKER: 8.4, LOCAL: 21.0}, {WORKER: 19.4, LOCAL: 21.0}, 6000)


def test_a_regimes_calibration_holds_for_the_batch_size_it_was_measured_at():
    """Local visits that measured 0.6 of their prediction at batch 1 say nothing of batch 4: there the
    local regime (predicted 10% faster than the worker measures) is still visited."""
    p = RegimePolicy(dwell=4, probe_every=32, start=WORKER)
    run_predicted(p, {WORKER: 20.0, LOCAL: 12.0}, {WORKER: 20.0, LOCAL: 20.0}, 40)       # batch 1
    assert p.calibration[(LOCAL, 0)] == pytest.approx(0.6)
    seq = run_predicted(p, {WORKER: 20.0, LOCAL: 24.0}, {WORKER: 20.0, LOCAL: 22.0}, 200, batch=4)
    assert LOCAL in seq


def test_a_pruned_probe_backs_off_and_a_better_prediction_lets_it_run():
    p = RegimePolicy(dwell=4, probe_every=32, max_probe_every=10**6, start=WORKER)
    rates, guesses = {WORKER: 10.0, LOCAL: 20.0}, {WORKER: None}
    run_predicted(p, rates, guesses, 80)                       # both measured: local is faster
    assert p.current == LOCAL
    guesses[WORKER] = 5.0                                      # the model says the worker is far slower
    seq = run_predicted(p, rates, guesses, 300)
    assert WORKER not in seq and p.pruned >= 2 and p.interval[(WORKER, 0)] >= 128
    guesses[WORKER] = 19.0                                     # ... until it does not
    seq = run_predicted(p, rates, guesses, 2000)
    assert WORKER in seq


@pytest.mark.parametrize("guess, early", [
    (30.0, True),       # the model now predicts the local regime clearly faster: re-measured early
    (21.0, False),      # the control: within the margins (5% + 10%) of the worker's 20
    (None, False),      # the control: no model
])
def test_a_regime_predicted_clearly_faster_after_the_requests_changed_is_remeasured_early(guess, early):
    """Paper placement, batch 4, a chat set after a code set: the local regime was measured slower on
    the code set, its probes backed off, and the worker served all of the chat set's rounds at 0.84x AR.
    Where the model now predicts the local regime clearly faster, it is re-measured at the next stint end
    (at least `early_after` rounds after its last measurement), not a backed-off interval later."""
    p = RegimePolicy(dwell=4, probe_every=32, max_probe_every=512, start=WORKER)
    run_predicted(p, {WORKER: 20.0, LOCAL: 15.0}, {WORKER: 20.0}, 300)   # code: the worker wins, probes back off
    assert p.current == WORKER and p.interval[(LOCAL, 0)] >= 128 and p.early == 0
    seq = run_predicted(p, {WORKER: 20.0, LOCAL: 30.0}, {WORKER: 20.0, LOCAL: guess}, 40)   # chat
    assert (LOCAL in seq) == early and (p.early > 0) == early
    if early:
        assert seq[-1] == LOCAL          # measured faster: it stays


@pytest.mark.parametrize("restate", [True, False])
def test_the_other_regime_is_judged_by_its_calibrated_prediction_for_the_requests_now_running(
        monkeypatch, restate):
    """Paper placement, batch 1, MT-Bench then `mixed`: one worker stint measured 14.8 tok/s on slow
    requests, the local regime then measured 18-21 and kept every stint, though the worker rounds' fits
    predicted the worker 10-30% faster for the requests that followed (SSD k=2 ran 1.2x the local regime
    there). The worker's measured 15 is of other requests; its calibrated prediction for these (23 x 0.9
    = 20.7) and the local regime's (19 x its calibration, 1.08 after its first stint, 1.04 after its
    second) differ by more than the hysteresis by the second stint end: the worker serves from there
    on (it measures 22). The control, measured estimates only: local to the end (the early path needs
    15%)."""
    if not restate:
        monkeypatch.setattr(RegimePolicy, "_calibrated", lambda self, predict, regime, b: None)
    p = RegimePolicy(dwell=4, probe_every=1000, start=WORKER)
    seq = run_predicted(p, {WORKER: 15.0, LOCAL: 19.0}, {WORKER: 15.0 / 0.9, LOCAL: 17.6}, 12)
    assert seq == [WORKER] * 4 + [LOCAL] * 8
    assert p.calibration[(WORKER, 0)] == pytest.approx(0.9)
    seq = run_predicted(p, {WORKER: 22.0, LOCAL: 19.0}, {WORKER: 23.0, LOCAL: 19.0}, 40)
    if restate:
        assert set(seq[4:]) == {WORKER} and p.restated > 0      # from the second stint end on
    else:
        assert set(seq) == {LOCAL} and p.early == 0


def test_an_early_probe_that_loses_lowers_its_regimes_prediction_and_is_not_repeated_at_once():
    """An optimistic model: the local regime is predicted at 30 but measures 15. The early probe loses,
    the calibration scales the prediction down (30 x 0.5 = 15), and no early probe follows."""
    p = RegimePolicy(dwell=4, probe_every=32, max_probe_every=512, start=WORKER)
    run_predicted(p, {WORKER: 20.0, LOCAL: 15.0}, {WORKER: 20.0}, 300)
    seq = run_predicted(p, {WORKER: 20.0, LOCAL: 15.0}, {WORKER: 20.0, LOCAL: 30.0}, 200)
    assert p.early == 1 and seq.count(LOCAL) == 4


def run_stints(policy: RegimePolicy, rates: dict[str, list[float]], guesses: dict[str, float | None],
               rounds: int, batch: int, stints: dict[str, int]) -> list[str]:
    """As run_predicted, but each regime's stints measure the rates of its list in turn (the last one from
    then on); `stints` counts each regime's stints so far (shared across calls on one policy)."""
    out = []
    for _ in range(rounds):
        r = policy.pick(batch, guesses.get)
        if policy._stint == 0:
            stints[r] += 1
        out.append(r)
        rate = rates[r][min(stints[r], len(rates[r])) - 1]
        policy.observe(batch, 10, 10 / rate)
    return out


@pytest.mark.parametrize("first_local, batch, rechecked", [
    (25.0, 4, True),    # 0.77 of the prediction (32.3): re-measured at the first stint end 2 x dwell after it
    (25.0, 1, True),    # so at batch 1
    (30.0, 4, True),    # 0.93 of it, from 3 rows up: re-measured too (a stint of plain rounds costs about AR's)
    (30.0, 1, False),   # the control, 0.93 of it at batch 1: not before its probe interval (128 rounds)
])
def test_one_local_stint_far_below_its_prediction_is_measured_again_soon(first_local, batch, rechecked):
    """Paper placement, batch 4, twenty-second session's grid: the local regime's first stint there
    measured 25.0 tok/s against 32.3 predicted (later ones 35-41); as its rate and its calibration (0.77)
    it kept the worker (31-32) serving about 240 rounds while AR ran 1.2x SSD k=2. Re-measured, it measures
    38 and serves on. From 3 rows up one local stint is re-measured whatever it measured against the
    prediction (AVX2 host, twenty-eighth session: one at 0.91 of a prediction that ran 10-20% low kept the
    worker ~190 rounds at batch 4, SSD k=2 at 0.80-0.91 of AR)."""
    p, stints = RegimePolicy(dwell=16, probe_every=128, start=LOCAL), {LOCAL: 0, WORKER: 0}
    rates = {LOCAL: [first_local, 38.0], WORKER: [32.0]}
    seq = run_stints(p, rates, {LOCAL: 32.3, WORKER: 30.0}, 17, batch, stints)
    assert seq[:16] == [LOCAL] * 16 and seq[16] == WORKER
    assert p.calibration[(LOCAL, bucket(batch))] == pytest.approx(first_local / 32.3)
    seq = run_stints(p, rates, {LOCAL: 33.0, WORKER: 30.0}, 112, batch, stints)
    assert (LOCAL in seq) == rechecked and p.early == rechecked
    if rechecked:
        assert seq.index(LOCAL) == 47 and seq[-1] == LOCAL     # round 65; measured 38, it stays


def test_a_doubtful_local_stint_is_measured_again_once_and_not_where_even_its_prediction_loses():
    p = RegimePolicy(dwell=16, probe_every=128, max_probe_every=1024, start=LOCAL)
    rates = {LOCAL: [25.0], WORKER: [32.0]}                    # the local regime is slow: its re-measure too
    seq = run_stints(p, rates, {LOCAL: 32.3, WORKER: 30.0}, 128, 4, {LOCAL: 0, WORKER: 0})
    assert seq.count(LOCAL) == 32 and p.early == 1             # its first stint and one re-measure
    q = RegimePolicy(dwell=16, probe_every=128, start=LOCAL)
    # the prediction alone, uncalibrated, is clearly slower than the worker measures: no re-measure
    seq = run_stints(q, {LOCAL: [15.0], WORKER: [32.0]}, {LOCAL: 20.0, WORKER: 30.0}, 128, 4, {LOCAL: 0, WORKER: 0})
    assert seq.count(LOCAL) == 16 and q.early == 0
    # nor is the worker's first stint doubted (its visit pays costs the model does not see)
    w = RegimePolicy(dwell=16, probe_every=128, start=WORKER)
    seq = run_stints(w, {WORKER: [20.0, 32.0], LOCAL: [30.0]}, {LOCAL: 30.0, WORKER: 30.0}, 128, 4,
                     {LOCAL: 0, WORKER: 0})
    assert seq.count(WORKER) == 16 and w.early == 0


@pytest.mark.parametrize("batch, visited", [
    (4, True),      # from 3 rows up: the local regime's first visit is not skipped on the prediction
    (8, True),
    (1, False),     # the control: below that, the prediction outside the margin skips it
])
def test_the_local_regimes_first_visit_from_three_rows_up_is_not_pruned(batch, visited):
    """AVX2 host, paper placement, batch 4 after batch 1 (twenty-eighth session): the worker measured
    16.9-17.7 tok/s, the worker rounds' fits predicted the local regime at 14.5-15.0 (10-20% low: they
    price the target as it runs beside the worker's drafting), so its first visit was pruned and it never
    ran, while AR ran 1.1-1.25x SSD k=2 there. Visited, it measures 20 and stays; a later probe of the
    worker may still be skipped on its prediction."""
    p = RegimePolicy(dwell=16, probe_every=128, start=WORKER)
    seq = run_predicted(p, {WORKER: 17.5, LOCAL: 20.0}, {WORKER: 17.5, LOCAL: 15.0}, 200, batch=batch)
    assert (LOCAL in seq) == visited
    assert visited or p.pruned > 0
    if visited:
        assert seq[16:32] == [LOCAL] * 16 and seq[-1] == LOCAL and p.rate[(LOCAL, bucket(batch))] == 20.0


def test_a_first_visit_waits_for_a_prediction_it_may_then_skip():
    """With a model that cannot predict yet, the first visit of the other regime waits (at most
    probe_every rounds): a visit run before the model can predict it is the one pruning cannot save."""
    rates = {WORKER: 18.0, LOCAL: 10.0}
    control = RegimePolicy(dwell=4, probe_every=32, start=WORKER)
    assert run(control, rates, 8)[4] == LOCAL                  # the control, no model: visited at once
    p = RegimePolicy(dwell=4, probe_every=32, start=WORKER)
    guesses: dict[str, float | None] = {LOCAL: None}
    assert LOCAL not in run_predicted(p, rates, guesses, 24) and p.deferred > 0
    guesses[LOCAL] = 12.0                                      # the model can predict now: clearly slower
    assert LOCAL not in run_predicted(p, rates, guesses, 200) and p.pruned > 0
    # where the model of the other regime needs that regime's own rounds (local rounds take the worker's
    # cores back), waiting for it would never end: visited at once, as without a model
    q = RegimePolicy(dwell=4, probe_every=32, start=WORKER)
    q.await_prediction = False
    assert run_predicted(q, rates, {LOCAL: None}, 8)[4] == LOCAL and q.deferred == 0


def test_a_deferred_first_visit_pruned_when_due_backs_off_like_a_probe():
    p = RegimePolicy(dwell=4, probe_every=32, max_probe_every=10**6, start=LOCAL)
    p.rate.update({(WORKER, 0): 10.0, (LOCAL, 0): 20.0})        # the worker lost at batch 1
    seq = run_predicted(p, {WORKER: 5.0, LOCAL: 20.0}, {WORKER: 5.0}, 200, batch=8)
    assert WORKER not in seq
    assert 1 <= p.pruned <= 3        # due after 32 rounds, then 64, 128 (not at every stint end after the first)


@pytest.mark.parametrize("waits, first_visit", [
    (False, 4),     # the control: the worker's first visit ends the first (local) stint
    (True, 40),     # SSD rounds take the target's cores: it waits a probe interval (32 rounds) first
])
def test_where_the_worker_takes_the_targets_cores_its_first_visit_waits_at_every_bucket(waits, first_visit):
    p = RegimePolicy(dwell=4, probe_every=32, start=LOCAL, worker_waits=waits)
    seq = run(p, {WORKER: 30.0, LOCAL: 20.0}, 48)
    assert seq.index(WORKER) == first_visit and seq[-1] == WORKER        # once measured faster, it stays
    assert (p.deferred > 0) == waits
    q = RegimePolicy(dwell=4, probe_every=32, start=LOCAL, worker_waits=waits)
    run(q, {WORKER: 30.0, LOCAL: 20.0}, 2)
    seq = run(q, {WORKER: 30.0, LOCAL: 20.0}, 64, batch=8)             # a new bucket, none visited yet
    assert seq.index(WORKER) == (first_visit - 2 if waits else 2)


@pytest.mark.parametrize("bound, visited", [
    (None, True),       # the control: nothing predicts the worker, it is visited a probe interval in
    (25.0, True),       # the bound allows a win: visited
    (15.0, False),      # even all-hit rounds would be clearly slower (SpeculativeStep._worker_bound)
])
def test_where_the_worker_takes_the_targets_cores_a_bound_below_the_local_rate_skips_its_visit(bound, visited):
    p = RegimePolicy(dwell=4, probe_every=32, start=LOCAL, worker_waits=True)
    seq = run_predicted(p, {WORKER: 10.0, LOCAL: 20.0}, {WORKER: bound, LOCAL: 20.0}, 400)
    assert (WORKER in seq) == visited
    assert visited or p.pruned >= 2          # skipped when due, and again after a backed-off interval


def test_disable_is_local_for_good():
    p = RegimePolicy(dwell=1, start=WORKER)
    p.disable()
    assert set(run(p, {WORKER: 100.0, LOCAL: 1.0}, 20)) == {LOCAL}


# ---------------------------------------------------------------- the engine


@pytest.fixture(scope="module")
def ar_ref(tiny_pair):
    llm = LLM(str(tiny_pair[0]), dtype="float32", progress=False)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("apart", [False, True])
def test_switching_regimes_every_round_is_token_identical_to_ar(monkeypatch, tiny_pair, ar_ref, apart):
    """SSD rounds and local rounds alternate at random, in a batch that grows and shrinks (different
    max_tokens, a late arrival): the worker is handed sequences back many times and the local draft
    catches up after every SSD stint; every token equals AR's. Draft lengths are random per sequence
    and round in both regimes, so the worker serves shorter asks from longer pre-drafted chains, and
    longer ones by finishing shorter chains."""
    random_regime(monkeypatch)
    random_chooser(monkeypatch)
    target, draft = tiny_pair
    llm = LLM(str(target), draft=str(draft), mode="auto", auto_ssd=True, k=3, dtype="float32", progress=False,
              kv_cache_gb=0.05, worker_timeout_s=20)
    from ssd.speculation.step import SpeculativeStep

    step, dbm = llm.engine.step_impl, llm.engine.draft.block_manager
    step.worker_prefills_always = apart     # the worker also prefills prompts that arrive in local stints
    step.prefill_on_worker_cores = not apart    # ... or gets them at its first round (the prefill shares its core)
    real, leaks = SpeculativeStep.decode, []

    def decode(self, seqs):          # after every round the local draft holds exactly what it has fed
        real(self, seqs)
        leaks.extend(s.seq_id for s in seqs if dbm.num_tokens(s.seq_id) != s.spec_state.draft_cached)
    monkeypatch.setattr(SpeculativeStep, "decode", decode)
    real_pick, unsettled = SpeculativeStep._pick_proposer, []

    def pick(self, seqs):            # a local round on the worker's cores starts once the worker took its frees
        p = real_pick(self, seqs)
        if p is self.proposer and self.thread_split is not None:
            unsettled.extend(len(c._posted) for c in llm._clients if c._posted)
        return p
    monkeypatch.setattr(SpeculativeStep, "_pick_proposer", pick)
    from ssd.speculation.chooser import CostModel
    from ssd.speculation.worker.proposer import WorkerProposer
    retakes, contexts = [], []       # tokens priced as the worker's prefill when handed sequences back ...
    real_retake, real_propose = CostModel.observe_retake, WorkerProposer.propose
    monkeypatch.setattr(CostModel, "observe_retake", lambda self, t, k, w: (retakes.append(t), real_retake(self, t, k, w)))

    def propose(self, seqs, num_draft, verify_s=0.0):   # ... and the whole contexts it was handed
        contexts.append(sum(len(s) for s in seqs if s.spec_state.detached))
        return real_propose(self, seqs, num_draft, verify_s)
    monkeypatch.setattr(WorkerProposer, "propose", propose)
    assert step.worker is not None
    try:
        outs = llm.generate(PROMPTS, [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
                                      for n in (20, 7, 20, 12, 20)])
        assert [o.token_ids for o in outs] == [ref[:n] for ref, n in zip(ar_ref, (20, 7, 20, 12, 20))]
        assert llm.generate(PROMPTS[2], GREEDY)[0].token_ids == ar_ref[2]
        assert not leaks                  # SSD rounds give back the local draft's reserved slots
        assert not unsettled
        m = llm.engine.spec_metrics()
        assert m.worker_rounds > 5 and m.rounds - m.worker_rounds > 5 and m.regime_switches > 5
        assert m.hits + m.misses > 0 and m.worker_lost == 0
        d = m.to_dict()
        assert 0 < d["auto_worker_round_share"] < 1
        assert 0 < sum(d["auto_worker_rows_by_num_draft"]) < sum(d["auto_rows_by_num_draft"])   # SSD rows apart
        w = step.worker_chooser.cost.worker       # worker rounds taught their chooser hits and waits
        assert w.h_full.n + w.h_part.n > 4 and w.hit_s.n + w.per_token_s.n > 4
        # the policy is offered both regimes' predicted rates once both are measured
        made = [p for p in getattr(step.regime, "predictions", []) if None not in p]
        assert made and all(a > 0 and b > 0 for a, b in made)
        # the worker drops its sequences in local stints and is handed them back: the price is learned,
        # per token it prefills: not the prefix it still holds (the whole context, before 2026-12-06)
        assert w.retake_s.n > 2
        assert 0 < sum(retakes) < sum(contexts)
    finally:
        llm.close()


@pytest.mark.parametrize("apart, far, loses, unproven", [(False, False, False, False), (True, False, False, False),
                                                         (True, True, True, False), (True, True, False, False),
                                                         (True, False, False, True)])
def test_a_worker_on_cores_of_its_own_prefills_prompts_in_local_stints_too(monkeypatch, tiny_pair, ar_ref, apart,
                                                                           far, loses, unproven):
    """Where the worker's cores stay idle in local rounds, it prefills each new prompt while the target
    does, so a later SSD stint finds the prompt prefix-cached; where the target takes them back it
    does not (a control); nor where the worker's next visit is scheduled after the requests end and it
    is predicted slower even holding the contexts (the other control: its prefill would only slow the
    target's forwards next to it), nor, at a batch of 3 or more, where it has not measured faster than
    the local regime there (`unproven`), even with its visit due. Scheduled far but predicted to win
    when it holds them, it still prefills them (leaving them out would keep it losing)."""
    def local(self, batch_size, predict=None):
        self.rounds += 1
        self.current = LOCAL
        return LOCAL
    monkeypatch.setattr(RegimePolicy, "pick", local)
    if far:
        monkeypatch.setattr(RegimePolicy, "worker_visit_in", lambda self, batch_size: 10**6)
    from ssd.speculation.step import SpeculativeStep
    monkeypatch.setattr(SpeculativeStep, "_worker_loses_anyway", lambda self, seqs, rows: loses)
    monkeypatch.setattr(RegimePolicy, "worker_unproven_at", lambda self, batch_size: unproven)
    target, draft = tiny_pair
    llm = LLM(str(target), draft=str(draft), mode="auto", auto_ssd=True, k=3, dtype="float32", progress=False,
              kv_cache_gb=0.05, worker_timeout_s=20)
    step = llm.engine.step_impl
    step.regime.current, step.worker_prefills_always = LOCAL, apart
    step.prefill_on_worker_cores = not apart
    calls = []
    real = step.worker.prefill
    monkeypatch.setattr(step.worker, "prefill", lambda seqs: (calls.append(len(seqs)), real(seqs)))
    try:
        outs = llm.generate(PROMPTS[:3], GREEDY)
        assert [o.token_ids for o in outs] == ar_ref[:3]
        skipped = unproven or far and loses
        assert sum(calls) == (3 if apart and not skipped else 0)
        m = llm.engine.spec_metrics()
        assert m.worker_rounds == 0
        assert (m.worker_idle_prefills_skipped > 0) == skipped
    finally:
        llm.close()


@pytest.mark.parametrize("keep", [True, False])
def test_a_worker_on_cores_of_its_own_is_kept_in_step_in_local_stints(monkeypatch, tiny_pair, ar_ref, keep):
    """Where the worker's cores idle in local rounds, it prefills each whole block the local rounds commit,
    so the hand-over to it after a local stint of 40 plain rounds prefills at most a partial block and the
    last round's token per sequence; every token equals AR's. The control: without keep_in_step the
    hand-over prefills all the local rounds committed."""
    from ssd.speculation.chooser import CostModel
    from ssd.speculation.worker.proposer import WorkerProposer

    def stint(self, batch_size, predict=None):
        self.rounds += 1
        self.current = LOCAL if self.rounds <= 40 else WORKER
        return self.current
    monkeypatch.setattr(RegimePolicy, "pick", stint)
    # three requests: from 3 rows up the worker is kept in step only where it measured faster (the policy's
    # rates are not kept here: pick is replaced)
    monkeypatch.setattr(RegimePolicy, "worker_unproven_at", lambda self, batch_size: False)
    if not keep:
        monkeypatch.setattr(WorkerProposer, "keep_in_step", lambda self, seqs: 0)
    retakes = []
    real_retake = CostModel.observe_retake
    monkeypatch.setattr(CostModel, "observe_retake", lambda self, t, k, w: (retakes.append(t), real_retake(self, t, k, w)))
    target, draft = tiny_pair
    llm = LLM(str(target), draft=str(draft), mode="auto", auto_ssd=True, k=3, dtype="float32", progress=False,
              kv_cache_gb=0.05, worker_timeout_s=20)
    step = llm.engine.step_impl
    step.regime.current, step.worker_prefills_always, step.thread_split = LOCAL, True, None
    step.prefill_on_worker_cores = False
    step.chooser.plan = lambda seq_ids, caps, behind=None, remaining=None: [0] * len(seq_ids)   # 1 token a round
    try:
        n = 64
        outs = llm.generate(PROMPTS[:3], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        ref = LLM(str(target), dtype="float32", progress=False).generate(
            PROMPTS[:3], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        m = llm.engine.spec_metrics()
        assert m.worker_rounds > 0 and len(retakes) == 1    # one hand-over, after the local stint
        if keep:
            assert m.worker_kept_in_step >= 3 * 32 and retakes[0] <= 3 * 17
            assert step.worker.prefill_s_per_token() > 0     # the worker reported what its prefills took
        else:
            assert m.worker_kept_in_step == 0 and retakes[0] >= 3 * 40
    finally:
        llm.close()


@pytest.mark.parametrize("probe, eager", [(True, 3), (False, 0)])
def test_a_prompt_that_arrives_in_a_probe_of_the_worker_is_prefilled_into_the_local_draft(monkeypatch, tiny_pair,
                                                                                          ar_ref, probe, eager):
    """The regime after a probe of the worker is most likely the local one again: a prompt arriving in the
    probe is prefilled into the in-process draft too (where it would draft at all), so the local rounds
    after it need not catch the draft up on the whole prompt. The control: in a worker stint that is not
    a probe the in-process draft stays lazy."""
    from ssd.speculation.chooser import Chooser

    def stay(self, batch_size, predict=None):
        self.rounds += 1
        return self.current
    monkeypatch.setattr(RegimePolicy, "pick", stay)
    monkeypatch.setattr(Chooser, "would_speculate", lambda self, rows: True)
    monkeypatch.setattr(Chooser, "paid_prefills", lambda self, rows, feed, remaining: len(feed))
    target, draft = tiny_pair
    llm = LLM(str(target), draft=str(draft), mode="auto", auto_ssd=True, k=3, dtype="float32", progress=False,
              kv_cache_gb=0.05, worker_timeout_s=20)
    step = llm.engine.step_impl
    step.regime.current, step.regime._probing = WORKER, (0 if probe else None)
    try:
        outs = llm.generate(PROMPTS[:3], GREEDY)
        assert [o.token_ids for o in outs] == ar_ref[:3]
        m = llm.engine.spec_metrics()
        assert m.eager_draft_prefills == eager and m.worker_rounds > 0
    finally:
        llm.close()


def test_losing_the_worker_keeps_auto_going_locally(monkeypatch, tiny_pair, ar_ref):
    random_regime(monkeypatch)
    target, draft = tiny_pair
    llm = LLM(str(target), draft=str(draft), mode="auto", auto_ssd=True, k=3, dtype="float32", progress=False,
              kv_cache_gb=0.05, worker_timeout_s=10)
    try:
        stream = llm.stream(PROMPTS[0], GREEDY)
        got = next(stream).token_ids + next(stream).token_ids
        os.kill(llm._client.pid, signal.SIGKILL)
        t0 = time.monotonic()
        for chunk in stream:
            got += chunk.token_ids
        assert got == ar_ref[0] and time.monotonic() - t0 < 30
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_ref
        m = llm.engine.spec_metrics()
        assert m.worker_lost == 1 and llm.engine.mode == "auto" and llm.engine.degraded_from is None
        before = m.worker_rounds
        llm.generate(PROMPTS[:2], GREEDY)
        assert llm.engine.spec_metrics().worker_rounds == before      # no SSD rounds any more
    finally:
        llm.close()


def test_auto_ssd_is_only_for_auto(tiny_pair):
    with pytest.raises(ValueError, match="auto_ssd"):
        LLM(str(tiny_pair[0]), draft=str(tiny_pair[1]), mode="sd", auto_ssd=True, dtype="float32", progress=False)
