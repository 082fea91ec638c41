"""`ssd bench`: our modes (AR, SD, ...) and the transformers peers on the same prompts, in one run.

:func:`run_bench` returns the result dict of :mod:`ssd.bench.report` (``machine``, ``config``,
``runs``) plus a ``summary`` (``summary_by_batch_size`` when several batch sizes ran);
:func:`write_bench_report` writes it (JSON, Markdown, PNG).

How a run is measured
---------------------
* One engine (:class:`ssd.LLM`) per mode and draft length k, built once and warmed up with a
  short untimed generation. By default all engines exist at once (sharing the loaded weights) and
  every batch of prompts runs on each in turn, the order rotating per batch, so that run order
  does not bias the comparison (:mod:`ssd.bench.engine_runs`); ``interleave=False`` builds, runs and
  frees one engine after another instead.
* Every prompt generates exactly ``max_tokens`` tokens (``ignore_eos=True``). Prompts go through
  ``LLM.generate`` ``batch_size`` at a time (1: one prompt at a time); a list of batch sizes
  runs each with the same engines.
* ``tokens_per_s``: all generated tokens / the summed wall time of the ``generate`` calls
  (prefill included). ``decode_tokens_per_s``: tokens after each request's first one / the
  time after the batch's first token (for ``batch_size`` 1: exactly wall − TTFT; for larger
  batches the earliest first token of the batch, i.e. never flattering).
* ``matches_ar``: the fraction of prompts whose greedy token ids equal those of our AR run —
  an exactness canary in every benchmark (``None`` at temperature > 0 or without an AR run).
* AR runs carry the memory-bandwidth bound: one decode step reads every weight once, so
  ``bandwidth_bound_ms_per_token = weight bytes per token / measured read bandwidth``
  (KV-cache and activation traffic ignored: a lower bound on the step time).
* Peers (``hf``, ``hf-assisted``) decode the same token ids greedily with transformers, same
  threads and max tokens. Our ``dtype="auto"`` means float16 weights via FBGEMM on CPU, which
  transformers has no fast path for; peers then run in bfloat16 (recorded in the config).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import logging
import re
import time
from dataclasses import dataclass, field

from pathlib import Path
from typing import Any

import torch

from ssd.bench import engine_runs as er
from ssd.bench.datasets import DATASETS, PROMPT_SETS, BenchPrompt, load_prompts, render_prompt
from ssd.bench.summary import PEERS, geomean, summarize, summary_markdown
from ssd.bench.timeline import render_timeline, window
from ssd.models.sharing import shared_weights

log = logging.getLogger(__name__)

__all__ = ["BenchConfig", "PEERS", "bench_and_report", "geomean", "mode_threads", "run_bench", "summarize",
           "summary_markdown", "write_bench_report"]

DEFAULT_OUT_DIR = "benchmarks/results"


@dataclass
class BenchConfig:
    model: str = "qwen2.5-coder-1.5b"
    draft: str | None = "qwen2.5-coder-0.5b"
    modes: list[str] = field(default_factory=lambda: ["ar", "sd"])
    k: int | list[int] = 4                   # draft length; a list sweeps it for the speculative modes
    datasets: list[str] = field(default_factory=lambda: list(DATASETS))
    num_prompts: int = 4                     # per dataset
    max_tokens: int = 64                     # generated per prompt, exactly (EOS ignored)
    temperature: float = 0.0                 # 0 = greedy
    batch_size: int | list[int] = 1          # concurrent requests per generate() call; a list sweeps it
    auto_ssd: bool = False                   # auto also runs a draft worker and may choose SSD stints
    interleave: bool = True                  # all engines at once, alternating per batch (engine_runs.py)
    threads: int | None = None
    spec_max_batch: int | None = None        # sd/ssd: larger decode batches run one-token rounds
    prefill_threads: int | None = None       # default: threads (equal placement: SSD's prefill gets them all)
    dtype: str = "auto"
    device: str = "cpu"
    draft_device: str | None = None
    draft_dtype: str | None = None           # default: dtype (the hf-assisted peer always uses peer dtype)
    max_model_len: int = 4096
    kv_cache_gb: float | None = None         # None (and no kv_cache_tokens): sized to the prompts (bench_kv_tokens)
    kv_cache_tokens: int | None = None
    seed: int = 0                            # prompt selection, and per-prompt sampling seeds
    placement: str = "paper"                 # ssd: "paper" (worker adds cores) or "equal" (same total cores)
    peers: list[str] = field(default_factory=list)
    peer_assistant_tokens: int | None = None  # hf-assisted draft length (None: transformers' schedule)
    out_dir: str = DEFAULT_OUT_DIR
    stem: str | None = None                  # default: bench-<UTC time>-<short config>
    bandwidth: bool = True                   # measure read bandwidth, report the AR bound
    bandwidth_mb: int = 512
    warmup: bool = True
    progress: bool = True
    title: str | None = None
    ssd_options: dict = field(default_factory=dict)   # extra LLM(...) settings for mode ssd (fan-out, cores...)
    draft_vocabs: list[int] | None = None    # draft modes once per reduced-head size (None: the engine default)
    tensor_parallel_size: int = 1            # target sharded over this many CPU ranks (runs record per-rank timings)
    tp_transport: str = "auto"               # their collectives: shared memory on one host, or "gloo"
    prompts: dict[str, list[BenchPrompt]] | None = None   # injected prompts (dataset -> prompts)

    def __post_init__(self) -> None:
        from ssd.config import MODES

        self.modes = _as_list(self.modes)
        self.peers = _as_list(self.peers)
        self.datasets = _as_list(self.datasets)
        bad = [m for m in self.modes if m not in MODES]
        if bad:
            raise ValueError(f"unknown mode(s) {', '.join(bad)}; choose from {', '.join(MODES)}")
        if len(set(self.modes)) != len(self.modes):
            raise ValueError(f"modes repeated: {self.modes}")
        bad = [p for p in self.peers if p not in PEERS]
        if bad:
            raise ValueError(f"unknown peer(s) {', '.join(bad)}; choose from {', '.join(PEERS)}")
        if not self.modes and not self.peers:
            raise ValueError("nothing to run: give at least one mode or peer")
        if not self.draft and (any(m != "ar" for m in self.modes) or "hf-assisted" in self.peers):
            raise ValueError("speculative modes and the hf-assisted peer need a draft model (draft=...)")
        ks = self.ks
        if not ks or any(not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 16 for k in ks):
            raise ValueError(f"k must be an integer in [1, 16] or a list of them, got {self.k!r}")
        if self.prompts is not None:
            if not self.prompts or any(not v for v in self.prompts.values()):
                raise ValueError("injected prompts: give at least one prompt per dataset")
            self.datasets = list(self.prompts)
        else:
            bad = [d for d in self.datasets if d not in PROMPT_SETS]
            if bad or not self.datasets:
                raise ValueError(f"unknown or no dataset(s) {bad}; choose from {', '.join(PROMPT_SETS)}")
        bss = _as_list(self.batch_size)
        if not bss or any(not isinstance(b, int) or isinstance(b, bool) or b < 1 for b in bss):
            raise ValueError(f"batch_size must be an integer >= 1 or a list of them, got {self.batch_size!r}")
        for name in ("num_prompts", "max_tokens", "bandwidth_mb"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if not 0 <= self.temperature <= 100:
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        if self.placement not in ("paper", "equal"):
            raise ValueError(f"placement must be 'paper' or 'equal', got {self.placement!r}")
        if self.placement == "equal" and "ssd" in self.modes and self.device == "cpu":
            if self.threads is None or self.threads - draft_worker_threads(self) < 1:
                raise ValueError("placement 'equal' needs --threads larger than the draft workers' threads "
                                 "(e.g. --threads 2 --draft-threads 1; times --draft-workers): SSD's target runs on "
                                 "the rest")

    @property
    def batch_sizes(self) -> list[int]:
        return sorted(dict.fromkeys(_as_list(self.batch_size)))

    @property
    def ks(self) -> list[int]:
        return sorted(dict.fromkeys(_as_list(self.k)))

    @property
    def peer_dtype(self) -> str:
        """transformers' dtype for the peers: ours, except "auto" (fp16 FBGEMM on CPU) -> bfloat16."""
        return "bfloat16" if self.dtype == "auto" else self.dtype

    def default_stem(self) -> str:
        when = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
        model = Path(self.model).name or "model"
        parts = [model, "-".join(self.modes + self.peers)]
        if any(m != "ar" for m in self.modes):
            parts.append("k" + "_".join(map(str, self.ks)))
        parts.append(f"t{self.max_tokens}")
        if self.batch_sizes != [1]:
            parts.append("b" + "_".join(map(str, self.batch_sizes)))
        if self.temperature > 0:
            parts.append(f"temp{self.temperature:g}")
        short = re.sub(r"[^A-Za-z0-9._-]+", "_", "-".join(parts))
        return f"bench-{when}-{short}"


