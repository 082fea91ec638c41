"""SSD's proposer: asks the draft workers (other processes, possibly other hosts) for each round's
speculation; they pre-drafted most of it while the target verified the previous round.

With several workers (data-parallel drafts, docs/ARCHITECTURE.md 4.2) each sequence lives on one
worker (`assign.py`); a round sends every worker its share first and then collects the replies, so
the workers draft at the same time, and the replies are merged back in batch order. One worker is
the M = 1 case of the same code.

A worker that fails (dies, stops answering, answers nonsense) is abandoned; only its sequences are
affected: this round they get no draft (one target-sampled token, exact), then they are re-added,
with their whole context, to the least loaded live worker, which catches up on them. When no
worker is left the proposer raises `ProposerFailed` and the engine continues with local AR.
"""
from __future__ import annotations

import logging

import torch

from ssd.engine.sequence import Sequence
from ssd.speculation.proposer import Proposal, ProposerFailed
from ssd.speculation.stats import SpecCounters
from ssd.speculation.worker import messages as m
from ssd.speculation.worker.assign import Assignment

log = logging.getLogger(__name__)

# relayed to the engine's trace ("draft" track); its prefills named apart from the in-process draft's
_SPAN_NAMES = {m.SpanKind.ANSWER: "answer", m.SpanKind.PREDRAFT: "predraft", m.SpanKind.PREFILL: "worker prefill"}


