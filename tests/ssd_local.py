"""An in-process stand-in for the SSD draft worker process (same interface as DraftClient), so tests
can force every round to be a hit (pre-draft fully before answering) or a miss, and can tamper with
what the worker ships. The real process path is tested separately in test_ssd.py."""
from __future__ import annotations

import torch

from ssd.engine.model_runner import ModelRunner
from ssd.models.loader import load_model
from ssd.speculation.draft_worker import DraftWorker, SeqParams


class LocalDraftClient:
    def __init__(self, draft_path, k: int, predraft: bool = True, tamper=None, stop_after_steps: int | None = None,
                 **worker_kw):
        lm = load_model(str(draft_path), "float32", "cpu", 512, progress=False)
        self.worker = DraftWorker(ModelRunner(lm.model, 512, 16, torch.device("cpu")), lm.config.vocab_size, k,
                                  **worker_kw)
        self.predraft = predraft
        self.tamper = tamper
        self.stop_after_steps = stop_after_steps   # simulate the engine asking mid pre-draft

    def add(self, seq, tokens=None) -> None:
        p = seq.params
        self.worker.add(seq.seq_id, seq.all_token_ids if tokens is None else tokens,
                        SeqParams(p.temperature, p.top_k, p.top_p, p.seed if p.seed is not None else 0))

    def free(self, ids) -> None:
        for i in ids:
            self.worker.free(i)

    def speculate(self, reqs, vocab, verify_s=0.0):
        self.worker.observe_verify(verify_s)
        if self.predraft:
            polls = iter(range(10**9))
            stop = self.stop_after_steps
            self.worker.predraft(poll=None if stop is None else (lambda: next(polls) >= stop))
        replies = self.worker.speculate([tuple(r) for r in reqs])
        if self.tamper:
            replies = [self.tamper(self.worker, r) for r in replies]
        codes = [{"cache": 1, "neural": 0, "fast": 2, "none": 0, "partial": 3}[r.backup] for r in replies]
        spans = [({1: "answer", 2: "predraft", 3: "prefill"}[k], a, b) for k, a, b in self.worker.spans]
        self.worker.spans.clear()
        return ([r.tokens for r in replies], [r.probs for r in replies], codes, self.worker.busy_s,
                self.worker.stats["chains_drafted"], spans)

    def abandon(self) -> None:
        pass

    def close(self) -> None:
        pass


def local_ssd(monkeypatch, target, draft, k=3, llm_kw=None, **kw):
    """LLM(mode='ssd') whose draft worker runs in-process."""
    from ssd import LLM

    client = {}

    def start(self, runner):
        client["c"] = LocalDraftClient(draft, k, **kw)
        return client["c"]

    monkeypatch.setattr(LLM, "_start_worker", start)
    llm = LLM(str(target), draft=str(draft), mode="ssd", k=k, dtype="float32", progress=False, **(llm_kw or {}))
    return llm, client["c"]
