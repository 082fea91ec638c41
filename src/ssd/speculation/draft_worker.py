"""The SSD draft side: keeps the draft's KV cache of every sequence, answers speculation requests
and, while the target verifies, pre-drafts the next speculation for the likely verification
outcomes (k accepted, bonus t) into the speculation cache.

`DraftWorker` holds the logic and runs in-process for tests; `serve()` wraps it in a process that
talks to the engine over torch.distributed (see transport.py).

Randomness: every chain of draft tokens for outcome (k, t) of round i of a sequence is sampled
with a generator seeded from (request seed, i, k, t). A pre-drafted chain and a just-in-time
backup chain for the same outcome are therefore the same tokens, so a seeded request's output does
not depend on how much the worker managed to pre-draft (timing).
"""
from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, field

import torch

from ssd.engine.model_runner import ForwardItem, ModelRunner
from ssd.layers.attention import block_slots
from ssd.layers.sampler import logits_to_probs, sample
from ssd.speculation.backup import ngram_proposal
from ssd.speculation.fanout import AcceptanceEstimator, MissCurveEstimator, budget_from_timings, geometric_fanout
from ssd.speculation.saguaro import saguaro_proposal

log = logging.getLogger(__name__)


@dataclass
class SeqParams:
    temperature: float
    top_k: int
    top_p: float
    seed: int

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Chain:
    """Draft tokens following outcome (k, t) (up to `want`; fewer when pre-drafting was cut short),
    with the distributions they were sampled from and the generator that continues them."""

    k: int
    bonus: int
    want: int
    gen: torch.Generator
    tokens: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)    # proposal actually sampled (empty when greedy)
    ranking: list[torch.Tensor] = field(default_factory=list)  # draft distribution per position (candidates)
    region: int | None = None           # scratch region holding KV of [bonus, tokens[:-1]] (pre-drafted)

    @property
    def complete(self) -> bool:
        return len(self.tokens) >= self.want

    def probs_tensor(self) -> torch.Tensor | None:
        return torch.stack(self.probs) if self.probs else None


@dataclass
class Job:
    """Draft `want` tokens after bonus token `bonus` at position `pos` (seeded by round/k/bonus)."""

    seq: "WorkerSeq"
    rnd: int
    k: int
    bonus: int
    pos: int
    want: int
    chain: Chain | None = None       # resume this partially drafted chain


@dataclass
class WorkerSeq:
    seq_id: int
    params: SeqParams
    ctx: list[int]                      # committed tokens (prompt + accepted output)
    cached: int                         # main KV holds positions [0, cached) of ctx + spec
    round: int = 0
    spec: list[int] = field(default_factory=list)      # last speculation sent
    source: str = "none"                                # where it came from: cache | neural | fast
    dists: dict[int, torch.Tensor] = field(default_factory=dict)  # draft ranking dist after ctx+spec[:k]
    chains: dict[tuple[int, int], Chain] = field(default_factory=dict)

    @property
    def tokens(self) -> list[int]:
        return self.ctx + self.spec


@dataclass
class Reply:
    seq_id: int
    tokens: list[int]
    probs: torch.Tensor | None
    hit: bool
    backup: str          # "cache" | "neural" | "fast"