class WorkerProposer:
    name = "worker"

    def __init__(self, clients, counters: SpecCounters | None = None):
        self.clients = list(clients) if isinstance(clients, (list, tuple)) else [clients]
        self.assign = Assignment(len(self.clients))
        self.counters = counters or SpecCounters()
        self.counters.draft_workers = len(self.clients)
        self._busy = [0.0] * len(self.clients)       # each worker's cumulative busy time / chains
        self._chains = [0] * len(self.clients)
        self._prefilled = [(0, 0.0)] * len(self.clients)   # each worker's cumulative prefill (tokens, seconds)

    # ---- workers ------------------------------------------------------------------------------
    def _fail(self, w: int, error: BaseException) -> None:
        """Give up on worker w for good (a hung worker would make every later message wait for the
        timeout); its sequences move to the other workers. Raises ProposerFailed if none is left."""
        if not self.assign.live[w]:
            return
        self.clients[w].abandon()
        gone = self.assign.fail(w)
        c = self.counters
        c.worker_failures += 1
        left = self.assign.num_live()
        where = getattr(self.clients[w], "address", f"#{w}")
        if left:
            c.seqs_moved += len(gone)
            log.error("draft worker %d (%s) failed (%s: %s); its %d sequence(s) move to the %d other worker(s)",
                      w, where, type(error).__name__, error, len(gone), left)
            return
        raise ProposerFailed(f"draft worker {w} ({where}), the last one, failed: {type(error).__name__}: {error}") \
            from error

    def _home(self, s: Sequence) -> int:
        """The live worker of `s` (placing it on one if it has none)."""
        w = self.assign.place(s.seq_id)
        if w is None:
            raise ProposerFailed("no draft worker is live")
        return w

    def _attach(self, s: Sequence, tokens: list[int]) -> None:
        """Give `s` to its worker (or, if that fails, to the next live one) with these tokens."""
        p = s.params
        seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,)))
        while True:
            w = self._home(s)
            try:
                self.clients[w].add(m.Add(s.seq_id, seed, p.temperature, p.top_k, p.top_p, list(tokens)))
                return
            except Exception as e:      # noqa: BLE001 - any failure of the link is the worker's failure
                self._fail(w, e)

    def _free(self, seqs: list[Sequence]) -> None:
        by_worker: dict[int, list[int]] = {}
        for s in seqs:
            w = self.assign.get(s.seq_id)
            if w is not None:
                by_worker.setdefault(w, []).append(s.seq_id)
        for w, ids in by_worker.items():
            try:
                self.clients[w].free(ids)
            except Exception as e:      # noqa: BLE001
                self._fail(w, e)

    # ---- the Proposer interface ---------------------------------------------------------------
    def prefill(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self._attach(s, s.all_token_ids)

    def after_prefill(self, seqs: list[Sequence]) -> None:
        for s in seqs:
            self._attached(s, s.output_token_ids[-1])

    @staticmethod
    def _attached(s: Sequence, bonus: int) -> None:
        """The worker holds every token of `s` but the last: report it as outcome (0 accepted, bonus)."""
        st = s.spec_state
        st.accepted, st.bonus, st.num_draft, st.detached, st.worker_held = 0, bonus, 0, False, 0

    def propose(self, seqs: list[Sequence], num_draft: list[int], verify_s: float = 0.0) -> Proposal:
        self._hand_over(seqs)
        groups: dict[int, list[int]] = {}
        for b, s in enumerate(seqs):
            groups.setdefault(self.assign.get(s.seq_id), []).append(b)
        posted = {}
        for w, rows in groups.items():          # every worker is asked first ...
            reqs = [m.Request(seqs[b].seq_id, seqs[b].spec_state.accepted, seqs[b].spec_state.bonus, num_draft[b])
                    for b in rows]
            try:
                posted[w] = self.clients[w].post_speculate(reqs, verify_s)
            except Exception as e:      # noqa: BLE001
                self._fail(w, e)
        sent = []
        for w, handle in posted.items():
            try:
                handle.wait()
                sent.append(w)
            except Exception as e:      # noqa: BLE001
                self._fail(w, e)
        replies: list[m.Reply | None] = [None] * len(seqs)
        spans = []
        for w in sent:                          # ... then the replies are collected
            try:
                ans = self.clients[w].recv_speculation()
                if [r.seq_id for r in ans.replies] != [seqs[b].seq_id for b in groups[w]]:
                    raise ProposerFailed("the draft worker answered for other sequences than asked")
            except Exception as e:      # noqa: BLE001
                self._fail(w, e)
                continue
            for b, r in zip(groups[w], ans.replies):
                replies[b] = r
            self._busy[w], self._chains[w] = ans.busy_s, ans.chains_drafted
            self._prefilled[w] = (ans.prefill_tokens, ans.prefill_s)
            prefix = f"w{w} " if len(self.clients) > 1 else ""
            spans += [(prefix + _SPAN_NAMES.get(k, "draft"), a, z) for k, a, z in ans.spans]
        tokens, probs, sources = [], [], []
        for r, n, s in zip(replies, num_draft, seqs):
            if r is None:                       # its worker failed this round: no draft, moved next round
                s.spec_state.detached, s.spec_state.worker_held = True, 0
                tokens.append([])
                probs.append(None)
                sources.append(int(m.Source.NONE))
                continue
            toks, q = r.tokens[:n], None if r.probs is None else r.probs[:n]   # trust, but check the length
            if r.source == m.Source.NO_ROOM:
                s.spec_state.detached, s.spec_state.worker_held = True, 0   # dropped: re-added next round
            tokens.append(toks)
            probs.append(q)
            sources.append(int(r.source))
        return Proposal(tokens, probs, sources, spans, sum(self._busy), sum(self._chains))

    def _hand_over(self, seqs: list[Sequence]) -> None:
        """Make every sequence held by a live worker: (re-)add those without one (new worker after a
        failure, or dropped by skip/NO_ROOM). An add that fails moves that worker's sequences, maybe
        some handed over a moment ago, so repeat until all are held (each pass kills a worker or ends)."""
        while True:
            todo = [s for s in seqs if s.spec_state.detached or self.assign.get(s.seq_id) is None]
            if not todo:
                return
            for s in todo:
                self._attach(s, s.all_token_ids[:-1])
                self._attached(s, s.all_token_ids[-1])

    def prefill_s_per_token(self, min_tokens: int = 64) -> float | None:
        """Seconds per token of the workers' prefills of the sequences added to them (prompts at arrival,
        hand-overs, keep_in_step), over all they reported so far; None before `min_tokens` tokens."""
        tokens = sum(t for t, _ in self._prefilled)
        return sum(s for _, s in self._prefilled) / tokens if tokens >= min_tokens else None

    def behind(self, seqs: list[Sequence]) -> list[int]:
        return [0] * len(seqs)          # the worker keeps up by itself (or is handed the sequence back)

    def observe(self, seqs: list[Sequence], lens: list[int], accepted: list[int], proposal: Proposal) -> None:
        for s, n, d, src in zip(seqs, accepted, proposal.tokens, proposal.sources or [0] * len(seqs)):
            st = s.spec_state
            st.accepted, st.bonus, st.num_draft = n, s.output_token_ids[-1], len(d)
            st.cache_hits += src == m.Source.CACHE

    def skip(self, seqs: list[Sequence]) -> None:
        """Rounds without the workers: they drop these sequences now and get them back (prefix-cached,
        so only the new tokens are recomputed) when speculation resumes. A sequence keeps its worker."""
        gone = [s for s in seqs if not s.spec_state.detached]
        for s in gone:
            s.spec_state.detached = True
            # it has committed all but the last round's outcome (accepted drafts and bonus), which it was
            # to learn with the next request; its prefix cache keeps whole blocks of that
            s.spec_state.worker_held = max(len(s) - 1 - s.spec_state.accepted, 0)
        self._free(gone)

    def keep_in_step(self, seqs: list[Sequence]) -> int:
        """Local rounds in which the workers' cores would sit idle (auto_ssd with the worker on cores of its
        own): each dropped sequence with one more whole block of context than its worker holds is added
        again with its whole blocks and dropped again, so the worker prefills the new block now, in its
        idle time, into its prefix cache; the hand-over after the local stint then prefills at most the
        last partial block. Without it that hand-over prefilled everything committed since the drop while
        the target waited (priced per token: the worker regime's prediction fell with every local round,
        35.2 -> 32.8 tok/s over three stints in the paper placement at batch 4). Posted, not waited for.
        -> tokens sent to be prefilled."""
        sent, again = 0, []
        for s in seqs:
            st = s.spec_state
            if not st.detached or self.assign.get(s.seq_id) is None:
                continue
            bs = self._block_size(self.assign.get(s.seq_id))
            whole = (len(s) - 1) // bs * bs         # the last token's KV is computed when it is drafted from
            held = st.worker_held // bs * bs        # a dropped sequence's partial last block is not cached
            if whole <= held:
                continue
            self._attach(s, s.all_token_ids[:whole])
            st.worker_held = whole
            sent += whole - held
            again.append(s)
        self._free(again)
        return sent

    def _block_size(self, w: int) -> int:
        config = getattr(self.clients[w], "config", None)
        return getattr(config, "block_size", 16)

    def settle(self) -> None:
        """Wait until every live worker has received what was posted to it (so it has stopped drafting
        for sequences it was told to drop)."""
        for w, client in enumerate(self.clients):
            if self.assign.live[w]:
                try:
                    client.settle()
                except Exception as e:      # noqa: BLE001
                    self._fail(w, e)

    def release(self, seq: Sequence) -> None:
        if not seq.spec_state.detached:
            self._free([seq])
        self.assign.drop(seq.seq_id)
