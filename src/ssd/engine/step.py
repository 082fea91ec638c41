"""The one decoding-step interface the engine loop knows (docs/ARCHITECTURE.md 4), and the prefill
helpers every step shares. AR (`engine/ar.py`) is one implementation; the speculative step
(`speculation/step.py`) serves SD and SSD."""
from __future__ import annotations

from typing import Protocol

import torch

from ssd.engine.model_runner import ForwardItem, ModelRunner
from ssd.engine.logprobs import logprob_rows, token_logprobs, wanted
from ssd.engine.sampling import probs_for, sample_tokens
from ssd.engine.sequence import Sequence


class DecodeStep(Protocol):
    def prefill(self, seqs: list[Sequence]) -> None:
        """Feed the sequences' uncached tokens and append each one's first new token."""

    def decode(self, seqs: list[Sequence]) -> None:
        """One round for each running sequence: append at least one committed token each."""

    def release(self, seq: Sequence) -> None:
        """The scheduler dropped `seq` (finished, aborted or preempted): forget any state held for it."""


def prefill(runner: ModelRunner, seqs: list[Sequence], which: int, num_logits: int = 1) -> list[torch.Tensor]:
    """Feed every sequence's uncached tokens (cache `which` of seq.num_cached) through `runner`."""
    items = []
    for seq in seqs:
        toks = seq.all_token_ids
        c = seq.num_cached[which]
        items.append(ForwardItem(seq.seq_id, toks[c:], c, num_logits))
    out = runner.forward(items)
    for seq in seqs:
        runner.block_manager.commit(seq.seq_id, seq.all_token_ids)
    return out


def prefill_and_sample(target: ModelRunner, seqs: list[Sequence]) -> None:
    logits = torch.cat(prefill(target, seqs, 0))
    sample_and_append(logits, seqs)


def sample_and_append(logits: torch.Tensor, seqs: list[Sequence]) -> None:
    """One token per sequence from its row of `logits` (with its logprobs when asked for)."""
    toks = sample_tokens(logits, seqs)
    lps = autoregressive_logprobs(logits, seqs, toks) if wanted(seqs) else [None] * len(seqs)
    for seq, tok, lp in zip(seqs, toks, lps):
        seq.append_tokens([tok], lp)


def autoregressive_logprobs(logits: torch.Tensor, seqs: list[Sequence], toks: list[int]) -> list:
    out = []
    for b, (s, t) in enumerate(zip(seqs, toks)):
        if s.params.logprobs is None:
            out.append(None)
            continue
        row = logits[b:b + 1]
        rows = logprob_rows(row, None if s.params.greedy else probs_for(row, [s]), s.params)
        out.append(token_logprobs(rows, [t], s.params.logprobs))
    return out
