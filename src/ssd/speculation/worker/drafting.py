"""Drafting chains for the worker: batched draft steps over many chains at once (docs/ARCHITECTURE.md 3).

A chain is drafted either into the sequence's own KV cache (just in time, possibly finishing a
partially pre-drafted chain) or, when pre-drafting, into its scratch region, attending to the
sequence's cache up to the chain's branch point. Every chain for outcome (accepted, bonus) of
round r is sampled with a generator seeded from (request seed, r, accepted, bonus): a pre-drafted
chain and a just-in-time chain for the same outcome are the same tokens, so a seeded request's
output does not depend on how much the worker managed to pre-draft.
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
from ssd.speculation.saguaro import saguaro_proposal
from ssd.speculation.verifier import align_vocab
from ssd.speculation.worker.cache import Chain, SpeculationCache
from ssd.speculation.worker.messages import Add

log = logging.getLogger(__name__)


@dataclass
class WorkerSeq:
    seq_id: int
    params: Add                         # sampling parameters (and the seed) as the engine sent them
    ctx: list[int]                      # committed tokens (prompt + accepted output)
    cached: int                         # the sequence's KV holds positions [0, cached) of ctx + spec
    round: int = 0                      # numbered from the context length (never reused after a re-add)
    spec: list[int] = field(default_factory=list)      # the speculation last sent
    source: str = "none"                # where it came from: cache | neural | fast
    dists: dict[int, torch.Tensor] = field(default_factory=dict)  # draft distribution after ctx + spec[:j]

    @property
    def tokens(self) -> list[int]:
        return self.ctx + self.spec


@dataclass
class Job:
    """Draft num_draft tokens after `bonus` at position `pos`, for outcome (accepted, bonus) of round rnd."""

    seq: WorkerSeq
    rnd: int
    accepted: int
    bonus: int
    pos: int
    num_draft: int
    chain: Chain | None = None          # resume this partially drafted chain


def chain_seed(seed: int, rnd: int, accepted: int, bonus: int) -> int:
    """From the request's seed (not its arrival order: a seeded request drafts the same chains whatever
    came before it), the round and the outcome."""
    h = hashlib.blake2b(f"{seed}:{rnd}:{accepted}:{bonus}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & 0x7FFF_FFFF_FFFF_FFFF


class Drafter:
    def __init__(self, runner: ModelRunner, cache: SpeculationCache, vocab: int, k: int,
                 saguaro_fan: list[int], saguaro_c: float):
        self.runner, self.bm, self.cache = runner, runner.block_manager, cache
        self.vocab, self.k = vocab, k
        # Saguaro's top-F per position is fixed at start: the distribution a chain is sampled from must
        # not depend on online estimates, which differ with pre-draft timing
        self.saguaro_fan, self.saguaro_c = saguaro_fan, saguaro_c
        self.chains_drafted = 0

    def logits(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        """Draft logits over the target's vocabulary, on the CPU (per-request CPU generators sample them;
        on a GPU this copy is also the step's synchronization point)."""
        return [align_vocab(x, self.vocab).float().cpu() for x in self.runner.forward(items)]

    def draft(self, jobs: list[Job], main: bool, poll=None) -> tuple[list[Chain], bool]:
        """Draft each job's chain up to num_draft tokens, all jobs batched per step. main=True extends
        the sequence's own cache (room reserved by the caller); otherwise each chain writes its KV to its
        scratch region. Stops early (stopped=True, chains partial) when `poll()` says the engine asks."""
        chains = []
        for j in jobs:
            c = j.chain or Chain(j.accepted, j.bonus, j.num_draft, torch.Generator().manual_seed(
                chain_seed(j.seq.params.seed, j.rnd, j.accepted, j.bonus)))
            if not main and c.region is None:
                c.region = self.cache.take_region()
            chains.append(c)
        temp = torch.tensor([j.seq.params.temperature for j in jobs])
        top_k = torch.tensor([j.seq.params.top_k for j in jobs], dtype=torch.long)
        top_p = torch.tensor([j.seq.params.top_p for j in jobs])
        while True:
            active = [i for i, c in enumerate(chains) if len(c.tokens) < jobs[i].num_draft]
            if not active:
                break
            if poll is not None and poll():
                log.debug("pre-draft stopped: the engine is asking")
                if not main:
                    self.chains_drafted += sum(1 for c in chains if c.tokens)
                return chains, True
            items = []
            for i in active:
                j, c = jobs[i], chains[i]
                s, cur = j.seq, len(c.tokens)
                pos = j.pos + cur                                # position of the token fed now
                if main:
                    start = min(s.cached, pos)
                    need = pos + 1 - self.bm.num_tokens(s.seq_id)
                    if need > 0:
                        self.bm.append(s.seq_id, need)     # reserved by the caller: cannot fail
                    items.append(ForwardItem(s.seq_id, (s.ctx + c.tokens)[start:pos + 1], start))
                    s.cached = pos + 1
                else:
                    feed = [j.bonus] if cur == 0 else [c.tokens[-1]]
                    main_slots = block_slots(self.bm.block_table(s.seq_id), self.bm.block_size, j.pos)
                    own = self.cache.region_slots(c.region)[:cur + 1]
                    items.append(ForwardItem(s.seq_id, feed, pos, 1, torch.cat([main_slots, own])))
            logits = torch.cat(self.logits(items))
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
            self.chains_drafted += len(jobs)
        return chains, False

    def catch_up(self, seqs: list[WorkerSeq]) -> list[WorkerSeq]:
        """Feed the speculation tokens a sequence's cache lacks and record the draft's distribution at
        every outcome position 0..K (the bonus candidates). Returns the sequences done; one whose cache
        has no room for its speculation is left out (it is not pre-drafted this round: a miss)."""
        items, idx, done = [], [], []
        for s in seqs:
            missing = [j for j in range(len(s.spec) + 1) if j not in s.dists]
            if not missing:
                done.append(s)
                continue
            toks = s.tokens
            first = len(s.ctx) - 1 + min(missing)     # feeding position p gives the distribution for p + 1
            start = min(s.cached, first)
            need = len(toks) - self.bm.num_tokens(s.seq_id)
            if need > 0:
                if not self.bm.can_append(s.seq_id, need):
                    continue
                self.bm.append(s.seq_id, need)
            items.append(ForwardItem(s.seq_id, toks[start:], start, len(toks) - first))
            idx.append((s, first))
            s.cached = len(toks)
            done.append(s)
        if items:
            for (s, first), lg in zip(idx, self.logits(items)):
                p = s.params
                temp = torch.tensor([max(p.temperature, 1.0) if p.greedy else p.temperature])
                pr = torch.softmax(lg / temp, dim=-1)
                for r in range(pr.shape[0]):
                    j = first + r - (len(s.ctx) - 1)
                    s.dists.setdefault(j, pr[r])
        return done

    def calibrate(self, ctx: int = 64, rows: int = 16, reps: int = 3) -> tuple[float, float]:
        """Time a draft step over 1 row and over `rows` rows (one row = one chain's next token) once at
        start: returns (one-row step seconds, marginal cost of a row relative to it)."""
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
        row_cost = min(1.0, max(0.0, (times[rows] / times[1] - 1) / (rows - 1)))
        log.info("draft step %.1f ms for 1 row, %.1f ms for %d rows (row cost %.2f)", 1e3 * times[1],
                 1e3 * times[rows], rows, row_cost)
        return times[1], row_cost
