"""SD's proposer: the draft model in the engine's process, batched across sequences; its KV cache is
managed by the engine's scheduler next to the target's."""
from __future__ import annotations

import torch

from ssd.engine.model_runner import ForwardItem, ModelRunner
from ssd.engine.sampling import probs_for
from ssd.engine.sequence import Sequence
from ssd.engine.step import prefill
from ssd.layers.sampler import sample
from ssd.speculation.proposer import Proposal
from ssd.speculation.verifier import align_vocab


class DraftProposer:
    name = "draft"

    def __init__(self, draft: ModelRunner, vocab: int, tracer, lazy: bool = False):
        self.draft, self.vocab, self.tracer = draft, vocab, tracer
        # lazy (mode "auto"): no draft prefill unless the step asks for one (`eager`); the draft feeds
        # the prompt the first time it drafts for the sequence (the chooser weighs that catch-up
        # against the rest of the request)
        self.lazy = lazy

    def prefill(self, seqs: list[Sequence], eager: bool = False) -> None:
        if self.lazy and not eager:
            for seq in seqs:       # only the prefix-cached part is in the draft's cache (never commit more)
                seq.spec_state.draft_cached = seq.num_cached[1]
            return
        with self.tracer.span("draft", "prefill"):
            prefill(self.draft, seqs, 1, num_logits=0)
        for seq in seqs:
            seq.spec_state.draft_cached = len(seq)

    def after_prefill(self, seqs: list[Sequence]) -> None:
        pass

    def propose(self, seqs: list[Sequence], num_draft: list[int], verify_s: float = 0.0) -> Proposal:
        num_draft = self._room_for_catch_up(seqs, num_draft)
        with self.tracer.span("draft", "draft"):
            tokens, probs = self._draft(seqs, num_draft)
        return Proposal(tokens, probs)

    def _draft(self, seqs: list[Sequence], num_draft: list[int]):
        """Up to num_draft[b] tokens per sequence, batched across sequences, with the distributions
        they were sampled from."""
        tokens: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        for j in range(max(num_draft, default=0)):
            active = [b for b, n in enumerate(num_draft) if n > j]
            items = []
            for b in active:
                s = seqs[b]
                if j == 0:
                    c = s.spec_state.draft_cached
                    items.append(ForwardItem(s.seq_id, s.all_token_ids[c:], c))
                else:
                    items.append(ForwardItem(s.seq_id, [tokens[b][-1]], len(s) + j - 1))
            logits = align_vocab(torch.cat(self.draft.forward(items)), self.vocab)
            act = [seqs[b] for b in active]
            q = probs_for(logits, act)
            drawn = sample(q, [s.generator for s in act]).tolist()
            for row, b in enumerate(active):
                tokens[b].append(drawn[row])
                probs[b].append(q[row])
        return tokens, [torch.stack(p) if p else None for p in probs]

    def _room_for_catch_up(self, seqs: list[Sequence], num_draft: list[int]) -> list[int]:
        """A draft that fell behind (rounds without a speculation under spec_max_batch) first feeds the
        tokens it missed, which needs more draft KV slots than the scheduler's K+1 lookahead: reserve
        them, or draft nothing for that sequence this round when the draft cache has no room."""
        dbm = self.draft.block_manager
        out = []
        for s, n in zip(seqs, num_draft):
            need = len(s) + n - 1 - dbm.num_tokens(s.seq_id) if n else 0
            if need > 0:
                if dbm.can_append(s.seq_id, need):
                    dbm.append(s.seq_id, need)
                else:
                    n = 0
            out.append(n)
        return out

    def behind(self, seqs: list[Sequence]) -> list[int]:
        return [max(0, len(s) - 1 - s.spec_state.draft_cached) for s in seqs]

    def observe(self, seqs: list[Sequence], lens: list[int], accepted: list[int], proposal: Proposal) -> None:
        """Roll the draft's cache back to what the target accepted (of what the draft was fed)."""
        dbm = self.draft.block_manager
        for s, L, n, d in zip(seqs, lens, accepted, proposal.tokens):
            st = s.spec_state
            fed_end = L + len(d) - 1 if d else st.draft_cached
            st.draft_cached = min(L + n, fed_end)
            dbm.rollback(s.seq_id, dbm.num_tokens(s.seq_id) - st.draft_cached)
            dbm.commit(s.seq_id, (s.all_token_ids[:L] + d[:n])[:st.draft_cached])

    def skip(self, seqs: list[Sequence]) -> None:
        pass        # the draft catches up on the tokens it missed when it drafts again

    def release(self, seq: Sequence) -> None:
        pass        # the scheduler frees the draft's KV with the target's
