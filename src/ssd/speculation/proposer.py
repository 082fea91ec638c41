"""What the speculative step asks of a proposer (docs/ARCHITECTURE.md 4): SD's in-process draft
(`local_proposer.py`) and SSD's draft worker (`worker/proposer.py`) both implement it."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from ssd.engine.sequence import Sequence


class ProposerFailed(RuntimeError):
    """The proposer cannot go on (the draft worker died or stopped answering)."""


@dataclass
class Proposal:
    """One round's speculation: per sequence the draft tokens and the distributions they were sampled
    from ([num_draft, V]; None for a deterministic proposal, i.e. one-hot), and for SSD where each came
    from (a `worker.messages.Source`)."""

    tokens: list[list[int]]
    probs: list[torch.Tensor | None]
    sources: list[int] | None = None
    spans: list[tuple[str, float, float]] = field(default_factory=list)   # proposer-side timeline
    worker_busy_s: float | None = None          # SSD: cumulative worker busy time
    chains_drafted: int | None = None           # SSD: cumulative pre-drafted chains


class Proposer(Protocol):
    name: str                                   # "draft" (SD) | "worker" (SSD)

    def prefill(self, seqs: list[Sequence]) -> None:
        """Before the target's prefill of `seqs` (new, or recomputed after a preemption)."""

    def after_prefill(self, seqs: list[Sequence]) -> None:
        """After the target's prefill appended each sequence's first token."""

    def propose(self, seqs: list[Sequence], num_draft: list[int], verify_s: float) -> Proposal:
        """At most num_draft[b] tokens for each sequence (0: none). Raises ProposerFailed."""

    def behind(self, seqs: list[Sequence]) -> list[int]:
        """Tokens each sequence's draft must catch up on before it can draft (0 when in step)."""

    def observe(self, seqs: list[Sequence], lens: list[int], accepted: list[int], proposal: Proposal) -> None:
        """After verification: sequence b had lens[b] tokens before the round and accepted accepted[b]."""

    def skip(self, seqs: list[Sequence]) -> None:
        """These sequences run a round without a speculation (the batch is over spec_max_batch)."""

    def release(self, seq: Sequence) -> None:
        """The sequence left the running set: drop its draft state."""
