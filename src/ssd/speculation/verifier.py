"""The verifier glue: score a round's speculations with one target forward, run the exact
rejection sampling of verify.py, commit what was accepted (docs/ARCHITECTURE.md 1)."""
from __future__ import annotations

import torch

from ssd.engine.logprobs import logprob_rows, token_logprobs
from ssd.engine.model_runner import ForwardItem, ModelRunner
from ssd.engine.sampling import probs_for
from ssd.engine.sequence import Sequence
from ssd.speculation.verify import verify_with_generators


def verify_and_commit(target: ModelRunner, seqs: list[Sequence], drafts: list[list[int]],
                      qs: list[torch.Tensor | None]) -> list[int]:
    """Verify each sequence's speculation in one target forward, commit the accepted tokens and the bonus,
    roll the target's cache back to what was accepted. qs[b] is the distribution drafts[b] was sampled
    from ([num_draft, V]); None means a deterministic proposal (one-hot q). A sequence with no draft gets
    one token sampled from the target (an autoregressive step). Returns accepted lengths."""
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
        committed = drafts[b][:n] + [int(res.bonus_token[b])]
        lps = None
        if s.params.logprobs is not None:     # the same rows an AR step would have scored these positions with
            rows = logprob_rows(logits[b][:n + 1], p[b, :n + 1], s.params)
            lps = token_logprobs(rows, committed, s.params.logprobs)
        s.append_tokens(committed, lps)
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
