"""An in-process stand-in for the SSD draft worker process (same interface as DraftClient), so tests
can force every round to be a hit (pre-draft fully before answering) or a miss, and can tamper with
what the worker ships. The real process path is tested separately in test_ssd.py."""
from __future__ import annotations

import torch

from ssd.engine.model_runner import ModelRunner
from ssd.models.loader import load_model
from ssd.speculation.worker import messages as m
from ssd.speculation.worker.worker import DraftWorker, pool_size


class LocalDraftClient:
    def __init__(self, draft_path, k: int, predraft: bool = True, tamper=None, stop_after_steps: int | None = None,
                 num_blocks: int = 512, max_num_seqs: int = 16, target_vocab: int | None = None, **worker_kw):
        lm = load_model(str(draft_path), "float32", "cpu", 512, progress=False)
        blocks, regions = pool_size(num_blocks, k, 16, max_num_seqs, 8)
        runner = ModelRunner(lm.model, blocks, 16, torch.device("cpu"))
        self.worker = DraftWorker(runner, target_vocab or lm.config.vocab_size, k, num_regions=regions, **worker_kw)
        self.predraft = predraft
        self.tamper = tamper
        self.stop_after_steps = stop_after_steps   # simulate the engine asking mid pre-draft
        self.pid = None
        self.fail_at_round = None   # simulate a worker that dies while answering round n (1-based)
        self.rounds = 0
        self.dead = False

    def add(self, msg: m.Add) -> None:
        if self.dead:
            raise ConnectionError("stand-in worker is dead")
        self.worker.add(msg)

    def free(self, ids) -> None:
        if self.dead:
            raise ConnectionError("stand-in worker is dead")
        for i in ids:
            self.worker.free(i)

    def speculate(self, requests, verify_s=0.0) -> m.Speculation:
        self.post_speculate(requests, verify_s).wait()
        return self.recv_speculation()

    def post_speculate(self, requests, verify_s=0.0):
        if self.dead:
            raise ConnectionError("stand-in worker is dead")
        self._asked = (list(requests), verify_s)
        return _Sent()

    def recv_speculation(self) -> m.Speculation:
        requests, verify_s = self._asked
        self.rounds += 1
        if self.fail_at_round is not None and self.rounds >= self.fail_at_round:
            self.dead = True
        if self.dead:
            raise ConnectionError("stand-in worker died")
        self.worker.observe_verify(verify_s)
        if self.predraft:
            polls = iter(range(10**9))
            stop = self.stop_after_steps
            self.worker.predraft(poll=None if stop is None else (lambda: next(polls) >= stop))
        replies = self.worker.speculate(list(requests))
        if self.tamper:
            replies = [self.tamper(self.worker, r) for r in replies]
        return m.Speculation(replies, self.worker.chains_drafted, self.worker.busy_s, self.worker.take_spans(),
                             self.worker.prefill_tokens, self.worker.prefill_s)

    def abandon(self) -> None:
        self.dead = True

    def close(self) -> None:
        pass


class _Sent:
    def wait(self) -> None:
        pass


def local_ssd(monkeypatch, target, draft, k=3, llm_kw=None, workers: int = 1, **kw):
    """LLM(mode='ssd') whose draft worker(s) run in-process. Returns (llm, client), or (llm, [clients])
    with workers > 1 (data-parallel drafts)."""
    from ssd import LLM

    clients = []

    def start(self, runner):
        kw.setdefault("num_blocks", min(runner.block_manager.num_blocks, 512))   # tiny models: plenty, and cheap
        kw.setdefault("max_num_seqs", self.config.max_num_seqs)
        kw.setdefault("target_vocab", self.target.config.vocab_size)
        clients.extend(LocalDraftClient(draft, k, **kw) for _ in range(workers))
        return clients[0] if workers == 1 else list(clients)

    monkeypatch.setattr(LLM, "_start_worker", start)
    llm = LLM(str(target), draft=str(draft), mode="ssd", k=k, dtype="float32", progress=False, **(llm_kw or {}))
    return llm, clients[0] if workers == 1 else clients


def random_regime(monkeypatch) -> None:
    """auto_ssd: replace the regime policy's decision by a pseudo-random one (deterministic: a hash of
    the round number), so the worker and the in-process draft alternate in about half the rounds."""
    import hashlib

    from ssd.speculation.regime import LOCAL, WORKER, RegimePolicy

    def pick(self, batch_size, predict=None):
        self.rounds += 1
        if predict is not None:         # exercise the caller's model (kept for the test to look at)
            self.__dict__.setdefault("predictions", []).append((predict(LOCAL), predict(WORKER)))
        if self.enabled:
            h = int(hashlib.blake2b(str(self.rounds).encode(), digest_size=2).hexdigest(), 16)
            new = WORKER if h % 2 else LOCAL
            self.switches += new != self.current
            self.current = new
        return self.current
    monkeypatch.setattr(RegimePolicy, "pick", pick)


def random_chooser(monkeypatch) -> None:
    """mode auto: replace the chooser's plan by a pseudo-random one (a hash of sequence and round):
    every round each sequence gets 0..cap draft tokens."""
    import hashlib

    from ssd.speculation.chooser import Chooser

    def plan(self, seq_ids, caps, behind=None, remaining=None):
        self.rounds += 1
        out = [int(hashlib.blake2b(f"{i}:{self.rounds}".encode(), digest_size=2).hexdigest(), 16) % (c + 1)
               for i, c in zip(seq_ids, caps)]
        self.predicted_tokens, self.predicted_s = float(len(out)), 1.0
        return out
    monkeypatch.setattr(Chooser, "plan", plan)
