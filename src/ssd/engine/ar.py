"""Autoregressive decoding: one target forward per token."""
from __future__ import annotations

import torch

from ssd.engine.model_runner import ForwardItem, ModelRunner
from ssd.engine.sampling import sample_tokens
from ssd.engine.sequence import Sequence
from ssd.engine.logprobs import wanted
from ssd.engine.step import autoregressive_logprobs, prefill_and_sample


class ARStep:
    def __init__(self, target: ModelRunner, tracer):
        self.target = target
        self.tracer = tracer

    def prefill(self, seqs: list[Sequence]) -> None:
        with self.tracer.span("target", "prefill"):
            prefill_and_sample(self.target, seqs)

    def decode(self, seqs: list[Sequence]) -> None:
        """Each sequence's last token is not cached yet: feed it, sample the next."""
        items = [ForwardItem(s.seq_id, s.all_token_ids[-1:], len(s) - 1) for s in seqs]
        with self.tracer.span("target", "decode"):
            logits = torch.cat(self.target.forward(items))
        bm = self.target.block_manager
        toks = sample_tokens(logits, seqs)
        lps = autoregressive_logprobs(logits, seqs, toks) if wanted(seqs) else [None] * len(seqs)
        for seq, tok, lp in zip(seqs, toks, lps):
            seq.spec.record(0, 0)
            seq.append_tokens([tok], lp)
            if not seq.finished:
                done = len(seq) - 1          # everything but the new token is cached
                bm.rollback(seq.seq_id, bm.num_tokens(seq.seq_id) - done)   # unused reserved slots
                bm.commit(seq.seq_id, seq.all_token_ids[:done])

    def release(self, seq: Sequence) -> None:
        pass
