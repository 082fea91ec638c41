"""The draft worker's round loop (docs/ARCHITECTURE.md 3): keeps the draft's KV cache of every
sequence, answers each round's speculation request and, while the target verifies, pre-drafts the
next speculation for the likely outcomes into the speculation cache.

`DraftWorker` is the logic and runs in-process in tests; `serve.py` wraps it in a process that talks
to the engine through `transport.Channel`.

A worker that runs out of KV room never fails: the sequence concerned is dropped and its next reply
says NO_ROOM (the engine decodes it without a draft and hands it back later); pre-drafting skips
what does not fit.
"""
from __future__ import annotations

import logging
import time

import torch

from ssd.engine.block_manager import NoFreeBlocksError
from ssd.engine.model_runner import ForwardItem, ModelRunner
from ssd.layers.attention import block_slots
from ssd.speculation.backup import ngram_proposal
from ssd.speculation.fanout import AcceptanceEstimator, MissCurveEstimator, geometric_fanout
from ssd.speculation.worker.cache import SpeculationCache, candidate_outcomes, ranked_tokens
from ssd.speculation.worker.drafting import Drafter, Job, WorkerSeq
from ssd.speculation.worker.messages import Add, Reply, Request, Source, SpanKind
from ssd.speculation.worker.policy import BackupPolicy, BudgetPolicy

log = logging.getLogger(__name__)

_SCRATCH = -1      # the block manager "sequence" pinning the chain pool's scratch regions


