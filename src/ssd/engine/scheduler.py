"""Continuous batching: admits waiting requests when KV blocks allow, keeps running ones
decoding, and preempts (free + recompute later) the newest sequence when blocks run out."""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from ssd.engine.block_manager import BlockManager
from ssd.engine.sequence import Sequence, SeqStatus

log = logging.getLogger(__name__)


@dataclass
class Schedule:
    prefill: list[Sequence] = field(default_factory=list)   # newly admitted: feed all tokens not cached
    decode: list[Sequence] = field(default_factory=list)    # running: one decode / speculation round
    preempted: list[Sequence] = field(default_factory=list)


class Scheduler:
    """`managers` are the block managers of every model that keeps a KV cache per sequence
    (target first, then the draft in SD). `lookahead` = slots a decode round needs per sequence."""

    def __init__(self, managers: list[BlockManager], max_num_seqs: int, max_num_batched_tokens: int,
                 lookahead: int = 1):
        self.managers = managers
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.lookahead = lookahead
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.on_release = None      # callback(seq) when a sequence leaves the running set

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> Schedule:
        """Admit waiting requests (their prompt blocks are allocated) or, when none can be admitted,
        reserve `lookahead` slots in every cache for each running sequence (preempting as needed).
        The step that runs the schedule rolls back whatever it reserved and did not use."""
        s = Schedule()
        budget = self.max_num_batched_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            toks = seq.all_token_ids
            if s.prefill and len(toks) > budget:
                break
            with_room = toks + [-1] * self.lookahead   # keep room for the first decode round
            if not all(m.can_allocate(with_room) for m in self.managers):
                break
            self.waiting.popleft()
            seq.num_cached = [m.allocate(seq.seq_id, toks) for m in self.managers]
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            s.prefill.append(seq)
            budget -= len(toks) - seq.num_cached[0]
        if s.prefill:
            return s
        i = 0
        while i < len(self.running):
            seq = self.running[i]
            if all(m.can_append(seq.seq_id, self.lookahead) for m in self.managers):
                for m in self.managers:
                    m.append(seq.seq_id, self.lookahead)
                s.decode.append(seq)
                i += 1
                continue
            victim = self.running[-1]      # the newest request yields its blocks
            self._preempt(victim)
            s.preempted.append(victim)
        return s

    def _preempt(self, seq: Sequence) -> None:
        for m in self.managers:
            m.free(seq.seq_id)
        if self.on_release:
            self.on_release(seq)
        self.running.remove(seq)
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1
        log.warning("KV cache full: preempted request %s (%d tokens); it will be recomputed",
                    seq.request_id, len(seq))

    def finish(self, seq: Sequence) -> None:
        for m in self.managers:
            if m.has(seq.seq_id):
                m.free(seq.seq_id)
        if seq in self.running:
            self.running.remove(seq)
            if self.on_release:
                self.on_release(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