class DraftWorker:
    def __init__(self, runner: ModelRunner, vocab: int, k: int, fanout_budget: int | None = None,
                 saguaro_c: float = 1.0, backup: str = "auto", max_chains: int = 64):
        self.runner = runner
        self.bm = runner.block_manager
        self.vocab = vocab
        self.k = k
        # chains per sequence per round: fixed when given, else sized each round from measured
        # timings so that pre-drafting fits inside one verification (see _timed_budget)
        self.fixed_budget = fanout_budget
        self.budget = fanout_budget or 1
        self.step_s = 0.0            # one-row draft step, measured by calibrate()
        self.row_cost = 1.0          # marginal cost of one more row in a step, relative to step_s
        self.slowdown = EMA(1.0, alpha=0.2)   # measured / modelled pre-draft time (memory contention)
        self.verify_s = 0.0          # last verification time, reported by the engine
        # measured per-round yield (tokens committed) by where the speculation came from, JIT cost
        self.tokens_per_round = {"cache": EMA(self.k * 0.7 + 1), "neural": EMA(self.k * 0.7 + 1),
                                 "fast": EMA(1.3)}
        self.hit_rate = EMA(0.5)
        # Saguaro's top-F per position is fixed at start (prior a and r): the distribution a chain is
        # sampled from must not depend on online estimates, which differ with pre-draft timing.
        self.saguaro_fan = geometric_fanout(0.7, MissCurveEstimator().r, k, max(4, k + 1))
        self.jit_s = EMA(0.0)
        self.saguaro_c = saguaro_c
        self.backup = backup
        self.acceptance = AcceptanceEstimator()   # per-token acceptance a, measured online
        self.miss_curve = MissCurveEstimator()    # miss(F) = F^-r, r measured online
        self.seqs: dict[int, WorkerSeq] = {}
        self.max_chains = max_chains
        self._scratch_id = -1
        self.bm.allocate(self._scratch_id, [0] * (max_chains * k + 1))
        self.scratch_slots = block_slots(self.bm.block_table(self._scratch_id), self.bm.block_size,
                                         max_chains * k)
        self.free_regions = list(range(max_chains))   # scratch regions of K slots, one per live chain
        self.busy_s = 0.0
        self.spans: list[tuple[int, float, float]] = []   # (1 answer | 2 predraft | 3 prefill, start, end)
        if fanout_budget is None:
            self.calibrate()
        self.stats = {"hits": 0, "misses": 0, "hits_by_k": [0] * (k + 1), "misses_by_k": [0] * (k + 1),
                      "chains_drafted": 0, "partial_hits": 0}

    # ---- sequence lifecycle -----------------------------------------------------------------
    def add(self, seq_id: int, tokens: list[int], params: SeqParams) -> None:
        if seq_id in self.seqs:
            self.free(seq_id)
        t0 = time.perf_counter()
        cached = self.bm.allocate(seq_id, tokens)
        self.runner.forward([ForwardItem(seq_id, tokens[cached:], cached, 0)])
        self.bm.commit(seq_id, tokens)
        # rounds are numbered from the context length: a sequence added again later (after one-token
        # rounds without the worker) never reuses a round number, so no chain seed repeats
        self.seqs[seq_id] = WorkerSeq(seq_id, params, list(tokens), len(tokens), round=len(tokens))
        self._spent(3, t0)

    def free(self, seq_id: int) -> None:
        s = self.seqs.pop(seq_id, None)
        if s is not None:
            self._drop_chains(s)
            self.bm.free(seq_id)

    def _drop_chains(self, s: WorkerSeq) -> None:
        self.free_regions += [c.region for c in s.chains.values() if c.region is not None]
        s.chains = {}

    def _region_slots(self, region: int) -> torch.Tensor:
        return self.scratch_slots[region * self.k:(region + 1) * self.k]

    # ---- answering ----------------------------------------------------------------------------
    def speculate(self, requests: list[tuple[int, int, int, int]]) -> list[Reply]:
        """requests: (seq_id, accepted k, bonus t, tokens wanted). Applies each outcome and returns
        the next speculation: from the cache on a hit; else the backup, which resumes a partially
        pre-drafted chain for that outcome when there is one."""
        t0 = time.perf_counter()
        replies: list[Reply | None] = []
        jit: list[tuple[int, Job]] = []
        for seq_id, k, t, want in requests:
            s = self.seqs[seq_id]
            chain = s.chains.get((k, t)) if want == self.k else None
            full = chain is not None and chain.complete
            self._update_acceptance(s, k, t)
            if s.spec and want:      # a round that asks for no draft is neither a hit nor a miss
                self.stats["hits_by_k" if full else "misses_by_k"][k] += 1
                self.stats["hits" if full else "misses"] += 1
                self.tokens_per_round[s.source].update(k + 1)
                self.hit_rate.update(float(full))
            rnd = s.round
            self._commit_outcome(s, k, t)
            if full:
                self._adopt(s, chain)
                s.source = "cache"
                replies.append(Reply(seq_id, chain.tokens, chain.probs_tensor(), True, "cache"))
            elif want == 0:
                s.spec, s.dists = [], {}
                replies.append(Reply(seq_id, [], None, False, "none"))
            else:
                fast = None
                if chain is None and self.choose_backup(len(requests)) == "fast":
                    fast = ngram_proposal(s.ctx, want)
                if fast is not None:
                    s.spec, s.dists, s.source = list(fast), {}, "fast"
                    replies.append(Reply(seq_id, s.spec, None, False, "fast"))
                else:
                    if chain is not None and chain.tokens:
                        self._adopt(s, chain)        # keep what was pre-drafted, draft the rest now
                        self.stats["partial_hits"] += 1
                    jit.append((len(replies), Job(s, rnd, k, t, len(s.ctx) - 1, want, chain)))
                    replies.append(None)
        if jit:
            t_jit = time.perf_counter()
            chains, _ = self._draft([j for _, j in jit], main=True)
            self.jit_s.update(time.perf_counter() - t_jit)
            for (i, job), c in zip(jit, chains):
                s = job.seq
                s.spec, s.source = c.tokens, "neural"
                s.dists = dict(enumerate(c.ranking))
                replies[i] = Reply(s.seq_id, c.tokens, c.probs_tensor(), False,
                                   "partial" if job.chain is not None and job.chain.tokens else "neural")
        for r in replies:
            self._drop_chains(self.seqs[r.seq_id])
        self._spent(1, t0)
        return replies

    def choose_backup(self, batch: int) -> str:
        """neural | fast for a miss in a batch of `batch` sequences. One neural miss stalls the whole
        batch for a just-in-time draft; a fast miss stalls nothing but yields fewer tokens. Compare the
        expected tokens per second of both from measured hit rate, yields and times."""
        if self.backup != "auto":
            return self.backup
        return "fast" if batch >= self.critical_batch() else "neural"

    def critical_batch(self, limit: int = 256) -> int:
        """The smallest batch size b* from which the fast backup is expected to be faster."""
        h, v, jit = self.hit_rate.value, max(self.verify_s, 1e-4), self.jit_s.value
        good, fast = self.tokens_per_round["neural"].value, self.tokens_per_round["fast"].value
        hit_yield = self.tokens_per_round["cache"].value
        for b in range(1, limit + 1):
            neural = (h * hit_yield + (1 - h) * good) / (v + (1 - h ** b) * jit)
            fast_rate = (h * hit_yield + (1 - h) * fast) / v
            if fast_rate > neural:
                return b
        return limit + 1

    def observe_verify(self, verify_s: float) -> None:
        self.verify_s = verify_s

    def calibrate(self, ctx: int = 64, rows: int = 16, reps: int = 3) -> None:
        """Time a draft step over 1 row and over `rows` rows (one row = one chain's next token) once
        at start; the budget's cost model is t(R) = step_s * (1 + row_cost * (R - 1))."""
        sid = -2
        self.bm.allocate(sid, [0] * ctx)
        self.runner.forward([ForwardItem(sid, [0] * ctx, 0)])
        times = {}
        for r in (1, rows):
            ts = []
            for _ in range(reps):
                self.bm.append(sid, r)
                t0 = time.perf_counter()
                self.runner.forward([ForwardItem(sid, [0] * r, ctx, r)])[0].cpu()   # waits for a GPU too
                ts.append(time.perf_counter() - t0)
                self.bm.rollback(sid, r)
            times[r] = sorted(ts)[reps // 2]
        self.bm.free(sid)
        self.step_s = times[1]
        self.row_cost = min(1.0, max(0.0, (times[rows] / times[1] - 1) / (rows - 1)))
        log.info("draft step %.1f ms for 1 row, %.1f ms for %d rows (row cost %.2f)", 1e3 * times[1],
                 1e3 * times[rows], rows, self.row_cost)

    def _step_time(self, rows: int) -> float:
        return self.step_s * (1 + self.row_cost * (rows - 1))

    def _timed_budget(self, nseq: int) -> int:
        """Chains per sequence this round: the most whose K batched steps, after the catch-up step,
        end within 90% of the last verification under the calibrated cost model, scaled by the
        measured slowdown (the target and the draft share memory bandwidth). At least 1: a chain
        cut short is resumed by the backup, so trying one is never wasted."""
        cap = max(1, self.max_chains // nseq)
        if self.fixed_budget is not None:
            return min(self.fixed_budget, cap)
        if not self.step_s or not self.verify_s:
            return 1
        step = self.step_s * self.slowdown.value
        b = budget_from_timings(self.verify_s, step, self.k, nseq, row_cost=self.row_cost,
                                overhead_s=step * (1 + self.row_cost * (nseq - 1)), safety=0.9, max_budget=cap)
        return max(1, b)

    def _observe_predraft(self, nseq: int, budget: int, completed: bool, took_s: float) -> None:
        """Learn the slowdown: measured time over the modelled time of a complete pre-draft. A
        pre-draft cut short only says it was slower than the verification allowed."""
        if not self.step_s:
            return
        model = self._step_time(nseq) + self.k * self._step_time(nseq * budget)
        ratio = took_s / model
        self.slowdown.update(ratio if completed else max(ratio, self.slowdown.value * 1.25))

    def _spent(self, kind: int, t0: float) -> None:
        t1 = time.perf_counter()
        self.busy_s += t1 - t0
        self.spans.append((kind, t0, t1))
        del self.spans[:-256]     # bounded: the engine collects them with each answer

    def _update_acceptance(self, s: WorkerSeq, k: int, t: int) -> None:
        if not s.spec:
            return
        self.acceptance.observe(k, len(s.spec))
        if k in s.dists:   # where the true bonus ranked among the draft's candidates at k
            dist = s.dists[k].clone()
            if k < len(s.spec):
                dist[s.spec[k]] = -1.0
            self.miss_curve.observe_rank(int((dist > dist[t]).sum()))

    def plan(self, budget: int) -> list[int]:
        """Fan-out F_0..F_K for a per-sequence budget (geometric, from the measured a and r)."""
        a = min(max(self.acceptance.rate, 0.02), 0.98)
        return geometric_fanout(a, self.miss_curve.r, self.k, budget)

    def _commit_outcome(self, s: WorkerSeq, k: int, t: int) -> None:
        """ctx += spec[:k] + [t]; the main cache keeps only what is still valid."""
        keep = min(s.cached, len(s.ctx) + k)
        s.ctx = s.ctx + s.spec[:k] + [t]
        s.round += 1
        self.bm.rollback(s.seq_id, self.bm.num_tokens(s.seq_id) - keep)
        s.cached = keep
        self.bm.commit(s.seq_id, s.ctx[:keep])

    def _adopt(self, s: WorkerSeq, chain: Chain) -> None:
        """Make a pre-drafted chain the sequence's state: copy its KV (bonus + all but its last token)
        into the main cache instead of recomputing it."""
        base = len(s.ctx) - 1               # position of the bonus token
        n = len(chain.tokens)
        if s.cached == base and n:
            self.bm.append(s.seq_id, max(0, base + n - self.bm.num_tokens(s.seq_id)))
            dst = block_slots(self.bm.block_table(s.seq_id), self.bm.block_size, base + n)[base:]
            self.runner.copy_slots(self._region_slots(chain.region)[:n], dst)
            s.cached = base + n
        s.spec = list(chain.tokens)
        s.dists = dict(enumerate(chain.ranking))

    # ---- drafting -----------------------------------------------------------------------------
    def _params_rows(self, seqs: list[WorkerSeq]):
        temp = torch.tensor([s.params.temperature for s in seqs])
        top_k = torch.tensor([s.params.top_k for s in seqs], dtype=torch.long)
        top_p = torch.tensor([s.params.top_p for s in seqs])
        return temp, top_k, top_p

    def _draft(self, jobs: list[Job], main: bool, poll=None) -> tuple[list[Chain], bool]:
        """Draft each job's chain up to `want` tokens, all jobs batched per step. main=True extends the
        sequence's own cache (just-in-time backup, possibly resuming a partial chain); otherwise each
        chain writes its KV to its scratch region and attends to the main cache up to its branch
        point. Stops early (returns stopped=True, chains partial) when `poll()` says the engine asks."""
        chains = []
        for j in jobs:
            c = j.chain or Chain(j.k, j.bonus, j.want, torch.Generator().manual_seed(
                _chain_seed(j.seq.params.seed, j.rnd, j.k, j.bonus)))
            if not main and c.region is None:
                c.region = self.free_regions.pop()
            chains.append(c)
        temp, top_k, top_p = self._params_rows([j.seq for j in jobs])
        while True:
            active = [i for i, c in enumerate(chains) if len(c.tokens) < jobs[i].want]
            if not active:
                break
            if poll is not None and poll():
                log.debug("pre-draft stopped: the engine is asking")
                if not main:
                    self.stats["chains_drafted"] += sum(1 for c in chains if c.tokens)
                return chains, True
            items = []
            for i in active:
                j, c = jobs[i], chains[i]
                s, cur = j.seq, len(c.tokens)
                pos = j.pos + cur                                # position of the token fed now
                if main:
                    start = min(s.cached, pos)
                    feed = (s.ctx + c.tokens)[start:pos + 1]
                    need = pos + 1 - self.bm.num_tokens(s.seq_id)
                    if need > 0:
                        self.bm.append(s.seq_id, need)
                    items.append(ForwardItem(s.seq_id, feed, start))
                    s.cached = pos + 1
                else:
                    feed = [j.bonus] if cur == 0 else [c.tokens[-1]]
                    main_slots = block_slots(self.bm.block_table(s.seq_id), self.bm.block_size, j.pos)
                    own = self._region_slots(c.region)[:cur + 1]
                    items.append(ForwardItem(s.seq_id, feed, pos, 1, torch.cat([main_slots, own])))
            # sampling and ranking stay on the CPU (per-request CPU generators); on a GPU this copy is
            # also the step's synchronization point
            logits = _to_width(torch.cat(self.runner.forward(items)), self.vocab).float().cpu()
            rows = torch.tensor(active)
            q = logits_to_probs(logits, temp[rows], top_k[rows], top_p[rows])
            soft = torch.softmax(logits / temp[rows].clamp_min(1e-3).where(temp[rows] > 0, 1.0).unsqueeze(1), -1)
            for r, i in enumerate(active):
                c = chains[i]
                c.ranking.append(soft[r])
                if jobs[i].seq.params.greedy:
                    c.tokens.append(int(q[r].argmax()))
                    continue
                qp = saguaro_proposal(q[r], self.saguaro_fan[min(len(c.tokens), self.k)], self.saguaro_c)
                c.tokens.append(int(sample(qp.unsqueeze(0), [c.gen])[0]))
                c.probs.append(qp)
        if not main:
            self.stats["chains_drafted"] += len(jobs)
        return chains, False

    def predraft(self, poll=None) -> int:
        """Fill the speculation cache of every sequence for its likely outcomes. Returns chains built."""
        t0 = time.perf_counter()
        seqs = [s for s in self.seqs.values() if len(s.spec) == self.k and not s.chains]
        if not seqs:
            return 0
        self._catch_up(seqs)
        jobs = []
        self.budget = per_seq = self._timed_budget(len(seqs))
        for s in seqs:
            fan = self.plan(per_seq)
            for k in range(self.k + 1):
                if fan[k] <= 0:
                    continue
                dist = s.dists[k].clone()
                if k < self.k:
                    dist[s.spec[k]] = -1.0          # a rejected token is never the bonus
                for t in dist.topk(fan[k]).indices.tolist():
                    jobs.append(Job(s, s.round, k, t, len(s.ctx) + k, self.k))
        jobs = jobs[:len(self.free_regions)]
        if not jobs:
            return 0
        chains, stopped = self._draft(jobs, main=False, poll=poll)
        for j, c in zip(jobs, chains):
            j.seq.chains[(j.k, j.bonus)] = c       # partial chains too: a miss resumes them
        late = not stopped and poll is not None and poll()
        log.debug("pre-draft: %d chains, budget %d, late %s, %.0f ms (verify %.0f ms)", len(jobs), self.budget, late,
                  1e3 * (time.perf_counter() - t0), 1e3 * self.verify_s)
        self._observe_predraft(len(seqs), per_seq, not stopped and not late, time.perf_counter() - t0)
        self._spent(2, t0)
        return len(chains)

    def _catch_up(self, seqs: list[WorkerSeq]) -> None:
        """Feed the speculation tokens the main cache lacks and record the draft's distribution at
        every outcome position k = 0..K (used to pick the bonus candidates)."""
        items, idx = [], []
        for s in seqs:
            toks = s.tokens
            missing = [k for k in range(self.k + 1) if k not in s.dists]
            if not missing:
                continue
            first = len(s.ctx) - 1 + min(missing)     # feeding position p gives the dist for p+1
            start = min(s.cached, first)
            feed = toks[start:]
            need = len(toks) - self.bm.num_tokens(s.seq_id)
            if need > 0:
                self.bm.append(s.seq_id, need)
            items.append(ForwardItem(s.seq_id, feed, start, len(toks) - first))
            idx.append((s, first))
            s.cached = len(toks)
        if not items:
            return
        for (s, first), lg in zip(idx, self.runner.forward(items)):
            temp = torch.tensor([max(s.params.temperature, 1.0) if s.params.greedy else s.params.temperature])
            pr = torch.softmax(_to_width(lg, self.vocab).float().cpu() / temp, dim=-1)
            for r in range(pr.shape[0]):
                k = first + r - (len(s.ctx) - 1)
                if k not in s.dists:
                    s.dists[k] = pr[r]


class EMA:
    def __init__(self, value: float, alpha: float = 0.1):
        self.value, self.alpha = value, alpha

    def update(self, x: float) -> None:
        self.value += self.alpha * (x - self.value)


def _to_width(logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits over the target's vocabulary (padding rows dropped, missing ids at -inf), so the
    worker samples only shared ids and ships q over exactly the target's width."""
    from ssd.engine.sd import align_vocab

    return align_vocab(logits, vocab)


def _chain_seed(seed: int, rnd: int, k: int, t: int) -> int:
    """The request's seed (not its arrival order: a seeded request drafts the same chains whatever
    came before it), the round (numbered from the context length), the outcome (k, bonus t)."""
    h = hashlib.blake2b(f"{seed}:{rnd}:{k}:{t}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFF_FFFF_FFFF_FFFF


# ---- the worker process -------------------------------------------------------------------------
def serve(host: str, port: int, model: str, dtype: str, k: int, threads: int | None, cores: list[int] | None,
          fanout_budget: int | None, saguaro_c: float, backup: str, timeout_s: float, num_blocks: int,
          block_size: int, max_model_len: int, device: str = "cpu") -> None:
    """Join the engine's process group as rank 1, load the draft and serve until SHUTDOWN."""
    import os

    from ssd.models.loader import load_model
    from ssd.speculation.transport import Channel, Msg, error_message, init_group

    if cores:
        os.sched_setaffinity(0, cores)
    if threads:
        torch.set_num_threads(threads)
    store = init_group(host, port, rank=1, timeout_s=timeout_s)
    chan = Channel(peer=0, store=store)
    try:
        loaded = load_model(model, dtype, device, max_model_len + 32, progress=False)
        # the target's block count plus the pre-draft scratch regions (64 chains of k slots), so the
        # worker has room for every sequence the target holds
        scratch = -(-(64 * k + 1) // block_size) + 1
        runner = ModelRunner(loaded.model, num_blocks + scratch, block_size, torch.device(device))
        worker = DraftWorker(runner, loaded.config.vocab_size, k, fanout_budget, saguaro_c, backup)
    except Exception as e:  # report, then exit: the engine turns it into a clear start-up error
        chan.send(Msg.ERROR, error_message(f"draft worker could not load {model!r}: {e}"))
        raise
    chan.send(Msg.HELLO, [loaded.config.vocab_size, os.getpid(), k])
    cfg = chan.recv()
    if cfg.kind == Msg.SHUTDOWN:
        return
    if cfg.kind != Msg.CONFIG:
        raise RuntimeError(f"draft worker expected CONFIG after HELLO, got {cfg.kind.name}")
    worker.vocab = int(cfg.ints[0])       # ship proposals over the target's vocabulary width
    log.info("draft worker ready (pid %d, %s, cores %s, threads %d)", os.getpid(), device, cores,
             torch.get_num_threads())
    with torch.inference_mode():
        while True:
            worker.predraft(poll=chan.pending)
            msg = chan.recv()
            if msg.kind == Msg.SHUTDOWN:
                break
            handle(worker, chan, msg)


def handle(worker: DraftWorker, chan, msg) -> None:
    from ssd.speculation.transport import Msg

    ints = msg.ints.tolist()
    if msg.kind == Msg.ADD:
        seq_id, seed, top_k, n = ints[:4]
        temperature, top_p = msg.floats.tolist()
        worker.add(seq_id, ints[4:4 + n], SeqParams(temperature, top_k, top_p, seed))
    elif msg.kind == Msg.FREE:
        for seq_id in ints:
            worker.free(seq_id)
    elif msg.kind == Msg.SPECULATE:
        n = ints[0]
        reqs = [tuple(ints[1 + 4 * i:5 + 4 * i]) for i in range(n)]
        if msg.floats.numel():
            worker.observe_verify(float(msg.floats[0]))
        replies = worker.speculate(reqs)
        out_ints, out_probs = [n], []
        for r in replies:
            code = {"cache": 1, "neural": 0, "fast": 2, "none": 0, "partial": 3}[r.backup]
            out_ints += [code, int(r.probs is not None), len(r.tokens), *r.tokens]
            if r.probs is not None:
                out_probs.append(r.probs.reshape(-1))
        out_ints += [worker.stats["chains_drafted"], len(worker.spans)]
        for kind, start, end in worker.spans:
            out_ints += [kind, int(start * 1e6), int(end * 1e6)]
        worker.spans.clear()
        busy = torch.tensor([worker.busy_s], dtype=torch.float32)
        chan.send(Msg.SPECULATION, out_ints, torch.cat(out_probs + [busy]))
    else:
        raise RuntimeError(f"draft worker got unexpected message {msg.kind}")


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="ssd draft worker (started by the engine, or by hand with --connect)")
    p.add_argument("--connect", required=True, help="HOST:PORT of the engine's rendezvous")
    p.add_argument("--model", required=True)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N: where the draft model runs")
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cores", default=None, help="comma-separated CPU cores to pin to")
    p.add_argument("--fanout-budget", type=int, default=None, help="chains per sequence per round (default: auto)")
    p.add_argument("--saguaro-c", type=float, default=1.0)
    p.add_argument("--backup", choices=["auto", "neural", "fast"], default="auto")
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--num-blocks", type=int, default=4096)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.WARNING,
                        format="%(levelname)s draft-worker: %(message)s")
    host, port = a.connect.rsplit(":", 1)
    cores = [int(c) for c in a.cores.split(",")] if a.cores else None
    serve(host, int(port), a.model, a.dtype, a.k, a.threads, cores, a.fanout_budget, a.saguaro_c, a.backup,
          a.timeout, a.num_blocks, a.block_size, a.max_model_len, a.device)


if __name__ == "__main__":
    main()
