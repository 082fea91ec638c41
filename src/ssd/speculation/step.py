"""The speculative decoding step, shared by SD and SSD (docs/ARCHITECTURE.md 4):

    propose -> verify -> commit -> observe

The proposer (in-process draft for SD, the draft worker for SSD) drafts up to K tokens per
sequence; one target forward scores them; exact rejection sampling (verify.py) keeps the target's
distribution whatever was proposed; the proposer then learns what was accepted. A sequence with
nothing proposed (no room, last token, a batch over spec_max_batch) gets one target-sampled token.

If the proposer fails (the SSD worker died or stopped answering), the step logs nothing itself: it
calls `on_failure` (the engine falls back to local autoregressive decoding, logged) and finishes
the round without a draft.
"""
from __future__ import annotations

import logging
import time

import torch

from ssd.engine.ar import ARStep
from ssd.engine.model_runner import ModelRunner
from ssd.engine.sequence import Sequence
from ssd.engine.step import prefill_and_sample
from ssd.speculation.chooser import (CATCH_UP_PRIOR, Chooser, CostModel, all_hit_cost, best_plan, expected_tokens,
                                     local_cost, rate)
from ssd.speculation.proposer import Proposal, Proposer, ProposerFailed
from ssd.speculation.regime import LOCAL, WORKER, RegimePolicy
from ssd.speculation.stats import SpecCounters
from ssd.speculation.verifier import verify_and_commit
from ssd.speculation.worker_wait import WorkerWait
from ssd.speculation.worker.messages import Source

_MISS = (Source.NEURAL, Source.PARTIAL, Source.FAST)
log = logging.getLogger(__name__)


def retake_tokens(seqs: list[Sequence]) -> int:
    """Tokens the worker must prefill before it drafts for these sequences: of each one it does not hold,
    the context beyond the prefix it still has cached (`worker_held`: all of it for a prompt it never saw,
    the tokens committed since for one dropped by a local stint)."""
    return sum(len(s) - min(s.spec_state.worker_held, len(s)) for s in seqs if s.spec_state.detached)


def _draft_to_feed(s: Sequence) -> int:
    """Prompt tokens the in-process draft's prefill feeds (beyond its prefix-cache hit)."""
    return len(s) - (s.num_cached[1] if len(s.num_cached) > 1 else 0)


