"""LLMEngine: requests in, token deltas out. One step = one prefill batch or one decode round of
the configured mode (AR, SD, SSD)."""
from __future__ import annotations

import itertools
import logging
import weakref
from dataclasses import dataclass

import torch

from ssd.engine.ar import ARStep
from ssd.engine.model_runner import ModelRunner
from ssd.engine.scheduler import Scheduler
from ssd.engine.sequence import Sequence
from ssd.engine.step import DecodeStep
from ssd.engine.trace import NullTracer
from ssd.sampling_params import SamplingParams
from ssd.speculation.chooser import Chooser
from ssd.speculation.local_proposer import DraftProposer
from ssd.speculation.stats import SpecCounters
from ssd.speculation.step import SpeculativeStep
from ssd.speculation.worker.proposer import WorkerProposer

log = logging.getLogger(__name__)


class PromptTooLongError(ValueError):
    pass


@dataclass
class StepOutput:
    seq: Sequence
    new_text: str
    new_token_ids: list[int]
    new_logprobs: list | None = None       # TokenLogprob per new token, when the request asked for them


def _weak_call(method, default=None):
    ref = weakref.WeakMethod(method)

    def call(*args):
        fn = ref()
        return default if fn is None else fn(*args)
    return call


class LLMEngine:
    """The engine loop. `step_impl` is a `DecodeStep` (engine/step.py): AR, or the speculative step
    (speculation/step.py) with SD's in-process draft or SSD's draft worker as its proposer."""

    def __init__(self, target: ModelRunner, tokenizer, eos_token_ids: list[int], max_model_len: int,
                 max_num_seqs: int, max_num_batched_tokens: int, draft: ModelRunner | None = None,
                 mode: str = "ar", k: int = 4, draft_client=None, tracer=None, spec_max_batch: int | None = None,
                 thread_split: tuple[int, int] | None = None):
        self.tracer = tracer or NullTracer()
        self.spec_counters = SpecCounters()
        self.target, self.draft = target, draft
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.mode = mode
        managers, lookahead = [target.block_manager], 1
        if mode == "ar":
            self.step_impl: DecodeStep = ARStep(target, self.tracer)
        elif mode in ("sd", "ssd", "auto"):
            if mode in ("sd", "auto"):
                if draft is None:
                    raise ValueError(f"mode {mode!r} needs a draft model (draft=...)")
                proposer = DraftProposer(draft, target.model.cfg.vocab_size, self.tracer, lazy=mode == "auto")
                managers = [target.block_manager, draft.block_manager]
            else:
                if draft_client is None:
                    raise ValueError("mode 'ssd' needs a draft worker")
                proposer = WorkerProposer(draft_client, self.spec_counters)   # one client or a list
            # a weak callback: the step must not keep its engine (and its KV caches) alive in a cycle
            self.step_impl = SpeculativeStep(target, proposer, k, self.spec_counters, self.tracer,
                                             _weak_call(self._degrade), Chooser(k) if mode == "auto" else None)
            self.step_impl.max_spec_batch = spec_max_batch
            self.step_impl.batch_rows = _weak_call(self._decode_rows, default=0)
            if mode == "auto" and draft_client is not None:     # auto_ssd: SSD stints next to local ones
                from ssd.speculation.regime import LOCAL, WORKER, RegimePolicy

                # where SSD rounds take cores from the target (a thread split), start local: see RegimePolicy
                shares = thread_split is not None
                policy = RegimePolicy(start=LOCAL if shares else WORKER, worker_waits=shares)
                self.step_impl.add_worker(WorkerProposer(draft_client, self.spec_counters), policy, thread_split)
            lookahead = k + 1
        else:
            raise ValueError(f"unknown mode {mode!r}; choose ar, sd, ssd or auto")
        self.degraded_from: str | None = None
        self.prefill_threads: int | None = None     # CPU threads for prefill steps (None: unchanged)
        self.scheduler = Scheduler(managers, max_num_seqs, max_num_batched_tokens, lookahead)
        self.scheduler.on_release = self.step_impl.release
        self._ids = itertools.count()
        self.seqs: dict[str, Sequence] = {}

    def _decode_rows(self) -> int:
        """Requests that will decode together (unfinished, up to max_num_seqs)."""
        return min(len(self.seqs), self.scheduler.max_num_seqs)

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    prompt: str | None = None) -> Sequence:
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if n >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {n} tokens but max_model_len is {self.max_model_len}: shorten the prompt "
                f"or raise max_model_len (at most the model's context length)")
        vocab = self.target.model.cfg.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        longest = min(n + params.max_tokens, self.max_model_len) + self.scheduler.lookahead
        for m in self.scheduler.managers:
            if m.blocks_needed(longest) > m.num_blocks:
                raise PromptTooLongError(
                    f"the request needs up to {longest} tokens of KV cache but the cache holds "
                    f"{m.num_blocks * m.block_size}: lower max_tokens or give the engine more KV memory "
                    "(kv_cache_gb or kv_cache_tokens)")
        if request_id in self.seqs:
            raise ValueError(f"duplicate request id {request_id!r}")
        seq = Sequence(next(self._ids), request_id, prompt_token_ids, params, self.tokenizer,
                       self.eos_token_ids, self.max_model_len, prompt)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def abort(self, request_id: str) -> None:
        seq = self.seqs.pop(request_id, None)
        if seq is not None and not seq.finished:
            seq._finish("abort")
            self.scheduler.finish(seq)

    def _degrade(self, error: BaseException) -> None:
        """The draft worker (SSD: the last live one) failed: finish everything with exact local AR decoding."""
        if self.degraded_from is not None:
            return
        log.error("draft worker failed (%s: %s); continuing every request with local autoregressive "
                  "decoding (exact, slower)", type(error).__name__, error)
        self.spec_counters.seqs_to_local += sum(not s.finished for s in self.seqs.values())
        self.degraded_from = self.mode
        self.mode = "ar"
        self.step_impl = ARStep(self.target, self.tracer)
        self.scheduler.lookahead = 1
        self.scheduler.on_release = self.step_impl.release

    def spec_metrics(self):
        """A frozen snapshot of the speculation counters (take deltas of two snapshots)."""
        return self.spec_counters.snapshot()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @torch.inference_mode()
    def step(self) -> list[StepOutput]:
        sched = self.scheduler.schedule()
        if sched.prefill:
            threads = torch.get_num_threads()
            if self.prefill_threads and self.prefill_threads != threads:
                torch.set_num_threads(self.prefill_threads)
            try:
                self.step_impl.prefill(sched.prefill)
            finally:
                if torch.get_num_threads() != threads:
                    torch.set_num_threads(threads)
            touched = sched.prefill
        elif sched.decode:
            self.step_impl.decode(sched.decode)
            touched = sched.decode
        else:
            touched = []
        outs = []
        for seq in touched:
            text, toks, lps = seq.take_pending()
            if seq.finished:
                self.scheduler.finish(seq)
                self.seqs.pop(seq.request_id, None)
            if toks or seq.finished:
                outs.append(StepOutput(seq, text, toks, lps if seq.output_logprobs is not None else None))
        return outs

