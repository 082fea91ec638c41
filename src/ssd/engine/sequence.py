"""A request's state inside the engine."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ssd.engine.detokenizer import IncrementalDetokenizer
from ssd.sampling_params import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecStats:
    """Speculation counters of one sequence (also summed for aggregates)."""

    rounds: int = 0                 # target forwards that verified drafts (decode steps in AR)
    draft_tokens: int = 0           # proposed draft tokens
    accepted_tokens: int = 0        # accepted draft tokens
    proposed_by_pos: list[int] = field(default_factory=list)
    accepted_by_pos: list[int] = field(default_factory=list)
    rounds_by_num_draft: list[int] = field(default_factory=list)   # [j]: rounds that proposed j tokens

    def record(self, num_draft: int, accepted: int) -> None:
        self.rounds += 1
        while len(self.rounds_by_num_draft) <= num_draft:
            self.rounds_by_num_draft.append(0)
        self.rounds_by_num_draft[num_draft] += 1
        self.draft_tokens += num_draft
        self.accepted_tokens += accepted
        grow = num_draft - len(self.proposed_by_pos)
        if grow > 0:
            self.proposed_by_pos += [0] * grow
            self.accepted_by_pos += [0] * grow
        for j in range(num_draft):
            self.proposed_by_pos[j] += 1
            self.accepted_by_pos[j] += int(j < accepted)

    def merge(self, other: "SpecStats") -> None:
        self.rounds += other.rounds
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        for j, n in enumerate(other.rounds_by_num_draft):
            if j >= len(self.rounds_by_num_draft):
                self.rounds_by_num_draft.append(0)
            self.rounds_by_num_draft[j] += n
        for j in range(len(other.proposed_by_pos)):
            if j >= len(self.proposed_by_pos):
                self.proposed_by_pos.append(0)
                self.accepted_by_pos.append(0)
            self.proposed_by_pos[j] += other.proposed_by_pos[j]
            self.accepted_by_pos[j] += other.accepted_by_pos[j]


@dataclass
class SpecState:
    """What the speculative step keeps for one sequence between rounds (docs/ARCHITECTURE.md 4)."""

    draft_cached: int = 0           # SD: tokens whose KV the in-process draft holds
    accepted: int = 0               # SSD: the last round's verification outcome (accepted, bonus),
    bonus: int | None = None        # reported to the worker with the next request
    num_draft: int = 0              # SSD: tokens the last round's speculation had (0: no speculation)
    detached: bool = False          # SSD: the worker does not hold this sequence (re-added before drafting)
    worker_held: int = 0            # SSD, while detached: its first tokens still prefix-cached on the worker
                                    # (dropped by a local stint: it prefills only the rest when re-added)
    cache_hits: int = 0             # SSD: rounds served from the speculation cache


class Sequence:
    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 tokenizer, eos_token_ids: list[int], max_model_len: int, prompt: str | None = None):
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.generator = None if params.seed is None else torch.Generator().manual_seed(params.seed)
        self.detok = IncrementalDetokenizer(tokenizer, params.stop)
        self.stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids))
        self.max_model_len = max_model_len
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.spec = SpecStats()
        self.spec_state = SpecState()
        self.num_cached: list[int] = []     # per KV cache (target, draft): prompt tokens found prefix-cached
        self.pending_text = ""      # text delta produced since the caller last collected it
        self.pending_tokens: list[int] = []
        self.output_logprobs: list | None = [] if params.logprobs is not None else None   # TokenLogprob each
        self.pending_logprobs: list = []

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.status == SeqStatus.FINISHED

    def remaining_tokens(self) -> int:
        """How many more tokens this sequence may produce."""
        return min(self.params.max_tokens - len(self.output_token_ids), self.max_model_len - len(self))

    def append_tokens(self, tokens: list[int], logprobs: list | None = None) -> int:
        """Append tokens one by one, stopping at a stop condition. Returns how many were kept.
        logprobs[j] (a TokenLogprob, when the request asked for them) goes with tokens[j]."""
        if self.first_token_time is None and tokens:
            self.first_token_time = time.perf_counter()
        kept = 0
        for t in tokens:
            self.output_token_ids.append(t)
            self.pending_tokens.append(t)
            if self.output_logprobs is not None and logprobs is not None:
                self.output_logprobs.append(logprobs[kept])
                self.pending_logprobs.append(logprobs[kept])
            kept += 1
            if t in self.stop_ids:
                self._finish("stop")
            elif self.remaining_tokens() <= 0:
                self._finish("length")
            visible = self.output_token_ids[:-1] if self.finish_reason == "stop" else self.output_token_ids
            self.pending_text += self.detok.update(visible, final=self.finished)
            if self.detok.stopped and not self.finished:
                self._finish("stop")
            if self.finished:
                break
        return kept

    def _finish(self, reason: str) -> None:
        self.status = SeqStatus.FINISHED
        self.finish_reason = reason
        self.finish_time = time.perf_counter()

    def take_pending(self) -> tuple[str, list[int], list]:
        text, toks, lps = self.pending_text, self.pending_tokens, self.pending_logprobs
        self.pending_text, self.pending_tokens, self.pending_logprobs = "", [], []
        return text, toks, lps