class SpeculativeStep:
    def __init__(self, target: ModelRunner, proposer: Proposer, k: int, counters: SpecCounters, tracer,
                 on_failure=None, chooser: Chooser | None = None):
        if k < 1:
            raise ValueError(f"k (speculation length) must be >= 1, got {k}")
        self.target, self.proposer, self.k = target, proposer, k
        self.counters, self.tracer = counters, tracer
        if proposer.name == "worker":
            counters.cover(k)
        self.on_failure = on_failure
        self.chooser = chooser          # mode "auto": picks each sequence's draft length every round
        self._ar = ARStep(target, tracer)
        self.max_spec_batch: int | None = None   # larger decode batches run rounds without a speculation
        self.last_verify_s = 0.0
        # auto with a draft worker (auto_ssd): the worker serves some stints of rounds, `proposer` (the
        # in-process draft) the others; the target's CPU threads follow (fewer while the worker drafts)
        self.worker: Proposer | None = None
        self.regime: RegimePolicy | None = None
        self.thread_split: tuple[int, int] | None = None      # (target threads: worker rounds, local rounds)
        self.worker_chooser: Chooser | None = None
        self.worker_prefills_always = False     # the worker's cores are idle in local rounds (not taken back)
        # the target's forward time on its SSD-round threads / on its local-round threads (thread_scaling.py;
        # set at start where there is a thread split)
        self.thread_slowdown: float | None = None
        # the target's prefill runs on the local workers' cores too (SSD's CPU default, the equal
        # placement): workers are handed new prompts at their first round, not during the prefill
        self.prefill_on_worker_cores = False
        # auto: the in-process draft's prefill, seconds per token fed (the least seen at an eager prefill;
        # prices the worker's prefill of the contexts in the bound on a first visit, see _worker_bound)
        self.draft_prefill_per_token: float | None = None
        self.batch_rows = lambda: 0     # the engine's count of unfinished requests (a new prefill joins them)

    def add_worker(self, worker: Proposer, regime: RegimePolicy, thread_split: tuple[int, int] | None) -> None:
        self.worker, self.regime, self.thread_split = worker, regime, thread_split
        self.counters.cover(self.k)
        if self.chooser is not None:
            # K per sequence in worker rounds too: the worker drafts while the target verifies, so a
            # round costs its verify rows plus the wait on a cache miss, priced by the measured hit
            # rates and miss wait (worker_wait.py). A longer K finds the chains pre-drafted at the last
            # length too short: it must pay that once over the rounds it serves (Chooser._rate_after_growing),
            # and 1% more; a shorter one is served from them: 3% down (damping). At least one token per
            # sequence: a worker with nothing out has nothing to pre-draft for
            self.worker_chooser = Chooser(self.k, hysteresis=0.01, hysteresis_down=0.03, probe_every=10**9,
                                          cost=CostModel(worker=WorkerWait()),
                                          shares_acceptance=self.chooser, plain_probe_every=0, floor=1)

    def num_draft(self, s: Sequence) -> int:
        """Draft tokens for this sequence this round: K, capped by the request (speculate, max_draft) and
        by what it may still produce (the bonus token is always the target's)."""
        p = s.params
        cap = 0 if not p.speculate else self.k if p.max_draft is None else min(self.k, p.max_draft)
        return max(0, min(cap, s.remaining_tokens() - 1))

    def _failed(self, error: ProposerFailed) -> None:
        if self.on_failure is None:
            raise error
        self.on_failure(error)

    def prefill(self, seqs: list[Sequence]) -> None:
        live = self.worker is not None and self.regime.enabled
        worker_now = live and self.regime.current == WORKER
        # the worker prefills the prompts on its own cores while the target does; in a local stint too
        # when its cores are not the target's then (it would otherwise prefill the whole context on its
        # first SSD round after, with the target waiting; later hand-overs find the prompt prefix-cached).
        # Not while the target's prefill uses the worker's cores: a prefill split over threads waits for
        # the one sharing a core with the worker (TTFT 1.7x AR's at batch 1 on 2 cores); the worker is
        # handed the prompt at its first round instead (as after a local stint, and priced as such)
        # In a local stint, only while the worker may serve these requests before they end (_worker_back_soon):
        # its prefill runs next to the target's forwards, and a hand-over that does come prefills the whole
        # context instead (priced as such, retake_tokens)
        later = self.prefill_on_worker_cores
        idle_prefill = live and not worker_now and self.worker_prefills_always and not later
        back = idle_prefill and self._worker_back_soon(seqs, max(self.batch_rows(), len(seqs)))
        self.counters.worker_idle_prefills_skipped += 1 if idle_prefill and not back else 0
        attach = (worker_now or back) and not later
        handed_later = later and self.proposer.name == "worker"
        try:
            if handed_later:
                pass             # SSD: detached below, so the worker takes them at its first round
            elif getattr(self.proposer, "lazy", False):
                # auto: prefill the in-process draft now (as SD does) when its rounds are the current
                # regime, or will most likely be at the end of a probe of the worker, and would draft for
                # a batch this size; a lazy draft would feed the whole prompt in its first rounds, which
                # neither a short request nor a short probe of the local regime repays (equal placement:
                # a prompt that arrived in a worker probe then ran 100% plain rounds after it, 0.56x SD)
                # (all of them, or the one with the least to feed where only the chooser's stale probe wants one)
                back_soon = worker_now and self.regime.probe_rounds_left() is not None
                # the prefill gate (Chooser.paid_prefills) only where it was measured to help: the worker on
                # cores of its own, batches of 3 rows up. In the equal placement at batch 1 it left drafts
                # lazy that SD's prefill repaid (auto 0.85-0.89x SD k=2 decode, 82-92% plain rounds)
                rows = max(self.batch_rows(), len(seqs))
                gate = self.worker_prefills_always and rows >= 3
                n = self.chooser.eager_prefills(rows, len(seqs), [_draft_to_feed(s) for s in seqs] if gate else None,
                                                [s.remaining_tokens() for s in seqs] if gate else None) \
                    if (not worker_now or back_soon) and self.chooser is not None else 0
                order = sorted(seqs, key=_draft_to_feed) if n < len(seqs) else seqs
                eager, lazy = order[:n], order[n:]
                self.counters.eager_draft_prefills += len(eager)
                if lazy:
                    self.proposer.prefill(lazy, eager=False)
                if eager:
                    t0 = time.perf_counter()
                    self.proposer.prefill(eager, eager=True)
                    self._observe_draft_prefill(eager, time.perf_counter() - t0)
            else:
                self.proposer.prefill(seqs)
        except ProposerFailed as e:
            self._failed(e)
        if attach:               # as in SSD: the worker prefills on its own cores while the target does
            try:
                self.worker.prefill(seqs)
            except ProposerFailed as e:
                self._worker_lost(e)
                attach = False
        if handed_later or self.worker is not None and not attach:
            for s in seqs:       # the worker takes a sequence (with its whole context) when it first drafts for it
                s.spec_state.detached, s.spec_state.worker_held = True, 0
        with self.tracer.span("target", "prefill"):
            prefill_and_sample(self.target, seqs)
        if not handed_later:
            self.proposer.after_prefill(seqs)
        if attach:
            self.worker.after_prefill(seqs)

    def _observe_draft_prefill(self, seqs: list[Sequence], seconds: float) -> None:
        fed = sum(_draft_to_feed(s) for s in seqs)
        if fed > 0 and seconds > 0:
            per = seconds / fed
            old = self.draft_prefill_per_token
            self.draft_prefill_per_token = per if old is None else min(old, per)

    def _pick_proposer(self, seqs: list[Sequence]) -> Proposer:
        """auto_ssd: the regime of this round, with the target's threads to match."""
        if self.regime is None:
            return self.proposer
        before, pruned, deferred, early = self.regime.switches, self.regime.pruned, self.regime.deferred, self.regime.early
        restated = self.regime.restated
        predict = (lambda regime: self.predicted_rate(seqs, regime)) if self.worker_chooser is not None else None
        # a first visit waits for a prediction only where the worker rounds' fits predict both regimes;
        # where local rounds take the worker's cores back, the local regime needs rounds of its own
        self.regime.await_prediction = self.worker_prefills_always
        use_worker = self.regime.pick(len(seqs), predict) == WORKER
        self.counters.regime_switches += self.regime.switches - before
        self.counters.regime_probes_pruned += self.regime.pruned - pruned
        self.counters.regime_visits_deferred += self.regime.deferred - deferred
        self.counters.regime_early_probes += self.regime.early - early
        self.counters.regime_restated += self.regime.restated - restated
        if self.thread_split is not None:
            n = self.thread_split[0 if use_worker else 1]
            if torch.get_num_threads() != n:
                torch.set_num_threads(n)
        if use_worker:
            return self.worker
        if not self.regime.enabled:
            return self.proposer
        try:
            self.worker.skip(seqs)          # it drops them (prefix-cached) and is handed them back later
            if self.thread_split is not None:
                self.worker.settle()        # its cores are the target's now: it has stopped drafting first
            elif self.worker_prefills_always:
                if self._worker_back_soon(seqs, len(seqs)):
                    # its cores would idle: it prefills the committed blocks as they complete (keep_in_step)
                    self.counters.worker_kept_in_step += self.worker.keep_in_step(seqs)
                else:
                    self.counters.worker_idle_prefills_skipped += 1
        except ProposerFailed as e:
            self._worker_lost(e)
        return self.proposer

    def _worker_back_soon(self, seqs: list[Sequence], rows: int) -> bool:
        """Whether the worker may serve these sequences (in a batch of `rows`) again before they end (its next
        visit as the policy schedules it, in rounds, against the tokens they have left): only then is keeping
        it in step, or handing it new prompts in a local stint, worth its prefills. They are not free: they
        run on the worker's core while the target decodes on the other, and on a 2-vCPU VM they slowed the
        target's plain forwards by about 5-8% at batch 8 in the paper placement, where the worker, measured
        slower there, was not visited again (1,904 tokens prefilled for nothing; auto / AR 0.92 with them,
        1.00 without, on `mixed`). From batches of 3 requests up they run only where the worker measured
        faster than the local regime at this batch size (RegimePolicy.worker_unproven_at): gated on a measured
        loss, or on the schedule, the local stints that measured the worker's rival ran beside them and
        measured slow (paper grids, batch 4 and 8, eighteenth and nineteenth sessions: auto / AR 0.83-0.93
        where the gate hardly fired). Below that, they are left out only where the worker loses anyway:
        its visit is not scheduled before these requests end and it is predicted slower even holding the
        contexts (_worker_loses_anyway); the schedule alone, at batch 1, had made one noisy loss permanent
        (the hand-overs then prefill whole contexts)."""
        if self.regime.worker_unproven_at(rows):
            return False
        left = max((s.remaining_tokens() for s in seqs), default=0)
        return self.regime.worker_visit_in(rows) < left or not self._worker_loses_anyway(seqs, rows)

    def _worker_loses_anyway(self, seqs: list[Sequence], rows: int) -> bool:
        """Whether the worker regime, even holding all of these contexts (nothing to prefill at a hand-over),
        is predicted clearly slower (by the prune margin) than the local regime is predicted for them: only
        then are its idle-time prefills left out. Both are the model's steady-state predictions, neither
        calibrated nor measured: a worker stint's measured rate, and its calibration, include the hand-over
        prefills that leaving these out causes. Paper placement, batch 1 (seventeenth session) with the
        schedule alone: after one slow worker stint the worker measured 17.1 against the local 19.9, new
        prompts were no longer sent to it, each one's whole prefill then priced its visits at 11-15 tok/s
        against 17-20 local, and auto ran 41-58% of its MT-Bench and `mixed` rounds local (0.93 and 0.88 of
        SSD k=2, from 1.00 and 0.96); gated on the calibrated prediction against the measured local rate
        it still ran `mixed` all local (0.83)."""
        if self.worker_chooser is None:
            return False
        held = self.predicted_rate(seqs, WORKER, retake=False)
        local = self.predicted_rate(seqs, LOCAL)
        if local is None or held is None:
            return False
        return held * (1 + self.regime.prune) < local

    def predicted_rate(self, seqs: list[Sequence], regime: str, retake: bool = True) -> float | None:
        """auto_ssd: tokens/s of the best plan for `seqs` in a visit of that regime, or None while the
        rounds it is fitted from have not measured enough. A visit is a stint of `dwell` rounds; its
        switching cost is spread over that stint only (as in a probe): the in-process draft's catch-up on
        what it missed, or the worker's prefill of what it does not hold of the contexts (`retake_tokens`:
        prompts that arrived in local stints where the target had its cores, the tokens committed since
        it dropped a sequence in a local stint); `retake=False` leaves the worker's share of that out.

        The worker regime is predicted from the worker rounds' fits (the target's line at the threads it
        has in SSD rounds, the cache hits and the miss wait). The local regime, where the worker is on
        cores of its own (the target has the same threads in both regimes), from the same fits with the
        worker's draft step, which the in-process draft also takes on one core; where local rounds take
        the worker's cores back, from the local rounds' own fits (the target on more threads)."""
        acc = self.worker_chooser.acceptance([s.seq_id for s in seqs])
        caps = [self.num_draft(s) for s in seqs]
        dwell = self.regime.dwell
        remaining = [min(s.remaining_tokens(), dwell) for s in seqs]
        cost = self.worker_chooser.cost
        wait = cost.worker
        if regime == WORKER:
            if cost.unit is None or not wait.measured():
                return self._worker_bound(seqs, acc, caps, retake)
            plan = best_plan(acc, caps, cost, floor=1)
            tokens = sum(expected_tokens(a, k) for a, k in zip(acc, plan))
            prefill = wait.retake_s.value * retake_tokens(seqs) if retake else 0.0
            return tokens / (cost.time_s(plan, 0.0, acc) + prefill / dwell) / cost.unit
        behind = self.proposer.behind(seqs)
        local = self.chooser.cost
        if self.worker_prefills_always:
            # the in-process draft's step is priced as the worker's miss wait per token: that needs misses
            if cost.unit is None or wait.per_token_s.n < 5:
                return None
            # a lazy draft that sat out the worker's rounds first catches up (its whole prompt, if it was
            # never prefilled), priced as the local rounds fitted it (their prior until they measure it), or
            # at the worker's measured prefill per token (prompts it took at arrival, hand-overs) where that
            # is dearer: the same draft's prefill on one core's threads (paper placement), measured before
            # any local stint has run. At the prior, 0.02 target forwards per token, a probe of the local
            # regime at batch 1 was predicted at 21.4 tok/s and measured 15.3, its draft catching up on the
            # whole context; the worker's prefills measured 0.060 per token. (A worker on other hardware may
            # prefill faster than the local draft: the dearer price holds.)
            per_token = local.draft_coefficients()[2] * local.unit / cost.unit if local.unit else CATCH_UP_PRIOR
            prefill = self.worker.prefill_s_per_token()
            if prefill is not None:
                per_token = max(per_token, prefill / cost.unit)
            # the worker rounds' line is exact where they ran (at least two rows per sequence), not below
            cost = local_cost(cost, wait.per_token_s.value, max(per_token, 0.0), at=2 * len(seqs))
        elif local.unit is None:
            return None
        else:
            cost = local
        plan = best_plan(acc, caps, cost, behind, remaining)
        return rate(plan, acc, cost, behind, remaining) / cost.unit

    def _worker_bound(self, seqs: list[Sequence], acc: list[float], caps: list[int],
                      with_prefill: bool = True) -> float | None:
        """Before the worker has run enough rounds to be predicted, where SSD rounds take cores from the
        target (a thread split, with `thread_slowdown` measured at start): an upper bound on its rate,
        every round a cache hit on the slower target (chooser.all_hit_cost), plus what a visit cannot
        avoid: the worker's prefill of the contexts it does not hold, spread over the stint (as in
        predicted_rate). That prefill is priced at the in-process draft's fastest prefill per token
        (on the local regime's threads) slowed by `thread_slowdown`: the worker has the fewer threads,
        and a prefill, bound by compute, slows at least as much as the target's decode forwards, by
        which the slowdown is measured. A visit is then skipped where even that is clearly slower than
        the local regime (low acceptance, a large batch, long contexts to hand over): such a first
        visit ran at about 0.5x the local regime in the equal placement on a 2-core host; at batch 1
        on HumanEval (acceptance 0.89: all-hit rounds alone would beat SD k=2 by about 17%) the one
        visit the bound without the prefill allowed cost two requests a third of their rate."""
        local = self.chooser.cost
        if self.thread_split is None or self.thread_slowdown is None or local.unit is None:
            return None
        bound = all_hit_cost(local, self.thread_slowdown)
        plan = best_plan(acc, caps, bound, floor=1)
        tokens = sum(expected_tokens(a, k) for a, k in zip(acc, plan))
        retake = 0.0
        if self.draft_prefill_per_token is not None and with_prefill:
            context = retake_tokens(seqs)
            retake = self.draft_prefill_per_token * self.thread_slowdown * context / local.unit
        return tokens / (bound.time_s(plan, 0.0, acc) + retake / self.regime.dwell) / bound.unit

    def _worker_lost(self, error: ProposerFailed) -> None:
        """auto_ssd: the worker died or stopped answering; auto goes on with the in-process draft."""
        log.error("auto: the draft worker failed (%s); going on with the in-process draft (exact; no SSD rounds "
                  "from now on)", error)
        self.counters.worker_lost += 1
        self.regime.disable()
        if self.thread_split is not None:
            torch.set_num_threads(self.thread_split[1])

    def decode(self, seqs: list[Sequence]) -> None:
        proposer = self._pick_proposer(seqs)
        local = proposer is self.proposer
        num_draft = [self.num_draft(s) for s in seqs]
        behind = proposer.behind(seqs)
        chooser = self.chooser if local else self.worker_chooser
        if local and chooser is not None and self.worker_prefills_always and self.regime is not None and \
                self.regime.enabled:
            self._floor_catch_up()
        if chooser is not None:
            caps, remaining = num_draft, [s.remaining_tokens() for s in seqs]
            left = self.regime.probe_rounds_left() if self.regime is not None and local else None
            if left is not None:     # a probe of the local regime: a catch-up must pay off within it
                remaining = [min(r, left) for r in remaining]
            probes = chooser.probes, chooser.probes_skipped, chooser.explorations
            num_draft = chooser.plan([s.seq_id for s in seqs], caps, behind, remaining)
            self.counters.probes += chooser.probes - probes[0]
            self.counters.probes_skipped += chooser.probes_skipped - probes[1]
            self.counters.explorations += chooser.explorations - probes[2]
            if local and not any(num_draft):
                return self._plain_round(seqs)
        # the worker first prefills the contexts it does not hold
        retaken = retake_tokens(seqs) if not local else 0
        t0 = time.perf_counter()
        proposal = None
        try:
            if self.max_spec_batch is not None and len(seqs) > self.max_spec_batch or not any(num_draft):
                proposer.skip(seqs)
            else:
                proposal = proposer.propose(seqs, num_draft, self.last_verify_s)
        except ProposerFailed as e:
            if proposer is self.worker:
                self._worker_lost(e)
            else:
                self._failed(e)
        if proposal is None:
            proposal = Proposal([[] for _ in seqs], [None] * len(seqs))
        t1 = time.perf_counter()
        if proposer.name == "worker":
            self.tracer.add("target", "wait", t0, t1)
        for name, start, end in proposal.spans:
            self.tracer.add("draft", name, start, end)
        lens = [len(s) for s in seqs]
        before = [len(s.output_token_ids) for s in seqs]
        with self.tracer.span("target", "verify"):
            accepted = verify_and_commit(self.target, seqs, proposal.tokens, proposal.probs)
        t2 = time.perf_counter()
        self.last_verify_s = t2 - t1
        self._count(seqs, proposal, before, t1 - t0, t2 - t1)
        if not local and chooser is not None and proposal.sources is not None:
            self._observe_wait(seqs, proposal, t1 - t0, retaken)
        committed = sum(len(s.output_token_ids) - b0 for s, b0 in zip(seqs, before))
        if chooser is not None:
            sent = [len(d) for d in proposal.tokens]
            self.counters.record_choice(sent, chooser.predicted_tokens, chooser.predicted_s, committed, t2 - t0,
                                        worker=not local)
            caught_up = sum(t for t, k in zip(behind, sent) if k > 0)
            chooser.observe([s.seq_id for s in seqs], sent, accepted, t1 - t0, t2 - t1, caught_up)
        proposer.observe(seqs, lens, accepted, proposal)
        if self.regime is not None:
            if not local:
                self.counters.worker_rounds += 1
                empty = Proposal([[] for _ in seqs], [None] * len(seqs))
                self.proposer.observe(seqs, lens, [0] * len(seqs), empty)   # the local draft sat out
            self.regime.observe(len(seqs), committed, t2 - t0)

    def _floor_catch_up(self) -> None:
        """Worker apart: the local chooser prices its draft's catch-up at least at the worker's measured
        prefill per token, as the local regime's prediction does (predicted_rate). With its own price at
        the 0.02 prior, a local probe at batch 1 in the paper placement, predicted at 20.6 tok/s as plain
        rounds (the catch-up too dear at the worker's 0.06-0.075), drafted instead, caught the lazy draft
        up on the whole context and measured 13.9."""
        prefill = self.worker.prefill_s_per_token()
        local = self.chooser.cost
        if prefill is not None and local.unit:
            local.catch_up_floor = prefill / local.unit

    def _observe_wait(self, seqs: list[Sequence], proposal: Proposal, wait_s: float, retaken: int) -> None:
        """auto_ssd: teach the worker rounds' cost model the cache hits and the wait of this round (before
        the proposer's observe: spec_state still describes the previous round); `retaken`: tokens of
        context the worker prefilled first (their wait teaches the price of handing sequences back)."""
        cost = self.worker_chooser.cost
        grown = False       # an ask longer than the last one: its chains were pre-drafted too short
        for s, src, d in zip(seqs, proposal.sources, proposal.tokens):
            st = s.spec_state
            grown |= bool(st.num_draft) and len(d) > st.num_draft
            if st.num_draft and len(d) <= st.num_draft and d and (src == Source.CACHE or src in _MISS):
                cost.worker.observe_lookup(st.accepted == st.num_draft, src == Source.CACHE)
        k = max((len(d) for d in proposal.tokens), default=0)
        if retaken:
            cost.observe_retake(retaken, k, wait_s)
        elif not grown:
            hit = all(src == Source.CACHE for src, d in zip(proposal.sources, proposal.tokens) if d)
            cost.observe_wait(hit, k, wait_s)

    def _plain_round(self, seqs: list[Sequence]) -> None:
        """auto chose no draft for anyone: an AR step (the draft sits out and catches up later)."""
        self.proposer.skip(seqs)
        lens = [len(s) for s in seqs]
        before = [len(s.output_token_ids) for s in seqs]
        t0 = time.perf_counter()
        self._ar.decode(seqs)
        t1 = time.perf_counter()
        self.proposer.observe(seqs, lens, [0] * len(seqs), Proposal([[] for _ in seqs], [None] * len(seqs)))
        self.counters.rounds += 1
        self.counters.verify_s += t1 - t0
        self.counters.record_choice([0] * len(seqs), self.chooser.predicted_tokens, self.chooser.predicted_s,
                                    sum(len(s.output_token_ids) - b0 for s, b0 in zip(seqs, before)), t1 - t0)
        self.chooser.observe([s.seq_id for s in seqs], [0] * len(seqs), [0] * len(seqs), 0.0, t1 - t0)
        if self.regime is not None:
            self.regime.observe(len(seqs), sum(len(s.output_token_ids) - b0 for s, b0 in zip(seqs, before)), t1 - t0)

    def _count(self, seqs: list[Sequence], proposal: Proposal, before: list[int], wait_s: float,
               verify_s: float) -> None:
        c = self.counters
        c.rounds += 1
        c.wait_s += wait_s
        c.verify_s += verify_s
        if proposal.worker_busy_s is not None:
            c.worker_busy_s, c.chains_drafted = proposal.worker_busy_s, proposal.chains_drafted
        if proposal.sources is None:
            return
        for s, src, b0, d in zip(seqs, proposal.sources, before, proposal.tokens):
            c.fast_backups += src == Source.FAST
            c.partial_hits += src == Source.PARTIAL
            c.no_room += src == Source.NO_ROOM
            # a lookup needs a speculation last round (pre-drafted after) and one asked for now
            st = s.spec_state
            if st.num_draft and d and (src == Source.CACHE or src in _MISS):
                c.record_lookup(st.accepted, src == Source.CACHE, len(s.output_token_ids) - b0)

    def release(self, seq: Sequence) -> None:
        for chooser in (self.chooser, self.worker_chooser):
            if chooser is not None:
                chooser.forget(seq.seq_id)
        try:
            self.proposer.release(seq)
        except ProposerFailed as e:
            self._failed(e)
        if self.worker is not None and self.regime.enabled and not seq.spec_state.detached:
            try:
                self.worker.release(seq)
            except ProposerFailed as e:
                self._worker_lost(e)
