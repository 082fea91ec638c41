"""Speculation metrics of the engine as snapshots (docs/ARCHITECTURE.md 4).

The speculative step owns one `SpecCounters` and only ever adds to it; consumers (chat, bench,
server metrics, tests) never read the step: they call `LLMEngine.spec_metrics()` for a frozen
`SpecSnapshot` and take differences of two snapshots (`after.delta(before)`). The counters belong
to the engine, so they survive a fall-back to AR after a draft-worker failure.

Cache hits and misses count SSD rounds whose speculation could have come from the speculation
cache: a round asked for a speculation and the previous round of that sequence was pre-drafted
after (the first round after a prefill or a one-token round can neither hit nor miss).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

__all__ = ["SpecCounters", "SpecSnapshot"]


_LEVELS = {"draft_workers", "thread_slowdown"}     # snapshot fields that are states, not counts


def _grow(xs: list[int], n: int) -> None:
    while len(xs) < n:
        xs.append(0)


@dataclass
class SpecCounters:
    rounds: int = 0                 # speculative rounds (one target verification each)
    hits: int = 0                   # SSD: speculation served from a complete pre-drafted chain
    misses: int = 0
    fast_backups: int = 0           # SSD misses answered by the prompt-lookup proposal
    partial_hits: int = 0           # SSD misses answered by finishing a partially pre-drafted chain
    no_room: int = 0                # SSD: sequences the worker had no KV room for (decoded without a draft)
    hits_by_k: list[int] = field(default_factory=list)      # by the previous round's accepted length
    misses_by_k: list[int] = field(default_factory=list)
    tokens_on_hit: int = 0          # tokens committed by rounds that hit / missed
    tokens_on_miss: int = 0
    wait_s: float = 0.0             # target idle, waiting for the proposer
    verify_s: float = 0.0           # target busy verifying
    worker_busy_s: float = 0.0      # SSD: the worker's own busy time (drafting + pre-drafting), cumulative
    chains_drafted: int = 0         # SSD: pre-drafted chains, cumulative
    # SSD with data-parallel drafts (worker/proposer.py): failures and where their sequences went
    draft_workers: int = 0          # workers the engine started with (a level, not a count: kept by delta)
    worker_failures: int = 0        # workers given up on (dead, silent or answering nonsense)
    seqs_moved: int = 0             # sequences re-added to another live worker after theirs failed
    seqs_to_local: int = 0          # unfinished requests when the last worker failed (continued with local AR)
    # mode "auto": the chooser's decisions and how its predictions held up
    plain_rounds: int = 0           # rounds it ran without any draft (a plain target step)
    eager_draft_prefills: int = 0   # requests whose in-process draft it prefilled with the prompt (else lazy)
    probes: int = 0                 # one-token drafts for a request it stopped drafting for (re-measure it)
    probes_skipped: int = 0         # probes not run: no acceptance would have made drafting for it pay,
                                    # or its draft's catch-up would cost too much (Chooser._catch_up_affordable)
    explorations: int = 0           # sequence-rounds drafted for because drafting may pay at an acceptance one
                                    # standard deviation above the estimate (chooser.EXPLORE_Z)
    rows_by_num_draft: list[int] = field(default_factory=list)   # [j]: sequence-rounds given j draft tokens
    predicted_tokens: float = 0.0
    predicted_s: float = 0.0
    committed_tokens: int = 0
    round_s: float = 0.0
    # mode "auto" with a draft worker (auto_ssd): rounds the worker served, regime switches, worker lost
    worker_rounds: int = 0
    worker_rows_by_num_draft: list[int] = field(default_factory=list)   # as rows_by_num_draft, SSD rounds only
    regime_switches: int = 0
    regime_probes_pruned: int = 0   # regime probes skipped: the other regime was predicted clearly slower
    regime_visits_deferred: int = 0  # stint ends at which a first visit waited (for a prediction, or: SSD lost
                                     # at a smaller batch)
    regime_early_probes: int = 0     # probes run before their interval: the model predicted the other regime
                                     # clearly faster than the current one measured, or the local regime's
                                     # one stint there measured far below its prediction (a re-measure)
    regime_restated: int = 0         # stint ends that compared both regimes' calibrated predictions for the
                                     # requests running then, not their measured estimates (RegimePolicy.pick)
    worker_kept_in_step: int = 0     # tokens the worker prefilled in local stints on cores that would idle
                                     # (WorkerProposer.keep_in_step): a hand-over then prefills only the rest
    worker_idle_prefills_skipped: int = 0   # local stints: rounds and prompt prefills (a batch counts once) at which
                                            # the worker prefilled nothing (SpeculativeStep._worker_back_soon said no)
    worker_lost: int = 0
    thread_slowdown: float | None = None   # auto_ssd, thread split: target time on SSD-round / local threads
    started: float = field(default_factory=time.perf_counter)

    def cover(self, k: int) -> None:
        """Report every accepted length 0..K, zeros included."""
        _grow(self.hits_by_k, k + 1)
        _grow(self.misses_by_k, k + 1)

    def record_choice(self, num_draft: list[int], predicted_tokens: float, predicted_s: float, committed: int,
                      seconds: float, worker: bool = False) -> None:
        self.plain_rounds += not any(num_draft)
        for k in num_draft:
            _grow(self.rows_by_num_draft, k + 1)
            self.rows_by_num_draft[k] += 1
            if worker:
                _grow(self.worker_rows_by_num_draft, k + 1)
                self.worker_rows_by_num_draft[k] += 1
        self.predicted_tokens += predicted_tokens
        self.predicted_s += predicted_s
        self.committed_tokens += committed
        self.round_s += seconds

    def record_lookup(self, k: int, hit: bool, committed: int) -> None:
        _grow(self.hits_by_k, k + 1)
        _grow(self.misses_by_k, k + 1)
        if hit:
            self.hits += 1
            self.hits_by_k[k] += 1
            self.tokens_on_hit += committed
        else:
            self.misses += 1
            self.misses_by_k[k] += 1
            self.tokens_on_miss += committed

    def snapshot(self) -> SpecSnapshot:
        vals = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "started"}
        vals = {k: tuple(v) if isinstance(v, list) else v for k, v in vals.items()}
        return SpecSnapshot(**vals, wall_s=time.perf_counter() - self.started)


@dataclass(frozen=True)
class SpecSnapshot:
    rounds: int = 0
    hits: int = 0
    misses: int = 0
    fast_backups: int = 0
    partial_hits: int = 0
    no_room: int = 0
    hits_by_k: tuple[int, ...] = ()
    misses_by_k: tuple[int, ...] = ()
    tokens_on_hit: int = 0
    tokens_on_miss: int = 0
    wait_s: float = 0.0
    verify_s: float = 0.0
    worker_busy_s: float = 0.0
    chains_drafted: int = 0
    draft_workers: int = 0
    worker_failures: int = 0
    seqs_moved: int = 0
    seqs_to_local: int = 0
    plain_rounds: int = 0
    eager_draft_prefills: int = 0
    probes: int = 0
    probes_skipped: int = 0
    explorations: int = 0
    rows_by_num_draft: tuple[int, ...] = ()
    predicted_tokens: float = 0.0
    predicted_s: float = 0.0
    committed_tokens: int = 0
    round_s: float = 0.0
    worker_rounds: int = 0
    worker_rows_by_num_draft: tuple[int, ...] = ()
    regime_switches: int = 0
    regime_probes_pruned: int = 0
    regime_visits_deferred: int = 0
    regime_early_probes: int = 0
    regime_restated: int = 0
    worker_kept_in_step: int = 0
    worker_idle_prefills_skipped: int = 0
    worker_lost: int = 0
    thread_slowdown: float | None = None
    wall_s: float = 0.0

    def delta(self, before: SpecSnapshot) -> SpecSnapshot:
        """What happened between `before` and this snapshot (both of the same engine)."""
        out = {}
        for f in fields(self):
            a, b = getattr(self, f.name), getattr(before, f.name)
            if f.name in _LEVELS:
                out[f.name] = a
            elif isinstance(a, tuple):
                b = b + (0,) * (len(a) - len(b))
                out[f.name] = tuple(x - y for x, y in zip(a, b))
            else:
                out[f.name] = a - b
        return SpecSnapshot(**out)

    @property
    def cache_hit_rate(self) -> float | None:
        asked = self.hits + self.misses
        return self.hits / asked if asked else None

    def to_dict(self) -> dict:
        busy = self.wait_s + self.verify_s        # the target's decode time: verifying or waiting
        per = lambda x, n: x / n if n else None   # noqa: E731
        return {"cache_hit_rate": self.cache_hit_rate, "hits": self.hits, "misses": self.misses,
                "fast_backups": self.fast_backups, "partial_hits": self.partial_hits,
                "no_room": self.no_room, "cache_hit_rate_by_k": [per(h, h + m) for h, m in zip(self.hits_by_k, self.misses_by_k)],
                "tokens_per_round_on_hit": per(self.tokens_on_hit, self.hits),
                "tokens_per_round_on_miss": per(self.tokens_on_miss, self.misses),
                "target_idle_fraction": per(self.wait_s, busy),
                # per worker: the workers' summed busy time over the target's time, divided by their number
                "draft_busy_fraction": min(self.worker_busy_s / max(self.draft_workers, 1) / busy, 1.0)
                if busy else None,
                "ms_per_round": per(1e3 * busy, self.rounds),
                "verify_ms_per_round": per(1e3 * self.verify_s, self.rounds),
                "chains_drafted": self.chains_drafted,
                **({"draft_workers": self.draft_workers, "draft_worker_failures": self.worker_failures,
                    "seqs_moved_to_other_worker": self.seqs_moved, "seqs_moved_to_local_ar": self.seqs_to_local}
                   if self.draft_workers else {}),
                **({"auto_plain_round_share": per(self.plain_rounds, self.rounds),
                    "auto_rows_by_num_draft": list(self.rows_by_num_draft),
                    "auto_eager_draft_prefills": self.eager_draft_prefills,
                    "auto_probes": self.probes, "auto_probes_skipped": self.probes_skipped,
                    "auto_explorations": self.explorations,
                    "auto_predicted_tokens_per_s": per(self.predicted_tokens, self.predicted_s),
                    "auto_measured_tokens_per_s": per(self.committed_tokens, self.round_s)}
                   if self.rows_by_num_draft else {}),
                **({"auto_worker_round_share": per(self.worker_rounds, self.rounds),
                    "auto_worker_rows_by_num_draft": list(self.worker_rows_by_num_draft),
                    "auto_regime_switches": self.regime_switches,
                    "auto_regime_probes_pruned": self.regime_probes_pruned,
                    "auto_regime_visits_deferred": self.regime_visits_deferred,
                    "auto_regime_early_probes": self.regime_early_probes,
                    "auto_regime_restated": self.regime_restated,
                    "auto_worker_kept_in_step_tokens": self.worker_kept_in_step,
                    "auto_worker_idle_prefills_skipped": self.worker_idle_prefills_skipped,
                    "auto_worker_lost": self.worker_lost,
                    "auto_thread_slowdown": self.thread_slowdown}
                   if self.worker_rounds or self.worker_lost or self.regime_probes_pruned or
                   self.regime_visits_deferred else {})}