def scratch_blocks(num_regions: int, k: int, block_size: int) -> int:
    """KV blocks the chain pool pins (so the worker's pool can be sized: sequences + scratch)."""
    return -(-(num_regions * k + 1) // block_size)


def chain_regions(max_num_seqs: int, chains_per_seq: int) -> int:
    """Scratch regions for a whole batch: every sequence of a full batch gets chains_per_seq chains;
    small batches may use more each (at least 64 regions in all)."""
    return max(64, max_num_seqs * chains_per_seq)


def pool_size(num_blocks: int, k: int, block_size: int, max_num_seqs: int, chains_per_seq: int) -> tuple[int, int]:
    """(KV blocks, chain regions) of a worker: the target's block count for sequences plus the chain
    pool's pinned scratch regions (sized for a full batch)."""
    regions = chain_regions(max_num_seqs, chains_per_seq)
    return num_blocks + scratch_blocks(regions, k, block_size) + 1, regions


class DraftWorker:
    def __init__(self, runner: ModelRunner, vocab: int, k: int, fanout_budget: int | None = None,
                 saguaro_c: float = 1.0, backup: str = "auto", num_regions: int = 64, calibrate: bool = True):
        self.runner = runner
        self.bm = runner.block_manager
        self.k = k
        self.bm.allocate(_SCRATCH, [0] * (num_regions * k + 1))
        slots = block_slots(self.bm.block_table(_SCRATCH), self.bm.block_size, num_regions * k)
        self.cache = SpeculationCache(num_regions, k, slots)
        saguaro_fan = geometric_fanout(0.7, MissCurveEstimator().r, k, max(4, k + 1))
        self.drafter = Drafter(runner, self.cache, vocab, k, saguaro_fan, saguaro_c)
        self.budget = BudgetPolicy(k, fanout_budget)
        self.backup = BackupPolicy(backup, k)
        if calibrate and fanout_budget is None:
            self.budget.step_s, self.budget.row_cost = self.drafter.calibrate()
        self.acceptance = AcceptanceEstimator()   # per-token acceptance a, measured online
        self.miss_curve = MissCurveEstimator()    # miss(F) = F^-r, r measured online
        self.seqs: dict[int, WorkerSeq] = {}
        self.no_room: set[int] = set()            # dropped for lack of KV room; told on their next request
        self.busy_s = 0.0
        self.prefill_tokens, self.prefill_s = 0, 0.0   # tokens computed by add() and their time, cumulative
        self.spans: list[tuple[SpanKind, float, float]] = []
        self.stats = {"no_room": 0}               # sequences dropped for lack of room (the engine counts the rest)

    @property
    def vocab(self) -> int:
        return self.drafter.vocab

    @property
    def chains_drafted(self) -> int:
        return self.drafter.chains_drafted

    # ---- sequence lifecycle -----------------------------------------------------------------
    def add(self, msg: Add) -> None:
        self.free(msg.seq_id)
        self.no_room.discard(msg.seq_id)
        t0 = time.perf_counter()
        try:
            cached = self.bm.allocate(msg.seq_id, msg.tokens)
        except NoFreeBlocksError as e:
            self._out_of_room(msg.seq_id, e)
            return
        self.runner.forward([ForwardItem(msg.seq_id, msg.tokens[cached:], cached, 0)])
        self.bm.commit(msg.seq_id, msg.tokens)
        n = len(msg.tokens)
        self.seqs[msg.seq_id] = WorkerSeq(msg.seq_id, msg, list(msg.tokens), n, round=n)
        self.prefill_tokens += n - cached
        self.prefill_s += time.perf_counter() - t0
        self._spent(SpanKind.PREFILL, t0)

    def free(self, seq_id: int) -> None:
        self.no_room.discard(seq_id)
        s = self.seqs.pop(seq_id, None)
        if s is not None:
            self.cache.drop(seq_id)
            self.bm.free(seq_id)

    def _out_of_room(self, seq_id: int, why: Exception) -> None:
        log.info("draft worker: no KV room for sequence %d (%s); it decodes without a draft for now", seq_id, why)
        self.free(seq_id)
        self.no_room.add(seq_id)
        self.stats["no_room"] += 1

    # ---- answering ----------------------------------------------------------------------------
    def speculate(self, requests: list[Request]) -> list[Reply]:
        """Apply each outcome and return the next speculation: from the cache on a hit; else the
        backup, which finishes a partially pre-drafted chain for that outcome when there is one."""
        t0 = time.perf_counter()
        replies: list[Reply | None] = []
        jit: list[tuple[int, Job]] = []
        for r in requests:
            if r.seq_id in self.no_room or r.seq_id not in self.seqs:
                self.no_room.discard(r.seq_id)
                replies.append(Reply(r.seq_id, Source.NO_ROOM, []))
                continue
            s = self.seqs[r.seq_id]
            rnd = s.round
            # a pre-drafted chain serves any shorter ask too: its first n tokens are an n-token chain
            chain = self.cache.get(s.seq_id, rnd, r.accepted, r.bonus) if r.num_draft else None
            full = chain is not None and len(chain.tokens) >= r.num_draft
            self._observe_outcome(s, r, full)
            self._commit_outcome(s, r.accepted, r.bonus)
            if full and self._adopt(s, chain, r.num_draft):
                s.source = "cache"
                n = r.num_draft
                replies.append(Reply(s.seq_id, Source.CACHE, chain.tokens[:n], chain.probs_tensor(n)))
            elif r.num_draft == 0:
                s.spec, s.dists = [], {}
                replies.append(Reply(s.seq_id, Source.NONE, []))
            else:
                fast = None
                if chain is None and self.backup.choose(len(requests)) == "fast":
                    fast = ngram_proposal(s.ctx, r.num_draft)
                if fast is not None:
                    s.spec, s.dists, s.source = list(fast), {}, "fast"
                    replies.append(Reply(s.seq_id, Source.FAST, s.spec))
                    continue
                partial = chain is not None and chain.tokens and self._adopt(s, chain)   # keep what was pre-drafted
                job = Job(s, rnd, r.accepted, r.bonus, len(s.ctx) - 1, r.num_draft, chain if partial else None)
                if not self._reserve(s, job.pos + r.num_draft):
                    replies.append(Reply(s.seq_id, Source.NO_ROOM, []))
                    continue
                jit.append((len(replies), job))
                replies.append(None)
        if jit:
            t_jit = time.perf_counter()
            chains, _ = self.drafter.draft([j for _, j in jit], main=True)
            self.backup.jit_s.update(time.perf_counter() - t_jit)
            for (i, job), c in zip(jit, chains):
                s = job.seq
                s.spec, s.source = c.tokens, "neural"
                s.dists = dict(enumerate(c.ranking))
                replies[i] = Reply(s.seq_id, Source.PARTIAL if job.chain is not None else Source.NEURAL,
                                   c.tokens, c.probs_tensor())
        for r in replies:
            self.cache.drop(r.seq_id)
        self._spent(SpanKind.ANSWER, t0)
        return replies

    def _reserve(self, s: WorkerSeq, end: int) -> bool:
        """Room in the sequence's cache up to position `end`; without it the sequence is dropped."""
        need = end - self.bm.num_tokens(s.seq_id)
        try:
            if need > 0:
                self.bm.append(s.seq_id, need)
            return True
        except NoFreeBlocksError as e:
            self._out_of_room(s.seq_id, e)
            self.no_room.discard(s.seq_id)      # this reply already says so
            return False

    def observe_verify(self, verify_s: float) -> None:
        self.budget.verify_s = self.backup.verify_s = verify_s

    def _observe_outcome(self, s: WorkerSeq, r: Request, hit: bool) -> None:
        """Learn from the outcome of the speculation sent last round (none after a prefill or a round
        that asked for no draft): acceptance, where the bonus ranked, yield by source, hit rate."""
        if not s.spec:
            return
        if r.num_draft:
            self.backup.observe_round(s.source, r.accepted + 1, hit)
        self.acceptance.observe(r.accepted, len(s.spec))
        if r.accepted in s.dists:
            dist = s.dists[r.accepted].clone()
            if r.accepted < len(s.spec):
                dist[s.spec[r.accepted]] = -1.0      # a rejected token is never the bonus
            self.miss_curve.observe_rank(int((dist > dist[r.bonus]).sum()))

    def _commit_outcome(self, s: WorkerSeq, accepted: int, bonus: int) -> None:
        """ctx += spec[:accepted] + [bonus]; the sequence's cache keeps only what is still valid."""
        keep = min(s.cached, len(s.ctx) + accepted)
        s.ctx = s.ctx + s.spec[:accepted] + [bonus]
        s.round += 1
        self.bm.rollback(s.seq_id, self.bm.num_tokens(s.seq_id) - keep)
        s.cached = keep
        self.bm.commit(s.seq_id, s.ctx[:keep])

    def _adopt(self, s: WorkerSeq, chain, n: int | None = None) -> bool:
        """Make a pre-drafted chain (its first n tokens; all by default) the sequence's speculation:
        copy its KV (bonus + all but its last token) into the sequence's cache instead of recomputing
        it. False: no room for it."""
        base = len(s.ctx) - 1               # position of the bonus token
        n = len(chain.tokens) if n is None else min(n, len(chain.tokens))
        if s.cached == base and n:
            try:
                self.bm.append(s.seq_id, max(0, base + n - self.bm.num_tokens(s.seq_id)))
            except NoFreeBlocksError:
                return False
            dst = block_slots(self.bm.block_table(s.seq_id), self.bm.block_size, base + n)[base:]
            self.runner.copy_slots(self.cache.region_slots(chain.region)[:n], dst)
            s.cached = base + n
        s.spec = list(chain.tokens[:n])
        s.dists = dict(enumerate(chain.ranking[:n]))
        return True

    # ---- pre-drafting -------------------------------------------------------------------------
    def plan(self, budget: int, num_draft: int | None = None) -> list[int]:
        """Fan-out per accepted length 0..num_draft (default K) for a per-sequence budget (geometric,
        from the measured a and r)."""
        a = min(max(self.acceptance.rate, 0.02), 0.98)
        return geometric_fanout(a, self.miss_curve.r, self.k if num_draft is None else num_draft, budget)

    def predraft(self, poll=None) -> int:
        """Fill the speculation cache of every sequence for its likely outcomes. Returns chains built."""
        t0 = time.perf_counter()
        # every sequence with a speculation out (of its own length: auto may ask for less than K); its
        # chains are drafted at that length, the length the next round most likely asks for
        seqs = [s for s in self.seqs.values() if s.spec and not self.cache.has_round(s.seq_id, s.round)]
        if not seqs:
            return 0
        seqs = self.drafter.catch_up(seqs)
        if not seqs:
            return 0
        cap = max(1, self.cache.free_regions // len(seqs))
        steps = max(len(s.spec) for s in seqs)      # batched draft steps: the longest chain's length
        per_seq = self.budget.budget(len(seqs), cap, steps)
        jobs = []
        for s in seqs:
            n = len(s.spec)
            ranked = ranked_tokens(torch.stack([s.dists[j] for j in range(n + 1)]), per_seq + 1)
            for accepted, bonus in candidate_outcomes(s.spec, ranked, self.plan(per_seq, n)):
                jobs.append(Job(s, s.round, accepted, bonus, len(s.ctx) + accepted, n))
        jobs = jobs[:self.cache.free_regions]
        if not jobs:
            return 0
        chains, stopped = self.drafter.draft(jobs, main=False, poll=poll)
        for j, c in zip(jobs, chains):
            self.cache.put(j.seq.seq_id, j.rnd, c)       # partial chains too: a miss finishes them
        late = not stopped and poll is not None and poll()
        took = time.perf_counter() - t0
        log.debug("pre-draft: %d chains, budget %d, late %s, %.0f ms (verify %.0f ms)", len(jobs), per_seq, late,
                  1e3 * took, 1e3 * self.budget.verify_s)
        self.budget.observe_predraft(len(seqs), per_seq, not stopped and not late, took, steps)
        self._spent(SpanKind.PREDRAFT, t0)
        return len(chains)

    def _spent(self, kind: SpanKind, t0: float) -> None:
        t1 = time.perf_counter()
        self.busy_s += t1 - t0
        self.spans.append((kind, t0, t1))
        del self.spans[:-256]     # bounded: the engine collects them with each answer

    def take_spans(self) -> list[tuple[SpanKind, float, float]]:
        spans, self.spans = self.spans, []
        return spans