def _as_list(x: Any) -> list:
    if x is None:
        return []
    if isinstance(x, str):
        return [s.strip() for s in x.split(",") if s.strip()]
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]


# --------------------------------------------------------------------------- small helpers


def _device_bandwidth_gbps(device: str, threads: int, size_mb: int) -> float:
    """Read bandwidth of the memory the target's weights live in (host RAM or the GPU's)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        from ssd.bench.machine import measure_bandwidth_gbps

        return measure_bandwidth_gbps(threads, size_mb=size_mb)
    x = torch.ones(max(size_mb, 1024) * (1 << 20) // 4, dtype=torch.float32, device=dev)
    x.sum()
    torch.cuda.synchronize(dev)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(3):
            x.sum()
        torch.cuda.synchronize(dev)
        best = min(best, (time.perf_counter() - t0) / 3)
    gbps = x.numel() * x.element_size() / best / 1e9
    del x
    torch.cuda.empty_cache()
    return gbps


def _load_prompts(cfg: BenchConfig) -> dict[str, list[BenchPrompt]]:
    if cfg.prompts is not None:
        return {d: list(ps) for d, ps in cfg.prompts.items()}
    return {d: load_prompts(d, cfg.num_prompts, seed=cfg.seed) for d in cfg.datasets}


def _render(prompts: dict[str, list[BenchPrompt]], tokenizer, limit: int, max_tokens: int) -> dict[str, list[list[int]]]:
    out = {}
    for d, ps in prompts.items():
        ids = [render_prompt(p, tokenizer) for p in ps]
        for p, t in zip(ps, ids):
            if not t:
                raise ValueError(f"prompt {p.id!r} ({d}) renders to no tokens")
            if len(t) + max_tokens > limit:
                raise ValueError(f"prompt {p.id!r} ({d}) has {len(t)} tokens; with {max_tokens} new tokens it "
                                 f"exceeds max_model_len {limit}: raise --max-model-len or lower --max-tokens")
        out[d] = ids
    return out


# --------------------------------------------------------------------------- our engine


def draft_worker_threads(cfg: BenchConfig) -> int:
    """Threads of all SSD draft workers together (draft_threads each, default 1)."""
    return (cfg.ssd_options.get("draft_threads") or 1) * (cfg.ssd_options.get("num_draft_workers") or 1)


def mode_threads(cfg: BenchConfig, mode: str) -> int | None:
    """Target threads of one mode: with placement 'equal' on CPU, SSD's target leaves the workers their cores."""
    if mode == "ssd" and cfg.placement == "equal" and cfg.device == "cpu" and cfg.threads:
        return cfg.threads - draft_worker_threads(cfg)
    return cfg.threads


