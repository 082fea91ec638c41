"""Speculative decoding: the draft proposes up to K tokens per sequence, the target verifies them
in one forward, and the verifier keeps the target's exact distribution."""
from __future__ import annotations

import torch

from ssd.engine.engine import prefill, prefill_and_sample
from ssd.engine.model_runner import ForwardItem, ModelRunner
from ssd.engine.sampling import probs_for
from ssd.engine.sequence import Sequence
from ssd.layers.sampler import sample
from ssd.speculation.verify import verify_with_generators


class SDStep:
    def __init__(self, target: ModelRunner, draft: ModelRunner, k: int, tracer):
        if k < 1:
            raise ValueError(f"k (draft tokens per round) must be >= 1, got {k}")
        self.target, self.draft, self.k = target, draft, k
        self.max_spec_batch: int | None = None   # larger decode batches skip drafting (plain AR rounds)
        self.vocab = target.model.cfg.vocab_size
        self.tracer = tracer

    def prefill(self, seqs: list[Sequence]) -> None:
        with self.tracer.span("draft", "prefill"):
            prefill(self.draft, seqs, 1, num_logits=0)
        for seq in seqs:
            seq.draft_cached = len(seq)
        with self.tracer.span("target", "prefill"):
            prefill_and_sample(self.target, seqs)

    def propose(self, seqs: list[Sequence], k_eff: list[int]) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Draft up to k_eff[b] tokens for each sequence, batched across sequences.
        Returns proposed tokens and the proposal distributions they were sampled from."""
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(max(k_eff, default=0)):
            active = [b for b, s in enumerate(seqs) if k_eff[b] > j]
            if not active:
                break
            items = []
            for b in active:
                s = seqs[b]
                if j == 0:
                    items.append(ForwardItem(s.seq_id, s.all_token_ids[s.draft_cached:], s.draft_cached))
                else:
                    items.append(ForwardItem(s.seq_id, [tokens[b][-1]], len(s) + j - 1))
            logits = align_vocab(torch.cat(self.draft.forward(items)), self.vocab)
            act_seqs = [seqs[b] for b in active]
            q = probs_for(logits, act_seqs)
            drawn = sample(q, [s.generator for s in act_seqs]).tolist()
            for row, b in enumerate(active):
                tokens[b].append(drawn[row])
                probs[b].append(q[row])
        return tokens, [torch.stack(p) if p else None for p in probs]

    def _room_for_catch_up(self, seqs: list[Sequence], k_eff: list[int]) -> list[int]:
        """A draft that fell behind (one-token rounds under spec_max_batch) first feeds the tokens it
        missed, which needs more draft KV slots than the scheduler's K+1 lookahead: reserve them, or
        run a one-token round for that sequence when the draft cache has no room."""
        dbm = self.draft.block_manager
        out = []
        for s, k in zip(seqs, k_eff):
            need = len(s) + k - 1 - dbm.num_tokens(s.seq_id) if k else 0
            if need > 0:
                if dbm.can_append(s.seq_id, need):
                    dbm.append(s.seq_id, need)
                else:
                    k = 0
            out.append(k)
        return out

    def decode(self, seqs: list[Sequence]) -> None:
        k_eff = [max(0, min(self.k, s.remaining_tokens() - 1)) for s in seqs]
        if self.max_spec_batch is not None and len(seqs) > self.max_spec_batch:
            k_eff = [0] * len(seqs)   # the verify becomes a one-token decode; the draft catches up later
        else:
            k_eff = self._room_for_catch_up(seqs, k_eff)
        with self.tracer.span("draft", "draft"):
            drafts, qs = self.propose(seqs, k_eff)
        lens = [len(s) for s in seqs]
        with self.tracer.span("target", "verify"):
            accepted = verify_and_commit(self.target, seqs, drafts, qs)
        dbm = self.draft.block_manager
        for s, L, n, d, k in zip(seqs, lens, accepted, drafts, k_eff):
            fed_end = L + k - 1 if k else s.draft_cached
            s.draft_cached = min(L + n, fed_end)
            dbm.rollback(s.seq_id, dbm.num_tokens(s.seq_id) - s.draft_cached)
            dbm.commit(s.seq_id, (s.all_token_ids[:L] + d[:n])[:s.draft_cached])


def verify_and_commit(target: ModelRunner, seqs: list[Sequence], drafts: list[list[int]],
                      qs: list[torch.Tensor | None]) -> list[int]:
    """Verify each sequence's proposal in one target forward, commit accepted tokens + bonus, roll the
    target cache back to what was accepted. qs[b] is the distribution drafts[b] was sampled from
    ([k, V]); None means a deterministic proposal (one-hot q). Returns accepted lengths."""
    items = [ForwardItem(s.seq_id, s.all_token_ids[-1:] + d, len(s) - 1, len(d) + 1) for s, d in zip(seqs, drafts)]
    logits = target.forward(items)
    B, V = len(seqs), logits[0].shape[-1]
    kmax = max(max(len(d) for d in drafts), 1)
    p = torch.zeros(B, kmax + 1, V)
    q = torch.zeros(B, kmax, V)
    d_t = torch.zeros(B, kmax, dtype=torch.long)
    for b, (s, d) in enumerate(zip(seqs, drafts)):
        n = len(d)
        p[b, :n + 1] = probs_for(logits[b], [s] * (n + 1))
        if n:
            d_t[b, :n] = torch.tensor(d)
            if qs[b] is not None:
                q[b, :n] = qs[b][:, :V]
            else:
                q[b, torch.arange(n), d_t[b, :n]] = 1.0
    num = torch.tensor([len(d) for d in drafts])
    res = verify_with_generators(p, q, d_t, [s.generator for s in seqs], num)
    tbm = target.block_manager
    accepted = []
    for b, s in enumerate(seqs):
        n = int(res.accepted_len[b])
        L = len(s)
        tbm.rollback(s.seq_id, tbm.num_tokens(s.seq_id) - (L + n))
        tbm.commit(s.seq_id, s.all_token_ids + drafts[b][:n])
        s.spec.record(len(drafts[b]), n)
        s.append_tokens(drafts[b][:n] + [int(res.bonus_token[b])])
        accepted.append(n)
    return accepted

def align_vocab(draft_logits: torch.Tensor, vocab: int) -> torch.Tensor:
    """Draft logits over the target's vocabulary: extra (padding) rows are dropped, missing ones get
    -inf, so the draft samples only tokens both models share and q is exactly what was sampled."""
    n = draft_logits.shape[-1]
    if n == vocab:
        return draft_logits
    if n > vocab:
        return draft_logits[..., :vocab]
    pad = draft_logits.new_full((*draft_logits.shape[:-1], vocab - n), float("-inf"))
    return torch.cat([draft_logits, pad], dim=-1)
