"""The public facade: LLM(...).generate / stream / chat."""
from __future__ import annotations

import logging
import time
import uuid
from typing import Iterator, Sequence as Seq

import torch

from ssd.config import EngineConfig
from ssd.engine.engine import LLMEngine
from ssd.engine.trace import Tracer
from ssd.engine.model_runner import ModelRunner
from ssd.layers.reduced_head import draft_head
from ssd.models.loader import LoadedModel, draft_dtype_for, load_model
from ssd.models.sharing import load_cached
from ssd.outputs import RequestMetrics, RequestOutput, StreamChunk, aggregate
from ssd.sampling_params import SamplingParams
from ssd.speculation.compat import check_vocab_compatible

log = logging.getLogger(__name__)

Messages = list[dict]


class LLM:
    """LLM(model="qwen2.5-coder-1.5b", draft=None, mode=None, k=4, device="cpu", threads=None, ...)

    mode: "ar" | "sd" | "ssd" | "auto"; None means "auto" when a draft is given (or implied by a
    built-in target in a speculative mode), else "ar".

    `model`/`draft` accept a built-in name (see `ssd models list`), an HF folder, a GGUF file or a hub id.
    """

    def __init__(self, model: str = "qwen2.5-coder-1.5b", draft: str | None = None, **kwargs):
        self.config = cfg = EngineConfig(model=model, draft=draft, **kwargs)
        self._ssd_cpu_split(cfg)
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
        self._tp = None
        self._clients = []
        if cfg.tensor_parallel_size > 1:
            self._tp = self._start_tensor_parallel()
            self.target = self._tp.loaded
        else:
            self.target = load_cached(load_model, cfg.model, cfg.dtype, cfg.device, cfg.max_model_len + 32,
                                      cfg.progress)
        try:
            self._build(cfg)
        except BaseException:
            self.close()        # no orphan ranks or workers when a later part of start-up fails
            raise

    def _build(self, cfg: EngineConfig) -> None:
        self.tokenizer = self.target.tokenizer
        mcfg = self.target.config
        self.max_model_len = min(cfg.max_model_len, mcfg.max_position_embeddings)
        target_runner = self._runner(self.target, cfg.device, None, self._tp)
        # SSD's local worker runs on CPU cores unless draft_device names a GPU; SD's draft defaults to device
        draft_device = (cfg.draft_device or "cpu") if cfg.mode == "ssd" else (cfg.draft_device or cfg.device)
        self.draft_dtype = draft_dtype_for(cfg.dtype, cfg.draft_dtype, draft_device, cfg.draft)
        draft_runner = None
        draft_client = None
        self.draft = None
        if cfg.mode == "ssd":
            draft_client = self._start_worker(target_runner)
            self._clients = _as_clients(draft_client)
        if cfg.mode not in ("ar", "ssd"):
            self.draft = load_cached(load_model, cfg.draft, self.draft_dtype, cfg.draft_device or cfg.device,
                                     cfg.max_model_len + 32,
                                    cfg.progress)
            check_vocab_compatible(self.tokenizer, self.draft.tokenizer, mcfg.vocab_size,
                                   self.draft.config.vocab_size)
            draft_runner = self._runner(self.draft, cfg.draft_device or cfg.device,
                                        target_runner.block_manager.num_blocks,
                                        head=draft_head(self.draft.model, self.draft.tokenizer, cfg.draft_vocab))
        thread_split = None
        if cfg.mode == "auto" and cfg.auto_ssd:
            thread_split, worker_apart = self._auto_ssd_threads(cfg)
            draft_client = self._start_worker(target_runner)
            self._clients = _as_clients(draft_client)
        eos = list(mcfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in eos:
            eos.append(self.tokenizer.eos_token_id)
        self.engine = LLMEngine(target_runner, self.tokenizer, eos, self.max_model_len, cfg.max_num_seqs,
                                cfg.max_num_batched_tokens, draft_runner, cfg.mode, cfg.k, draft_client,
                                Tracer() if cfg.trace else None, cfg.spec_max_batch, thread_split)
        self.engine.prefill_threads = cfg.prefill_threads or (thread_split[1] if thread_split else None)
        if cfg.mode == "auto" and cfg.auto_ssd:
            self.engine.step_impl.worker_prefills_always = worker_apart
            if thread_split is not None:
                self._measure_thread_slowdown(thread_split)
        if draft_client is not None:
            self.engine.step_impl.prefill_on_worker_cores = self._prefill_on_worker_cores(
                cfg, self.engine.prefill_threads or cfg.threads or torch.get_num_threads())
        self._clients = _as_clients(draft_client)

    def _measure_thread_slowdown(self, thread_split: tuple[int, int]) -> None:
        """auto_ssd where SSD rounds take the worker's cores from the target: how much slower the target
        runs on its SSD-round threads (speculation/thread_scaling.py), to bound the worker regime before
        its first visit."""
        from ssd.speculation.thread_scaling import target_slowdown

        few, many = thread_split
        s = target_slowdown(self.target.model, few, many)
        self.engine.step_impl.thread_slowdown = s
        self.engine.spec_counters.thread_slowdown = s
        log.info("auto_ssd: the target's MLP runs %.2fx slower on %d thread(s) than on %d (measured at start); "
                 "the worker is not visited while even all-hit SSD rounds at that speed would be clearly "
                 "slower than the local rounds", s, few, many)

    @staticmethod
    def _ssd_cpu_split(cfg: EngineConfig) -> None:
        """SSD on CPU with no thread count given: the target decodes on the cores the local draft
        workers do not use (sharing a worker's core slows both), and prefills on all of them
        (the workers get new prompts after it: see _prefill_on_worker_cores). Placement: speculation/worker/placement.py."""
        import os

        from ssd.speculation.worker.placement import cores_taken, local_cores

        if cfg.mode != "ssd" or cfg.draft_host is not None or (cfg.draft_device or "cpu") != "cpu":
            return
        usable = sorted(os.sched_getaffinity(0))
        placement = local_cores(usable, cfg.num_draft_workers, cfg.draft_cores)    # a clear error, before loading
        if cfg.threads is not None or cfg.device != "cpu" or cfg.tensor_parallel_size > 1:
            return
        worker = cores_taken(placement)
        if len(usable) > worker:
            cfg.threads = len(usable) - worker
            cfg.prefill_threads = cfg.prefill_threads or len(usable)
            log.info("ssd: target decodes on %d thread(s), prefills on %d; %d draft worker(s) on %d core(s)",
                     cfg.threads, cfg.prefill_threads, len(placement), worker)

    @staticmethod
    def _prefill_on_worker_cores(cfg: EngineConfig, prefill_threads: int) -> bool:
        """Whether the target's prefill threads share cores with local draft workers (more of both than
        usable cores: SSD's CPU default and the equal placement prefill on every core). Then workers
        get new prompts at their first round instead of prefilling them during the target's prefill."""
        import os

        from ssd.speculation.worker.placement import cores_taken, local_cores

        if cfg.device != "cpu" or cfg.draft_host is not None or (cfg.draft_device or "cpu") != "cpu" or \
                cfg.tensor_parallel_size > 1:
            return False
        usable = sorted(os.sched_getaffinity(0))
        workers = cores_taken(local_cores(usable, cfg.num_draft_workers, cfg.draft_cores))
        return prefill_threads + workers > len(usable)

    @staticmethod
    def _auto_ssd_threads(cfg: EngineConfig) -> tuple[tuple[int, int] | None, bool]:
        """auto_ssd: (the target's threads in SSD rounds and in the other rounds, or None to leave them
        alone; whether the workers' cores, device or host stay apart from the target's in local rounds).
        On CPU with local workers and cores to spare, SSD rounds leave the workers their cores and local
        rounds take them back (so they are not apart); with `--threads` leaving the workers cores of
        their own (the paper placement) the target keeps its threads and the workers stay apart, so they
        may prefill new prompts in local rounds at no cost to the target."""
        import os

        from ssd.speculation.worker.placement import cores_taken, local_cores

        if cfg.device != "cpu" or cfg.draft_host is not None or (cfg.draft_device or "cpu") != "cpu":
            return None, True
        cores = len(os.sched_getaffinity(0))
        placement = local_cores(sorted(os.sched_getaffinity(0)), cfg.num_draft_workers, cfg.draft_cores)
        usable = cfg.threads or cores
        worker = cores_taken(placement)
        if usable > worker:
            log.info("auto_ssd: the target runs on %d thread(s) while the worker drafts, on %d otherwise",
                     usable - worker, usable)
            return (usable - worker, usable), False
        if usable + worker <= cores:
            log.info("auto_ssd: the target keeps its %d thread(s) in every round and the draft workers their %d "
                     "core(s); local rounds take no core back (--threads counts both: give it %d for that)",
                     usable, worker, usable + worker)
            return None, True
        log.warning("auto_ssd: %d thread(s) for the target and %d core(s) for draft workers on %d usable "
                    "core(s): they share cores", usable, worker, cores)
        return None, False

    def _start_tensor_parallel(self):
        """Check the split, then start ranks 1..N-1 (or wait for them) and load rank 0's shard. On a
        CPU the ranks share this process's cores, less the SSD draft worker's."""
        import json
        import os

        from ssd.distributed.sharding import head_split
        from ssd.distributed.target import TPTarget
        from ssd.models.config import ModelConfig
        from ssd.models.registry import resolve_model

        cfg = self.config
        mcfg = ModelConfig.from_hf(json.loads((resolve_model(cfg.model, progress=cfg.progress) / "config.json")
                                              .read_text()))
        head_split(mcfg.num_heads, mcfg.num_kv_heads, cfg.tensor_parallel_size)    # a clear error, before spawning
        from ssd.speculation.worker.placement import local_cores

        cores = sorted(os.sched_getaffinity(0))
        workers = cfg.mode == "ssd" or cfg.mode == "auto" and cfg.auto_ssd
        if workers and cfg.draft_host is None and (cfg.draft_device or "cpu") == "cpu" and len(cores) > 1:
            taken = {c for w in local_cores(cores, cfg.num_draft_workers, cfg.draft_cores) for c in (w or [])}
            cores = [c for c in cores if c not in taken] or cores
        return TPTarget(cfg.model, cfg.dtype, cfg.device, cfg.max_model_len + 32, cfg.tensor_parallel_size,
                        progress=cfg.progress, timeout_s=cfg.tp_timeout_s, listen=cfg.tp_host, cores=cores,
                        threads=cfg.threads, transport=cfg.tp_transport)

    def _start_worker(self, target_runner: ModelRunner):
        """Check the draft against the target, then start the SSD draft workers (each on its own cores,
        or wait for them on other hosts). Returns the list of clients."""
        import json
        import os

        from ssd.models.loader import load_tokenizer
        from ssd.models.registry import gguf_source, resolve_model
        from ssd.speculation.worker.client import start_clients
        from ssd.speculation.worker.messages import WorkerConfig
        from ssd.speculation.worker.placement import local_cores, per_worker_cores, split_hosts

        cfg = self.config
        path = resolve_model(cfg.draft, progress=cfg.progress)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        check_vocab_compatible(self.tokenizer, load_tokenizer(path), self.target.config.vocab_size, vocab)
        device = cfg.draft_device or "cpu"
        n = cfg.num_draft_workers
        hosts = split_hosts(cfg.draft_host)
        if hosts is not None:
            cores, listen = [None] * n, hosts
        else:
            listen = [None] * n
            cores = local_cores(sorted(os.sched_getaffinity(0)), n, cfg.draft_cores) if device == "cpu" \
                else per_worker_cores(cfg.draft_cores, n) or [None] * n
        if device != "cpu":
            log.warning("SSD draft worker on %s: CI has no GPU; this path passed the prepared GPU check once (an "
                        "H200, tiny fp32 models: scripts/cuda_check.sh), not with real models; engine and worker "
                        "talk over gloo, not NCCL", device)
        # a GGUF draft (built-in name or .gguf file) is handed over as such, so the worker loads its
        # low-bit weights from the GGUF like an in-process draft does
        model_arg = str(cfg.draft) if gguf_source(str(cfg.draft), progress=False) is not None else str(path)
        wcfg = WorkerConfig(model_arg, self.draft_dtype, cfg.k, self.target.config.vocab_size,
                            target_runner.block_manager.num_blocks, cfg.block_size, self.max_model_len,
                            cfg.max_num_seqs, cfg.fanout_budget, cfg.saguaro_c, cfg.backup,
                            draft_vocab=cfg.draft_vocab)
        return start_clients(wcfg, [dict(threads=cfg.draft_threads or 1, cores=c, device=device,
                                          timeout_s=cfg.worker_timeout_s, start_timeout_s=cfg.worker_start_timeout_s,
                                          listen=h) for c, h in zip(cores, listen)])

    @property
    def _client(self):
        """The first draft worker's client (SSD), else None."""
        return self._clients[0] if getattr(self, "_clients", None) else None

    def write_trace(self, path) -> None:
        """Write the target/draft timeline as Chrome/Perfetto trace JSON (needs LLM(..., trace=True))."""
        if not isinstance(self.engine.tracer, Tracer):
            raise ValueError("tracing is off: create the LLM with trace=True (CLI: --trace FILE)")
        self.engine.tracer.write(path)

    def tensor_parallel_stats(self) -> dict | None:
        """Cumulative timings of a tensor-parallel target (None without one): rank 0's forward count and
        per rank the seconds busy in forwards and KV copies and, of those, in collectives (all-reduces
        and the vocab-parallel logits gathers)."""
        return None if self._tp is None else self._tp.stats()

    def close(self) -> None:
        """Stop the draft workers (SSD) and the tensor-parallel ranks. Also called at interpreter exit."""
        clients, self._clients = getattr(self, "_clients", []), []
        for c in clients:
            c.close()
        if getattr(self, "_tp", None) is not None:
            self._tp.close()
            self._tp = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _runner(self, loaded: LoadedModel, device: str, num_blocks: int | None, tp=None,
                head=None) -> ModelRunner:
        """The target's KV slots: kv_cache_tokens where set, else what fits in kv_cache_gb.
        tp: the tensor-parallel target; kv_cache_gb then sizes rank 0's shard of the cache (its KV
        heads), and every rank holds the same number of slots."""
        bs = self.config.block_size
        if num_blocks is None and self.config.kv_cache_tokens is not None:
            num_blocks = max(-(-self.config.kv_cache_tokens // bs), 2)
        elif num_blocks is None:
            per_token = ModelRunner.kv_bytes_per_token(loaded.model, device)
            num_blocks = max(int(self.config.kv_cache_gb * 2**30 // (per_token * bs)), 2)
        if tp is not None:
            return tp.runner(num_blocks, bs, device)
        return ModelRunner(loaded.model, num_blocks, bs, torch.device(device), head)

    # ---- inputs -------------------------------------------------------------------------------
    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt)
        return list(prompt)

    def encode_chat(self, messages: Messages) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise ValueError("this model's tokenizer has no chat template; send plain prompts instead")
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    # ---- generation ---------------------------------------------------------------------------
    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        ids = [self.encode(p) for p in prompts]
        return self._run(ids, [p if isinstance(p, str) else None for p in prompts], sampling_params, use_tqdm)

    def chat(self, conversations: Messages | list[Messages],
             sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
             use_tqdm: bool = False) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        ids = [self.encode_chat(c) for c in conversations]
        return self._run(ids, [None] * len(ids), sampling_params, use_tqdm)

    def _run(self, ids: list[list[int]], texts: list[str | None], params, use_tqdm: bool) -> list[RequestOutput]:
        plist = self._params_list(params, len(ids))
        rids = []
        try:
            for i, (tok, text, p) in enumerate(zip(ids, texts, plist)):
                rid = f"gen-{uuid.uuid4().hex[:12]}"
                self.engine.add_request(rid, tok, p, text)
                rids.append(rid)
        except Exception:
            for rid in rids:
                self.engine.abort(rid)
            raise
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(rids), desc="generating", unit="req")
        t0 = time.perf_counter()
        while len(results) < len(rids):
            for out in self.engine.step():
                if out.seq.finished and out.seq.request_id in rids:
                    results[out.seq.request_id] = self._output(out.seq)
                    if bar:
                        bar.update(1)
        if bar:
            bar.close()
        self.last_stats = aggregate(list(results.values()), time.perf_counter() - t0)
        return [results[r] for r in rids]

    def stream(self, prompt: str | list[int] | Messages,
               sampling_params: SamplingParams | None = None) -> Iterator[StreamChunk]:
        """Yield text/token deltas as they are committed. Closing the iterator aborts the request."""
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
            ids, text = self.encode_chat(prompt), None
        else:
            ids, text = self.encode(prompt), prompt if isinstance(prompt, str) else None
        params = self._params_list(sampling_params, 1)[0]
        rid = f"stream-{uuid.uuid4().hex[:12]}"
        self.engine.add_request(rid, ids, params, text)
        done = False
        try:
            while not done:
                for out in self.engine.step():
                    if out.seq.request_id != rid:
                        continue
                    done = out.seq.finished
                    yield StreamChunk(rid, out.new_text, out.new_token_ids, done, out.seq.finish_reason,
                                      self._output(out.seq) if done else None, out.new_logprobs)
        finally:
            if not done:
                self.engine.abort(rid)

    @staticmethod
    def _params_list(params, n: int) -> list[SamplingParams]:
        if params is None:
            params = SamplingParams()
        if isinstance(params, SamplingParams):
            return [params] * n
        params = list(params)
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return params

    @staticmethod
    def _output(seq) -> RequestOutput:
        return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, seq.detok.text,
                             list(seq.output_token_ids), seq.finish_reason, RequestMetrics.of(seq), seq.spec,
                             None if seq.output_logprobs is None else list(seq.output_logprobs))


def _as_clients(client) -> list:
    """The draft-worker clients as a list (`_start_worker` returns one list; a test stand-in may be one client)."""
    return [] if client is None else list(client) if isinstance(client, list) else [client]
