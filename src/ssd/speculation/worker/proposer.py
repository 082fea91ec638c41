"""SSD's proposer: asks the draft worker (another process, possibly another host) for each round's
speculation; the worker pre-drafted most of them while the target verified the previous round."""
from __future__ import annotations

import torch

from ssd.engine.sequence import Sequence
from ssd.speculation.proposer import Proposal, ProposerFailed
from ssd.speculation.worker import messages as m
from ssd.speculation.worker.client import DraftClient

_SPAN_NAMES = {m.SpanKind.ANSWER: "answer", m.SpanKind.PREDRAFT: "predraft", m.SpanKind.PREFILL: "prefill"}


class WorkerProposer:
    name = "worker"

    def __init__(self, client: DraftClient):
        self.client = client

    def _call(self, fn, *args):
        try:
            return fn(*args)
        except Exception as e:
            # dead or silent: stop it for good (a hung worker would make every later message wait for
            # the timeout), the engine falls back to local decoding
            self.client.abandon()
            raise ProposerFailed(f"{type(e).__name__}: {e}") from e

    def _add(self, s: Sequence, tokens: list[int]) -> None:
        p = s.params
        seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,)))
        self._call(self.client.add, m.Add(s.seq_id, seed, p.temperature, p.top_k, p.top_p, list(tokens)))

    def prefill(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self._add(s, s.all_token_ids)

    def after_prefill(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self._attached(s, s.output_token_ids[-1])

    @staticmethod
    def _attached(s: Sequence, bonus: int) -> None:
        """The worker holds every token of `s` but the last: report it as outcome (0 accepted, bonus)."""
        st = s.spec_state
        st.accepted, st.bonus, st.num_draft, st.detached = 0, bonus, 0, False

    def propose(self, seqs: list[Sequence], num_draft: list[int], verify_s: float = 0.0) -> Proposal:
        for s in seqs:
            if s.spec_state.detached:           # hand it back as after a prefill
                self._add(s, s.all_token_ids[:-1])
                self._attached(s, s.all_token_ids[-1])
        reqs = [m.Request(s.seq_id, s.spec_state.accepted, s.spec_state.bonus, n) for s, n in zip(seqs, num_draft)]
        ans = self._call(self.client.speculate, reqs, verify_s)
        if [r.seq_id for r in ans.replies] != [s.seq_id for s in seqs]:
            self.client.abandon()
            raise ProposerFailed("the draft worker answered for other sequences than asked")
        tokens, probs, sources = [], [], []
        for r, n, s in zip(ans.replies, num_draft, seqs):
            toks, q = r.tokens[:n], None if r.probs is None else r.probs[:n]   # trust, but check the length
            if r.source == m.Source.NO_ROOM:
                s.spec_state.detached = True        # the worker dropped it: re-added next round
            tokens.append(toks)
            probs.append(q)
            sources.append(int(r.source))
        spans = [(_SPAN_NAMES.get(k, "draft"), a, b) for k, a, b in ans.spans]
        return Proposal(tokens, probs, sources, spans, ans.busy_s, ans.chains_drafted)

    def behind(self, seqs: list[Sequence]) -> list[int]:
        return [0] * len(seqs)          # the worker keeps up by itself (or is handed the sequence back)

    def observe(self, seqs: list[Sequence], lens: list[int], accepted: list[int], proposal: Proposal) -> None:
        for s, n, d, src in zip(seqs, accepted, proposal.tokens, proposal.sources or [0] * len(seqs)):
            st = s.spec_state
            st.accepted, st.bonus, st.num_draft = n, s.output_token_ids[-1], len(d)
            st.cache_hits += src == m.Source.CACHE

    def skip(self, seqs: list[Sequence]) -> None:
        """Rounds without the worker: it drops these sequences now and gets them back (prefix-cached,
        so only the new tokens are recomputed) when speculation resumes."""
        gone = [s for s in seqs if not s.spec_state.detached]
        for s in gone:
            s.spec_state.detached = True
        if gone:
            self._call(self.client.free, [s.seq_id for s in gone])

    def release(self, seq: Sequence) -> None:
        self._call(self.client.free, [seq.seq_id])