def _build_llm(cfg: BenchConfig, mode: str, k: int, draft_vocab: int | None = None):
    from ssd import LLM

    # equal placement: SSD's target prefills on all the cores (its worker gets the prompt after that)
    prefill = cfg.prefill_threads or (cfg.threads if mode_threads(cfg, mode) != cfg.threads else None)
    return LLM(cfg.model, draft=cfg.draft if mode != "ar" else None, mode=mode, k=k, device=cfg.device,
               draft_device=cfg.draft_device, threads=mode_threads(cfg, mode), prefill_threads=prefill,
               dtype=cfg.dtype, draft_dtype=cfg.draft_dtype,
               max_model_len=cfg.max_model_len, kv_cache_gb=cfg.kv_cache_gb or 1.0,
               kv_cache_tokens=cfg.kv_cache_tokens,
               max_num_seqs=max(16, *cfg.batch_sizes), progress=cfg.progress, trace=True,
               tensor_parallel_size=cfg.tensor_parallel_size,
               **({"tp_transport": cfg.tp_transport} if cfg.tensor_parallel_size > 1 else {}),
               **(cfg.ssd_options if mode == "ssd" or mode == "auto" and cfg.auto_ssd else {}),
               **({"auto_ssd": True} if mode == "auto" and cfg.auto_ssd else {}),
               **({"spec_max_batch": cfg.spec_max_batch} if mode != "ar" and cfg.spec_max_batch else {}),
               **({"draft_vocab": draft_vocab} if mode != "ar" and draft_vocab is not None else {}))


