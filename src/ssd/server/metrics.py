"""Prometheus metrics of one server (its own registry: no process-global state).

Request/latency/token counters are updated by the engine thread as steps commit tokens; gauges
(running, waiting, KV blocks) are refreshed after every engine step and command.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from ssd.engine.sequence import SpecStats
from ssd.speculation.chooser import FAR_PROBE_SHARE

STATUSES = ("success", "rejected", "aborted", "error")

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0,
                    2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
_ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
                0.3, 0.5, 1.0, 2.5)


class ServerMetrics:
    def __init__(self, mode: str, model: str, k: int | None, registry: CollectorRegistry | None = None):
        self.registry = r = registry or CollectorRegistry()
        self.mode = mode
        info = Gauge("ssd_engine_info", "Constant 1, labelled with the serving configuration",
                     ["model", "mode", "k"], registry=r)
        info.labels(model=model, mode=mode, k=str(k) if mode != "ar" else "").set(1)

        self.requests = Counter("ssd_requests", "Generation API requests by final status "
                                "(success, rejected = 4xx, aborted = client went away, error = 5xx)",
                                ["status"], registry=r)
        for s in STATUSES:
            self.requests.labels(status=s)
        self.prompt_tokens = Counter("ssd_prompt_tokens", "Prompt tokens of admitted engine requests", registry=r)
        self.generation_tokens = Counter("ssd_generation_tokens", "Generated (committed) tokens", registry=r)
        self.finished = Counter("ssd_engine_requests_finished", "Engine requests (one per choice) by finish "
                                "reason", ["reason"], registry=r)
        for reason in ("stop", "length", "abort"):
            self.finished.labels(reason=reason)
        self.ttft = Histogram("ssd_time_to_first_token_seconds", "Time from arrival to the first generated token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("ssd_inter_token_latency_seconds", "Time between generated tokens of a request (a "
                             "round committing m tokens after t seconds counts m samples of t/m)",
                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e = Histogram("ssd_request_latency_seconds", "Time from arrival to the last token of an engine "
                             "request", buckets=_LATENCY_BUCKETS, registry=r)
        self.running = Gauge("ssd_requests_running", "Engine requests being decoded", registry=r)
        self.waiting = Gauge("ssd_requests_waiting", "Engine requests waiting for KV blocks or a batch slot",
                             registry=r)
        self.preemptions = Counter("ssd_preemptions", "Requests preempted (freed and recomputed later) because "
                                   "the KV cache was full", registry=r)
        self.kv_used = Gauge("ssd_kv_blocks_used", "KV cache blocks held by requests", ["model"], registry=r)
        self.kv_free = Gauge("ssd_kv_blocks_free", "KV cache blocks free (incl. reusable prefix-cache blocks)",
                             ["model"], registry=r)
        self.kv_total = Gauge("ssd_kv_blocks_total", "KV cache blocks in the pool", ["model"], registry=r)

        # Speculation (SD and SSD). In AR mode these stay at 0.
        self.drafts = Counter("ssd_spec_drafts", "Verification rounds that checked at least one draft token",
                              registry=r)
        self.draft_tokens = Counter("ssd_spec_draft_tokens", "Draft tokens proposed", registry=r)
        self.accepted_tokens = Counter("ssd_spec_accepted_tokens", "Draft tokens accepted by the target",
                                       registry=r)
        self.rounds_by_num_draft = Counter("ssd_spec_rounds", "Decode rounds by draft tokens proposed for the "
                                           "request (0: a plain target step: AR mode, speculate=false, "
                                           "spec_max_batch, last token)", ["num_draft"], registry=r)
        self.draft_by_pos = Counter("ssd_spec_draft_tokens_by_position", "Draft tokens proposed at position "
                                    "(0-based) within a round", ["position"], registry=r)
        self.accepted_by_pos = Counter("ssd_spec_accepted_tokens_by_position", "Draft tokens accepted at "
                                       "position (0-based) within a round", ["position"], registry=r)
        # SSD (speculation cache + draft worker): fed from the engine's speculation snapshots by `ssd_state`; they stay
        # at 0 in AR and SD mode.
        self.cache_hits = Counter("ssd_spec_cache_hits", "SSD speculation-cache hits by accepted length k",
                                  ["k"], registry=r)
        self.cache_misses = Counter("ssd_spec_cache_misses", "SSD speculation-cache misses by accepted length k",
                                    ["k"], registry=r)
        self.worker_no_room = Counter("ssd_spec_worker_no_room", "SSD: rounds in which the draft worker had no KV "
                                      "room for a sequence (it decoded without a draft; the worker takes it back "
                                      "later)", registry=r)
        self.draft_worker_up = Gauge("ssd_draft_worker_up", "1 while the SSD draft worker answers, else 0 "
                                     "(0 after a worker failure sent the engine back to AR; always 0 outside "
                                     "SSD mode)", registry=r)
        # auto: the chooser's decisions and its cost model's accuracy (fed by `auto_state`)
        self.auto_plain_rounds = Counter("ssd_auto_plain_rounds", "auto: decode rounds the chooser ran without "
                                         "any draft token (plain target steps)", registry=r)
        self.auto_probes = Counter("ssd_auto_probes", "auto: one-token drafts for a request the chooser had "
                                   "stopped drafting for, to re-measure its acceptance", registry=r)
        self.auto_probes_skipped = Counter("ssd_auto_probes_skipped", "auto: such probes not run, because no "
                                           "acceptance would have made drafting for that request pay, or its draft's catch-up "
                                           f"would cost more than {FAR_PROBE_SHARE:.0%} of the request's remaining "
                                           "rounds", registry=r)
        self.auto_explorations = Counter("ssd_auto_explorations", "auto: sequence-rounds given one draft token "
                                         "because drafting would pay at an acceptance one standard deviation above "
                                         "the request's estimate, its batch mates at theirs (a plain round measures "
                                         "nothing)", registry=r)
        self.auto_rows = Counter("ssd_auto_rows", "auto: sequence-rounds by the draft length the chooser picked",
                                 ["num_draft"], registry=r)
        self.auto_predicted = Gauge("ssd_auto_predicted_tokens_per_second", "auto: committed tokens per second "
                                    "its cost model predicted for the rounds it chose (since start)", registry=r)
        self.auto_measured = Gauge("ssd_auto_measured_tokens_per_second", "auto: committed tokens per second "
                                   "measured over the same rounds (since start)", registry=r)
        self.auto_thread_slowdown = Gauge("ssd_auto_thread_slowdown", "auto_ssd where SSD rounds take cores from "
                                          "the target: its MLP's time on those fewer threads over its time on all "
                                          "of them (measured at start; bounds the worker regime before its first "
                                          "visit)", registry=r)
        # auto with a draft worker (auto_ssd): the regime policy's choices and a lost worker
        self.auto_worker_rounds = Counter("ssd_auto_worker_rounds", "auto_ssd: decode rounds the draft worker "
                                          "served (SSD rounds; the others used the in-process draft)", registry=r)
        self.auto_regime_switches = Counter("ssd_auto_regime_switches", "auto_ssd: switches between SSD rounds "
                                            "and rounds with the in-process draft", registry=r)
        self.auto_regime_pruned = Counter("ssd_auto_regime_probes_pruned", "auto_ssd: visits of the other regime "
                                          "skipped because a model predicted it clearly slower", registry=r)
        self.auto_regime_deferred = Counter("ssd_auto_regime_visits_deferred", "auto_ssd: stint ends at which a "
                                            "first visit of the other regime waited (for the model's prediction, "
                                            "or because SSD rounds lost at a smaller batch)",
                                            registry=r)
        self.auto_regime_early = Counter("ssd_auto_regime_early_probes", "auto_ssd: visits of the other regime run "
                                         "before their probe interval because the model predicted it clearly "
                                         "faster, or to re-measure a single local stint that measured far below "
                                         "its prediction", registry=r)
        self.auto_regime_restated = Counter("ssd_auto_regime_restated", "auto_ssd: stint ends that compared both "
                                            "regimes by their calibrated predictions for the requests running "
                                            "then instead of their measured rates", registry=r)
        self.auto_worker_kept = Counter("ssd_auto_worker_kept_in_step_tokens", "auto_ssd, a worker on cores of its "
                                        "own: context tokens it prefilled during local stints, so that handing "
                                        "sequences back to it prefills only the rest", registry=r)
        self.auto_worker_idle_skipped = Counter("ssd_auto_worker_idle_prefills_skipped", "auto_ssd, a worker on cores "
                                                "of its own: local rounds and prompt arrivals at which it prefilled "
                                                "nothing (at a batch of 3 or more: not measured faster than the "
                                                "local regime there; below: its next visit scheduled after the "
                                                "requests end and predicted clearly slower even holding them)",
                                                registry=r)
        self.auto_worker_lost = Counter("ssd_draft_worker_lost", "auto_ssd: the draft worker lost (1 once it "
                                        "died or stopped answering; auto goes on with the in-process draft only)", registry=r)
        if mode == "auto" and k:
            for j in range(k + 1):
                self.auto_rows.labels(num_draft=str(j))
        self.draft_workers_up = Gauge("ssd_draft_workers_up", "SSD: draft workers answering (data-parallel drafts: "
                                      "--draft-workers; 0 outside SSD mode and after the last one failed)",
                                      registry=r)
        self.draft_worker_failures = Counter("ssd_draft_worker_failures", "SSD: draft workers given up on (dead, "
                                             "silent past worker_timeout_s, or answering nonsense)", registry=r)
        self.seqs_moved = Counter("ssd_spec_seqs_moved", "SSD: sequences whose draft worker failed, by where they "
                                  "went (worker: another live worker, which catches up on them; local: exact local "
                                  "AR decoding after the last worker failed)", ["to"], registry=r)
        for to in ("worker", "local"):
            self.seqs_moved.labels(to=to)
        self._worker_failures = 0
        if mode == "ssd":
            self.draft_worker_up.set(1)
        if mode == "ssd" and k:
            for j in range(k + 1):
                self.cache_hits.labels(k=str(j))
                self.cache_misses.labels(k=str(j))
        if mode != "ar" and k:
            for j in range(k):
                self.draft_by_pos.labels(position=str(j))
                self.accepted_by_pos.labels(position=str(j))

    def request_done(self, status: str) -> None:
        self.requests.labels(status=status).inc()

    def tokens(self, n: int, now: float, arrival: float, last_token_time: float | None) -> None:
        """n tokens committed at `now` for a request that arrived at `arrival`."""
        if n <= 0:
            return
        self.generation_tokens.inc(n)
        if last_token_time is None:
            self.ttft.observe(now - arrival)
            n -= 1
            last_token_time = now
        per = (now - last_token_time) / max(n, 1)
        for _ in range(n):
            self.itl.observe(per)

    def spec_delta(self, before: SpecStats, after: SpecStats) -> None:
        for j, n in enumerate(after.rounds_by_num_draft):
            n0 = before.rounds_by_num_draft[j] if j < len(before.rounds_by_num_draft) else 0
            if n > n0:
                self.rounds_by_num_draft.labels(num_draft=str(j)).inc(n - n0)
        drafted = after.draft_tokens - before.draft_tokens
        if drafted <= 0:
            return
        self.drafts.inc(after.rounds - before.rounds)
        self.draft_tokens.inc(drafted)
        self.accepted_tokens.inc(after.accepted_tokens - before.accepted_tokens)
        for j, (p, a) in enumerate(zip(after.proposed_by_pos, after.accepted_by_pos)):
            p0 = before.proposed_by_pos[j] if j < len(before.proposed_by_pos) else 0
            a0 = before.accepted_by_pos[j] if j < len(before.accepted_by_pos) else 0
            if p > p0:
                self.draft_by_pos.labels(position=str(j)).inc(p - p0)
            if a > a0:
                self.accepted_by_pos.labels(position=str(j)).inc(a - a0)

    def ssd_state(self, delta, worker_up: bool) -> None:
        """SSD: count the speculation cache's hits/misses and the worker failures of `delta` (a SpecSnapshot
        difference since the last call) and set the worker gauges."""
        self.draft_worker_up.set(1 if worker_up else 0)
        self._worker_failures += max(delta.worker_failures, 0)
        self.draft_workers_up.set(max(delta.draft_workers - self._worker_failures, 0) if worker_up else 0)
        if delta.worker_failures > 0:
            self.draft_worker_failures.inc(delta.worker_failures)
        for to, n in (("worker", delta.seqs_moved), ("local", delta.seqs_to_local)):
            if n > 0:
                self.seqs_moved.labels(to=to).inc(n)
        if delta.no_room > 0:
            self.worker_no_room.inc(delta.no_room)
        for counter, by_k in ((self.cache_hits, delta.hits_by_k), (self.cache_misses, delta.misses_by_k)):
            for j, n in enumerate(by_k):
                if n > 0:
                    counter.labels(k=str(j)).inc(n)

    def auto_state(self, delta, total) -> None:
        """auto: count the rounds of `delta` (a SpecSnapshot difference since the last call); the
        predicted and measured rates are those of `total` (every round since start)."""
        if delta.plain_rounds > 0:
            self.auto_plain_rounds.inc(delta.plain_rounds)
        for j, n in enumerate(delta.rows_by_num_draft):
            if n > 0:
                self.auto_rows.labels(num_draft=str(j)).inc(n)
        for counter, n in ((self.auto_probes, delta.probes), (self.auto_probes_skipped, delta.probes_skipped),
                           (self.auto_explorations, delta.explorations),
                           (self.auto_worker_rounds, delta.worker_rounds),
                           (self.auto_regime_switches, delta.regime_switches),
                           (self.auto_regime_pruned, delta.regime_probes_pruned),
                           (self.auto_regime_deferred, delta.regime_visits_deferred),
                           (self.auto_regime_early, delta.regime_early_probes),
                           (self.auto_regime_restated, delta.regime_restated),
                           (self.auto_worker_kept, delta.worker_kept_in_step),
                           (self.auto_worker_idle_skipped, delta.worker_idle_prefills_skipped),
                           (self.auto_worker_lost, delta.worker_lost)):
            if n > 0:
                counter.inc(n)
        d = total.to_dict()
        for gauge, key in ((self.auto_predicted, "auto_predicted_tokens_per_s"),
                           (self.auto_measured, "auto_measured_tokens_per_s")):
            if d.get(key) is not None:
                gauge.set(d[key])
        if total.thread_slowdown is not None:
            self.auto_thread_slowdown.set(total.thread_slowdown)

    def engine_state(self, scheduler, managers: dict) -> None:
        self.running.set(len(scheduler.running))
        self.waiting.set(len(scheduler.waiting))
        for name, bm in managers.items():
            free = bm.num_free_blocks
            self.kv_free.labels(model=name).set(free)
            self.kv_used.labels(model=name).set(bm.num_blocks - free)
            self.kv_total.labels(model=name).set(bm.num_blocks)