def _reduced_draft_bytes(llm) -> int:
    """Bytes of weights a draft step reads with a reduced head (`--draft-vocab N`), as the head starts
    (base rows and special tokens; the fed rows it adds later are float32, hidden * 4 bytes each). An
    SSD worker's head lives in its process: an identical one is built here on the shared draft weights."""
    from ssd.layers.reduced_head import draft_head, step_weight_bytes

    runner = getattr(llm.engine, "draft", None)
    if llm.draft is not None and getattr(runner, "head", None) is not None:
        return step_weight_bytes(llm.draft.model, runner.head)
    from ssd.models.loader import load_model
    from ssd.models.sharing import load_cached

    ec = llm.config
    draft = load_cached(load_model, ec.draft, llm.draft_dtype, ec.draft_device or ec.device,
                        ec.max_model_len + 32, False)
    return step_weight_bytes(draft.model, draft_head(draft.model, draft.tokenizer, ec.draft_vocab))


def bench_kv_tokens(rendered: dict[str, list[list[int]]], batch_size: int, max_tokens: int, k: int,
                    block_size: int = 16) -> int:
    """KV slots an engine needs for this run: the `batch_size` longest contexts (prompt, output and
    a round's draft lookahead, in whole blocks) with a quarter more for blocks held while a batch ends.
    Every engine of a bench lives at once: ten engines at the default 1 GiB (1.3 GiB resident with the
    draft's cache) ran a 24 GiB machine out of memory, where this run's prompts need a few MiB each."""
    per_seq = sorted((-(-(len(ids) + max_tokens + k + 2) // block_size) * block_size
                      for ids in (i for v in rendered.values() for i in v)), reverse=True)
    need = sum(per_seq[:batch_size])
    return need + need // 4 + 4 * block_size


def _matches(ids: list[list[int]] | None, ref: list[list[int]] | None) -> float | None:
    if ids is None or ref is None or len(ids) != len(ref):
        return None
    return sum(a == b for a, b in zip(ids, ref)) / len(ids) if ids else None


# --------------------------------------------------------------------------- entry points


def run_bench(cfg: BenchConfig) -> dict:
    """Run every mode (and k) and peer over every dataset and batch size; return the report dict."""
    from ssd.bench.machine import machine_info

    t_start = time.perf_counter()
    prompts = _load_prompts(cfg)
    machine = machine_info()
    bss = cfg.batch_sizes
    config: dict[str, Any] = {
        "title": cfg.title or f"ssd bench: {Path(cfg.model).name}",
        "target": cfg.model, "draft": cfg.draft, "modes": cfg.modes, "k": cfg.ks,
        "datasets": list(prompts), "prompts_per_dataset": {d: len(p) for d, p in prompts.items()},
        "prompt_ids": {d: [p.id for p in ps] for d, ps in prompts.items()},
        "max_new_tokens": cfg.max_tokens, "ignore_eos": True, "temperature": cfg.temperature,
        "batch_size": bss[0] if len(bss) == 1 else bss, "dtype": cfg.dtype,
        "draft_dtype": cfg.draft_dtype or cfg.dtype, "device": cfg.device,
        "draft_device": cfg.draft_device or cfg.device,
        "threads": cfg.threads if cfg.threads is not None else torch.get_num_threads(),
        "seed": cfg.seed, "warmup": cfg.warmup, "peers": cfg.peers, "placement": cfg.placement,
        "spec_max_batch": cfg.spec_max_batch, "kv_cache_gb": cfg.kv_cache_gb,
        "kv_cache_tokens": cfg.kv_cache_tokens,
        "interleaved": cfg.interleave, "auto_ssd": cfg.auto_ssd,
        "run_order": ("every batch of prompts runs once per configuration, in an order rotating by one "
                      "configuration per batch; engines share the loaded weights" if cfg.interleave else
                      "one configuration after another (AR first)"),
        "tensor_parallel_size": cfg.tensor_parallel_size,
    }
    if cfg.tensor_parallel_size > 1:
        config["tp_transport"] = cfg.tp_transport
    if cfg.tensor_parallel_size > 1:
        config["tensor_parallel_note"] = ("target_weight_bytes_per_token counts rank 0's shard (with its vocab "
                                          "rows of the LM head); runs carry per-rank compute and collective "
                                          "(all-reduce and logits gather) times")
    if "ssd" in cfg.modes:
        config["ssd_target_threads"] = mode_threads(cfg, "ssd")
        config["ssd_draft_threads"] = cfg.ssd_options.get("draft_threads") or 1
        config["ssd_prefill_threads"] = cfg.prefill_threads or cfg.threads
        config["ssd_options"] = {k: v for k, v in cfg.ssd_options.items() if v is not None}
    if cfg.peers:
        config["peer_dtype"] = cfg.peer_dtype
        if cfg.dtype == "auto":
            config["peer_dtype_note"] = ("our dtype 'auto' is float16 weights via FBGEMM on CPU (bfloat16 on "
                                         "CUDA); transformers peers run in bfloat16")
        config["peer_assistant_tokens"] = cfg.peer_assistant_tokens or "transformers default schedule"
        config["peer_order"] = "peers run after our engines"
        if cfg.temperature > 0:
            config["peer_note"] = "peers always decode greedily"
            log.warning("peers decode greedily; our modes sample at temperature %s", cfg.temperature)

    default_threads = cfg.threads or torch.get_num_threads()
    bandwidth = None
    if cfg.bandwidth:
        bandwidth = _device_bandwidth_gbps(cfg.device, default_threads, cfg.bandwidth_mb)
        machine["bandwidth_gbps"] = bandwidth
        machine["bandwidth_device"] = cfg.device
        log.info("measured read bandwidth: %.1f GB/s", bandwidth)

    specs = er.engine_specs(cfg.modes, cfg.ks, cfg.draft_vocabs)
    rendered: dict[str, list[list[int]]] | None = None
    entries: dict[tuple[str, int, str], dict] = {}
    cells: dict[tuple[str, int, str], er.Cell] = {}
    timelines: dict[str, list] = {}
    load_s: dict[str, float] = {}
    draft_bytes: dict[str, int] = {}   # labels with a reduced draft head: what one draft step reads

    if specs and cfg.kv_cache_gb is None and cfg.kv_cache_tokens is None:
        cfg = dataclasses.replace(cfg, kv_cache_tokens=_sized_kv_tokens(cfg, prompts))
        config["kv_cache_tokens"] = cfg.kv_cache_tokens
        log.info("KV cache: %d tokens per engine (this run's longest %d contexts; --kv-cache-gb or "
                 "--kv-cache-tokens to set it)", cfg.kv_cache_tokens, max(bss))

    def build(spec):
        nonlocal rendered
        log.info("building the %s engine", spec.label)
        t0 = time.perf_counter()
        llm = _build_llm(cfg, spec.mode, spec.k, spec.draft_vocab)
        load_s[spec.label] = time.perf_counter() - t0
        config.setdefault("engine_dtype", llm.target.dtype_name)
        config.setdefault("target_path", str(llm.target.path))
        config.setdefault("target_weight_bytes_per_token", llm.target.model.weight_bytes_per_token())
        if llm.draft is not None:
            config.setdefault("draft_path", str(llm.draft.path))
            config.setdefault("draft_weight_bytes_per_token", llm.draft.model.weight_bytes_per_token())
        if spec.draft_vocab:
            draft_bytes[spec.label] = _reduced_draft_bytes(llm)
        if rendered is None:
            rendered = _render(prompts, llm.tokenizer, llm.max_model_len, cfg.max_tokens)
        if cfg.warmup:
            er.warmup(llm, next(iter(rendered.values()))[0], cfg.temperature, cfg.seed, cfg.max_tokens)
        return llm

    def measure(llms):
        got = er.measure(llms, specs, rendered, bss, cfg.temperature, cfg.seed, cfg.max_tokens,
                         default_threads, cfg.progress)
        for (lab, bs, dataset), cell in got.items():
            llm = llms[lab]
            spec = next(s for s in specs if s.label == lab)
            run = er.cell_entry(llm, cell, dataset, bs, cfg.max_tokens, f"{lab} {dataset}")
            run.update(er.spec_stats(llm, spec.mode, cell.before, cell.after))
            if cell.tp_before is not None:
                run["tensor_parallel"] = tp_run_stats(cell.tp_before, cell.tp_after)
            if lab in draft_bytes:
                run["draft_weight_bytes_per_token"] = draft_bytes[lab]
            entries[(lab, bs, dataset)] = run
        cells.update(got)
        for lab, llm in llms.items():
            spans = [(x.track, x.name, x.start, x.end) for x in llm.engine.tracer.spans]
            timelines[lab] = window(spans[-400:])

    def close(llms):
        for llm in llms.values():
            if hasattr(llm, "close"):
                llm.close()
        llms.clear()
        er.release_memory()

    if specs and cfg.interleave:
        with shared_weights():
            llms = {s.label: build(s) for s in specs}
        measure(llms)
        close(llms)
    else:
        for spec in specs:
            llms = {spec.label: build(spec)}
            measure(llms)
            close(llms)

    runs, ar_ids = _finish_runs(cfg, specs, entries, cells, load_s, config, bandwidth)
    if cfg.peers:
        runs += _run_peers(cfg, prompts, rendered, ar_ids.get(bss[0], {}), config)
    result = {"machine": machine, "config": config, "runs": runs, "timelines": timelines,
              "elapsed_s": time.perf_counter() - t_start}
    if len(bss) == 1:
        result["summary"] = summarize(runs)
    else:
        result["summary_by_batch_size"] = {str(bs): summarize([r for r in runs if r.get("batch_size") == bs])
                                           for bs in bss}
    return result


def _sized_kv_tokens(cfg: BenchConfig, prompts: dict[str, list[BenchPrompt]]) -> int:
    from ssd.models.loader import load_tokenizer
    from ssd.models.registry import resolve_model

    tokenizer = load_tokenizer(resolve_model(cfg.model, progress=cfg.progress))
    rendered = _render(prompts, tokenizer, cfg.max_model_len, cfg.max_tokens)
    return bench_kv_tokens(rendered, max(cfg.batch_sizes), cfg.max_tokens, max(cfg.ks))


def _finish_runs(cfg: BenchConfig, specs, entries, cells, load_s, config, bandwidth):
    """Order the entries (configuration, batch size, dataset), add labels, k, the exactness canary
    against AR's greedy tokens, and AR's bandwidth bound."""
    greedy = cfg.temperature == 0
    ar_ids: dict[int, dict[str, list[list[int]]]] = {}
    for (lab, bs, dataset), cell in cells.items():
        if lab == "ar":
            ar_ids.setdefault(bs, {})[dataset] = [o.token_ids for o in cell.outputs]
    runs = []
    for spec in specs:
        for bs in cfg.batch_sizes:
            for dataset in config["datasets"]:
                run = entries.get((spec.label, bs, dataset))
                if run is None:
                    continue
                outputs = cells[(spec.label, bs, dataset)].outputs
                run["label"] = spec.label
                run["load_s"] = load_s.get(spec.label)
                if spec.mode == "ar":
                    run["measured_ms_per_token"] = er.ms_per_step(outputs)
                    if bandwidth:
                        bound = config["target_weight_bytes_per_token"] / (bandwidth * 1e9) * 1e3
                        run["bandwidth_bound_ms_per_token"] = bound
                        if run["measured_ms_per_token"]:
                            run["bandwidth_utilization"] = bound / run["measured_ms_per_token"]
                else:
                    run["k"] = spec.k
                    if spec.draft_vocab is not None:
                        run["draft_vocab"] = spec.draft_vocab
                    ref = ar_ids.get(bs, {}).get(dataset)
                    run["matches_ar"] = _matches([o.token_ids for o in outputs], ref) if greedy else None
                    if run["matches_ar"] is not None and run["matches_ar"] < 1.0:
                        log.error("%s on %s (batch %d): greedy tokens differ from AR on %.0f%% of prompts "
                                  "(exactness bug?)", spec.label, dataset, bs, 100 * (1 - run["matches_ar"]))
                runs.append(run)
    return runs, ar_ids


def tp_run_stats(before: dict, after: dict) -> dict:
    """Per-rank compute vs collective time (all-reduces and logits gathers, `allreduce_s`; of it, the
    wait for a slower peer, `wait_s`, over shared memory) of one run (from two cumulative
    `tensor_parallel_stats`), over all forwards and (`decode_*`) over decode-step forwards alone."""
    steps = after["forwards"] - before["forwards"]
    dsteps = after.get("decode_forwards", 0) - before.get("decode_forwards", 0)
    per = lambda x, n: x / n * 1e3 if n and x is not None else None   # noqa: E731
    ranks = []
    for b, a in zip(before["ranks"], after["ranks"]):
        busy, comm = a["busy_s"] - b["busy_s"], a["allreduce_s"] - b["allreduce_s"]
        wait = a["wait_s"] - b["wait_s"] if a.get("wait_s") is not None else None
        ranks.append(dict(rank=a["rank"], busy_s=busy, allreduce_s=comm, compute_s=busy - comm,
                          allreduces=a["allreduces"] - b["allreduces"], gathers=a["gathers"] - b["gathers"],
                          allreduce_ms_per_step=comm / steps * 1e3 if steps else None,
                          compute_ms_per_step=(busy - comm) / steps * 1e3 if steps else None,
                          wait_s=wait, wait_ms_per_step=per(wait, steps)))
        if "decode_busy_s" in a:        # decode-step forwards alone (what a decode token costs)
            dbusy, dcomm = a["decode_busy_s"] - b["decode_busy_s"], a["decode_allreduce_s"] - b["decode_allreduce_s"]
            dwait = a["decode_wait_s"] - b["decode_wait_s"] if a.get("decode_wait_s") is not None else None
            ranks[-1].update(decode_compute_ms_per_step=per(dbusy - dcomm, dsteps),
                             decode_allreduce_ms_per_step=per(dcomm, dsteps), decode_wait_ms_per_step=per(dwait, dsteps),
                             decode_allreduce_share=dcomm / dbusy if dbusy > 0 else None)
    return dict(size=len(ranks), steps=steps, decode_steps=dsteps, transport=after.get("transport"), ranks=ranks)


def _run_peers(cfg: BenchConfig, prompts, rendered, ar_ids, config) -> list[dict]:
    from ssd.bench.peers import hf_generate
    from ssd.models.registry import resolve_model

    target = resolve_model(cfg.model, progress=cfg.progress)
    draft = resolve_model(cfg.draft, progress=cfg.progress) if "hf-assisted" in cfg.peers else None
    if rendered is None:
        from ssd.models.loader import load_tokenizer

        rendered = _render(prompts, load_tokenizer(target), cfg.max_model_len, cfg.max_tokens)
    # Token-identity with our AR run is only meaningful when both compute in the same dtype.
    same_dtype = cfg.peer_dtype == config.get("engine_dtype")
    model_kwargs = {"device_map": cfg.device} if torch.device(cfg.device).type == "cuda" else None
    runs, hf_ids = [], {}
    for peer in cfg.peers:
        if peer == "llama.cpp":
            runs += _run_llamacpp(cfg, rendered, ar_ids)
            continue
        for dataset, ids in rendered.items():
            res = hf_generate(target, ids, cfg.max_tokens, dtype=cfg.peer_dtype, threads=cfg.threads,
                              assistant_dir=draft if peer == "hf-assisted" else None,
                              num_assistant_tokens=cfg.peer_assistant_tokens, warmup=cfg.warmup,
                              progress=cfg.progress, model_kwargs=model_kwargs)
            run = res.to_run(dataset)
            run["label"] = peer
            run["dtype"] = res.dtype
            run["load_s"] = res.load_s
            run["matches_ar"] = _matches(res.generated, ar_ids.get(dataset)) if same_dtype else None
            if peer == "hf":
                hf_ids[dataset] = res.generated
            else:
                run["matches_hf"] = _matches(res.generated, hf_ids.get(dataset))
            runs.append(run)
    return runs


def _run_llamacpp(cfg: BenchConfig, rendered, ar_ids) -> list[dict]:
    from ssd.bench.llamacpp_peer import llamacpp_generate
    from ssd.models.registry import gguf_source

    src = gguf_source(cfg.model, progress=cfg.progress)
    if src is None:
        raise ValueError(f"the llama.cpp peer needs a GGUF model; {cfg.model} is not one")
    runs = []
    for dataset, ids in rendered.items():
        res = llamacpp_generate(src, ids, cfg.max_tokens, cfg.threads, warmup=cfg.warmup, progress=cfg.progress,
                                n_ctx=cfg.max_model_len)
        run = res.to_run(dataset)
        run.update(label="llama.cpp", dtype=res.dtype, load_s=res.load_s, matches_ar=None,
                   agrees_with_ar=_matches(res.generated, ar_ids.get(dataset)))   # other numerics: informative
        runs.append(run)
    return runs


def write_bench_report(result: dict, out_dir: str | Path, stem: str) -> dict[str, Path]:
    """:func:`ssd.bench.report.write_report`, plus the summary appended to the Markdown file."""
    from ssd.bench.report import write_report

    paths = write_report(result, out_dir, stem)
    extra = summary_markdown(result)
    md = paths["md"]
    if extra:
        md.write_text(md.read_text(encoding="utf-8").rstrip("\n") + "\n\n## Summary\n\n" + extra, encoding="utf-8")
    png = render_timeline(result.get("timelines") or {}, Path(out_dir) / f"{stem}_timeline.png",
                          "target and draft work over ~1.5 s of decoding (after 3 rounds)")
    if png is not None:
        paths["png_timeline"] = png
        md.write_text(md.read_text(encoding="utf-8").rstrip("\n") + f"\n\n## Timeline\n\n![timeline]({png.name})\n",
                      encoding="utf-8")
    return paths


def bench_and_report(cfg: BenchConfig) -> tuple[dict, dict[str, Path]]:
    result = run_bench(cfg)
    return result, write_bench_report(result, cfg.out_dir, cfg.stem or cfg.default_stem())
