"""`ssd bench`: our modes (AR, SD, ...) and the transformers peers on the same prompts, in one run.

:func:`run_bench` returns the result dict of :mod:`ssd.bench.report` (``machine``, ``config``,
``runs``) plus a ``summary``; :func:`write_bench_report` writes it (JSON, Markdown, PNG).

How a run is measured
---------------------
* One engine (:class:`ssd.LLM`) per mode and draft length k, built once, warmed up with a short
  untimed generation, then freed before the next one is built (the 1.5B + 0.5B pair takes ~5 GB).
* Every prompt generates exactly ``max_tokens`` tokens (``ignore_eos=True``). Prompts go through
  ``LLM.generate`` ``batch_size`` at a time (1: one prompt at a time).
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

import datetime as _dt
import gc
import logging
import math
import re
import statistics
import time
from dataclasses import dataclass, field

from ssd.bench.timeline import render_timeline, window
from pathlib import Path
from typing import Any

import torch

from ssd.bench.datasets import DATASETS, BenchPrompt, load_prompts, render_prompt

log = logging.getLogger(__name__)

PEERS = ("hf", "hf-assisted", "llama.cpp")
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
    batch_size: int = 1                      # concurrent requests per generate() call
    threads: int | None = None
    spec_max_batch: int | None = None        # sd/ssd: larger decode batches run one-token rounds
    prefill_threads: int | None = None       # default: threads (equal placement: SSD's prefill gets them all)
    dtype: str = "auto"
    device: str = "cpu"
    draft_device: str | None = None
    draft_dtype: str | None = None           # default: dtype (the hf-assisted peer always uses peer dtype)
    max_model_len: int = 4096
    kv_cache_gb: float = 1.0
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
    tensor_parallel_size: int = 1            # target sharded over this many CPU ranks (runs record per-rank timings)
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
            bad = [d for d in self.datasets if d not in DATASETS]
            if bad or not self.datasets:
                raise ValueError(f"unknown or no dataset(s) {bad}; choose from {', '.join(DATASETS)}")
        for name in ("num_prompts", "max_tokens", "batch_size", "bandwidth_mb"):
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
            if self.threads is None or self.threads - (self.ssd_options.get("draft_threads") or 1) < 1:
                raise ValueError("placement 'equal' needs --threads larger than the draft worker's threads "
                                 "(e.g. --threads 2 --draft-threads 1): SSD's target runs on the rest")

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
        if self.batch_size > 1:
            parts.append(f"b{self.batch_size}")
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


def _median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


def _release_memory() -> None:
    """Collect a freed engine now (the caller drops its last reference first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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


def mode_threads(cfg: BenchConfig, mode: str) -> int | None:
    """Target threads of one mode: with placement 'equal' on CPU, SSD's target leaves the worker its cores."""
    if mode == "ssd" and cfg.placement == "equal" and cfg.device == "cpu" and cfg.threads:
        return cfg.threads - (cfg.ssd_options.get("draft_threads") or 1)
    return cfg.threads


def _build_llm(cfg: BenchConfig, mode: str, k: int):
    from ssd import LLM

    # equal placement: SSD's target prefills on all the cores (its worker's core idles meanwhile)
    prefill = cfg.prefill_threads or (cfg.threads if mode_threads(cfg, mode) != cfg.threads else None)
    return LLM(cfg.model, draft=cfg.draft if mode != "ar" else None, mode=mode, k=k, device=cfg.device,
               draft_device=cfg.draft_device, threads=mode_threads(cfg, mode), prefill_threads=prefill,
               dtype=cfg.dtype, draft_dtype=cfg.draft_dtype,
               max_model_len=cfg.max_model_len, kv_cache_gb=cfg.kv_cache_gb,
               max_num_seqs=max(16, cfg.batch_size), progress=cfg.progress, trace=True,
               tensor_parallel_size=cfg.tensor_parallel_size,
               **(cfg.ssd_options if mode == "ssd" else {}),
               **({"spec_max_batch": cfg.spec_max_batch} if mode != "ar" and cfg.spec_max_batch else {}))


def _params(cfg: BenchConfig, index: int, max_tokens: int | None = None):
    from ssd import SamplingParams

    seed = None if cfg.temperature == 0 else cfg.seed * 1_000_003 + index
    return SamplingParams(temperature=cfg.temperature, seed=seed, max_tokens=max_tokens or cfg.max_tokens,
                          ignore_eos=True)


def _warmup(llm, cfg: BenchConfig, ids: list[int]) -> None:
    t0 = time.perf_counter()
    llm.generate([ids[-32:]], _params(cfg, 0, max_tokens=min(8, cfg.max_tokens)))
    log.info("warm-up generation took %.2fs", time.perf_counter() - t0)


def _run_engine(llm, cfg: BenchConfig, dataset: str, ids: list[list[int]], desc: str) -> tuple[dict, list]:
    """Generate for every prompt (batch_size at a time); return the run entry and the outputs."""
    from tqdm.auto import tqdm

    from ssd.outputs import aggregate

    outputs, wall, decode_wall = [], 0.0, 0.0
    bs = cfg.batch_size
    with tqdm(total=len(ids), desc=desc, unit="prompt", disable=not cfg.progress) as bar:
        for start in range(0, len(ids), bs):
            chunk = ids[start:start + bs]
            params = [_params(cfg, start + i) for i in range(len(chunk))]
            outs = llm.generate(chunk, params)
            batch_wall = llm.last_stats["wall_s"]
            ttfts = [o.metrics.ttft_s for o in outs if o.metrics.ttft_s is not None]
            wall += batch_wall
            decode_wall += max(batch_wall - (min(ttfts) if ttfts else batch_wall), 0.0)
            outputs += outs
            bar.update(len(chunk))
    for o in outputs:
        if o.metrics.num_generated_tokens != cfg.max_tokens:
            log.warning("%s: prompt generated %d tokens instead of %d", desc, o.metrics.num_generated_tokens,
                        cfg.max_tokens)
    agg = aggregate(outputs, wall)
    metrics = [o.metrics for o in outputs]
    gen = agg["generated_tokens"]
    decode_tokens = sum(max(m.num_generated_tokens - 1, 0) for m in metrics)
    rounds = sum(m.target_forwards for m in metrics)
    ttft = _median([m.ttft_s for m in metrics])
    run = {
        "dataset": dataset,
        "mode": llm.config.mode,
        "tokens_per_s": gen / wall if wall > 0 else None,
        "tokens_per_s_median": _median([m.tokens_per_s for m in metrics]),
        "decode_tokens_per_s": decode_tokens / decode_wall if decode_wall > 0 else None,
        "decode_tokens_per_s_median": _median([m.decode_tokens_per_s for m in metrics]),
        "ttft_ms_median": ttft * 1e3 if ttft is not None else None,
        "acceptance_rate": agg["acceptance_rate"],
        "mean_accepted_len": decode_tokens / rounds if rounds else None,
        "acceptance_by_position": agg["acceptance_by_position"] or None,
        "num_prompts": len(outputs),
        "generated_tokens": gen,
        "wall_s": wall,
        "target_forwards": rounds,
        "batch_size": bs,
    }
    return run, outputs


def _ms_per_step(outputs) -> float | None:
    """Mean decode time per step of one sequence (ms): Σ (total − TTFT) / Σ (tokens − 1)."""
    secs = sum(o.metrics.total_s - o.metrics.ttft_s for o in outputs if o.metrics.ttft_s is not None)
    steps = sum(max(o.metrics.num_generated_tokens - 1, 0) for o in outputs)
    return secs / steps * 1e3 if steps and secs > 0 else None


def _matches(ids: list[list[int]] | None, ref: list[list[int]] | None) -> float | None:
    if ids is None or ref is None or len(ids) != len(ref):
        return None
    return sum(a == b for a, b in zip(ids, ref)) / len(ids) if ids else None


# --------------------------------------------------------------------------- summary


def _sd_label_for(label: str, labels) -> str | None:
    """The SD run an SSD run is compared with: the one with the same k."""
    cand = "sd" + label[3:]
    return cand if label.startswith("ssd") and cand in labels else None


def summarize(runs: list[dict]) -> dict[str, dict]:
    """Per run label: geometric mean over datasets of tokens/s (and decode tokens/s), and the
    geometric-mean ratio to our AR run, to each peer, and for SSD to SD with the same k, over the
    datasets both ran (overall and decode-only)."""
    by_label: dict[str, dict[str, dict]] = {}
    for r in runs:
        by_label.setdefault(r.get("label") or r["mode"], {})[r["dataset"]] = r
    ref = {lab: by_label[lab] for lab in ("ar", *PEERS) if lab in by_label}
    summary = {}
    for lab, per_ds in by_label.items():
        tps = {d: r.get("tokens_per_s") for d, r in per_ds.items()}
        dec = {d: r.get("decode_tokens_per_s") for d, r in per_ds.items()}
        first = next(iter(per_ds.values()))
        entry: dict[str, Any] = {
            "mode": first["mode"],
            "datasets": list(per_ds),
            "tokens_per_s_geomean": geomean(list(tps.values())),
            "decode_tokens_per_s_geomean": geomean(list(dec.values())),
        }
        if "k" in first:
            entry["k"] = first["k"]
        accs = [r.get("acceptance_rate") for r in per_ds.values() if r.get("acceptance_rate") is not None]
        if accs:
            entry["acceptance_rate_mean"] = sum(accs) / len(accs)
        matches = [(r["matches_ar"], r["num_prompts"]) for r in per_ds.values() if r.get("matches_ar") is not None]
        if matches:
            entry["matches_ar"] = sum(m * n for m, n in matches) / sum(n for _, n in matches)
        bases = dict(ref)
        sd_lab = _sd_label_for(lab, by_label)
        if sd_lab:
            bases["sd"] = by_label[sd_lab]
        for base_lab, base in bases.items():
            if base_lab == lab:
                continue
            for key, vals, prefix in (("tokens_per_s", tps, "vs_"), ("decode_tokens_per_s", dec, "decode_vs_")):
                ratios = [vals[d] / base[d][key] for d in per_ds if d in base and vals[d] and base[d].get(key)]
                entry[f"{prefix}{base_lab}"] = geomean(ratios)
        if first["mode"] == "ssd":
            hits = [(r.get("cache_hit_rate"), r.get("target_forwards") or 1) for r in per_ds.values()
                    if r.get("cache_hit_rate") is not None]
            if hits:
                entry["cache_hit_rate"] = sum(h * n for h, n in hits) / sum(n for _, n in hits)
            idle = [r.get("target_idle_fraction") for r in per_ds.values() if r.get("target_idle_fraction") is not None]
            if idle:
                entry["target_idle_fraction_mean"] = sum(idle) / len(idle)
        summary[lab] = entry
    return summary


def summary_markdown(result: dict) -> str:
    """The summary (geomeans and ratios), SSD cache metrics and the AR bandwidth bound as Markdown."""
    summary = result.get("summary") or {}
    if not summary:
        return ""
    bases = [b for b in ("ar", "sd", *PEERS) if any(f"vs_{b}" in e for e in summary.values())]
    header = ["mode", "tok/s geomean", "decode tok/s geomean"]
    for b in bases:
        header += [f"x {b}", f"decode x {b}"]
    header.append("matches AR")
    lines = ["| " + " | ".join(header) + " |", "| --- | " + " | ".join(["---:"] * (len(header) - 1)) + " |"]

    def f(x, d=2, suffix=""):
        return "-" if x is None else f"{x:.{d}f}{suffix}"

    for lab, e in summary.items():
        row = [lab, f(e.get("tokens_per_s_geomean")), f(e.get("decode_tokens_per_s_geomean"))]
        for b in bases:
            same = b == lab
            row += ["1.00x" if same else f(e.get(f"vs_{b}"), 2, "x"),
                    "1.00x" if same else f(e.get(f"decode_vs_{b}"), 2, "x")]
        row.append(f(e.get("matches_ar"), 2))
        lines.append("| " + " | ".join(row) + " |")
    out = ["Geometric means over datasets; x: geometric mean of per-dataset throughput ratios (overall = "
           "prefill included; decode = after the first token); x sd compares SSD with SD at the same k; "
           "matches AR: fraction of prompts with token ids identical to our AR run (greedy exactness canary).",
           "", *lines]
    ssd_runs = [r for r in result.get("runs", []) if r.get("mode") == "ssd"]
    if ssd_runs:
        out += ["", "SSD speculation cache (per dataset): hit rate = rounds answered from a complete pre-drafted "
                "chain (by k = accepted length of the previous round, k = 0..K); tokens per round = tokens "
                "committed per target verification; ms/round = target decode time per round (of it verifying); "
                "target idle = share of decode time the target waited for the draft; draft busy = share of it "
                "the worker was drafting.", "",
                "| dataset | mode | cache hit rate | hit rate by k | tokens/round on hit | tokens/round on miss |"
                " ms/round (verify) | target idle | draft busy | degraded |",
                "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |"]
        for r in ssd_runs:
            by_k = " ".join("-" if h is None else f"{h:.2f}" for h in r.get("cache_hit_rate_by_k") or [])
            out.append(f"| {r['dataset']} | {r.get('label', 'ssd')} | {f(r.get('cache_hit_rate'))} | {by_k or '-'} | "
                       f"{f(r.get('tokens_per_round_on_hit'))} | {f(r.get('tokens_per_round_on_miss'))} | "
                       f"{f(r.get('ms_per_round'), 0)} ({f(r.get('verify_ms_per_round'), 0)}) | "
                       f"{f(r.get('target_idle_fraction'))} | {f(r.get('draft_busy_fraction'))} | "
                       f"{r.get('degraded_from') or '-'} |")
    bound = [r for r in result.get("runs", []) if r.get("bandwidth_bound_ms_per_token") is not None]
    if bound:
        out += ["", "AR memory-bandwidth bound (weights read once per decode step, "
                f"{result['machine'].get('bandwidth_gbps', 0):.1f} GB/s measured):", ""]
        for r in bound:
            out.append(f"- {r['dataset']}: bound {r['bandwidth_bound_ms_per_token']:.3g} ms/token "
                       f"({1e3 / r['bandwidth_bound_ms_per_token']:.3g} tok/s), measured "
                       f"{f(r.get('measured_ms_per_token'), 1)} ms/token"
                       + (f" ({r['bandwidth_utilization'] * 100:.0f}% of the bound)"
                          if r.get("bandwidth_utilization") else ""))
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- entry points


def run_bench(cfg: BenchConfig) -> dict:
    """Run every mode (and k) and peer over every dataset; return the report dict."""
    from ssd.bench.machine import machine_info

    t_start = time.perf_counter()
    prompts = _load_prompts(cfg)
    machine = machine_info()
    config: dict[str, Any] = {
        "title": cfg.title or f"ssd bench: {Path(cfg.model).name}",
        "target": cfg.model, "draft": cfg.draft, "modes": cfg.modes, "k": cfg.ks,
        "datasets": list(prompts), "prompts_per_dataset": {d: len(p) for d, p in prompts.items()},
        "prompt_ids": {d: [p.id for p in ps] for d, ps in prompts.items()},
        "max_new_tokens": cfg.max_tokens, "ignore_eos": True, "temperature": cfg.temperature,
        "batch_size": cfg.batch_size, "dtype": cfg.dtype, "draft_dtype": cfg.draft_dtype or cfg.dtype,
        "device": cfg.device,
        "draft_device": cfg.draft_device or cfg.device,
        "threads": cfg.threads if cfg.threads is not None else torch.get_num_threads(),
        "seed": cfg.seed, "warmup": cfg.warmup, "peers": cfg.peers, "placement": cfg.placement,
        "spec_max_batch": cfg.spec_max_batch,
        "tensor_parallel_size": cfg.tensor_parallel_size,
    }
    if cfg.tensor_parallel_size > 1:
        config["tensor_parallel_note"] = ("target_weight_bytes_per_token counts rank 0's shard (with the LM head); "
                                          "runs carry per-rank compute and all-reduce times")
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
        if cfg.temperature > 0:
            config["peer_note"] = "peers always decode greedily"
            log.warning("peers decode greedily; our modes sample at temperature %s", cfg.temperature)

    runs: list[dict] = []
    rendered: dict[str, list[list[int]]] | None = None
    ar_ids: dict[str, list[list[int]]] = {}
    greedy = cfg.temperature == 0
    bandwidth = None
    if cfg.bandwidth:
        threads = cfg.threads or torch.get_num_threads()
        bandwidth = _device_bandwidth_gbps(cfg.device, threads, cfg.bandwidth_mb)
        machine["bandwidth_gbps"] = bandwidth
        machine["bandwidth_device"] = cfg.device
        log.info("measured read bandwidth: %.1f GB/s", bandwidth)

    # AR first: the other modes are checked against its greedy tokens.
    modes = sorted(cfg.modes, key=lambda m: m != "ar")
    timelines: dict[str, list] = {}
    for mode in modes:
        for k in ([cfg.ks[0]] if mode == "ar" else cfg.ks):
            label = mode if mode == "ar" or len(cfg.ks) == 1 else f"{mode} k={k}"
            log.info("building the %s engine", label)
            t0 = time.perf_counter()
            llm = _build_llm(cfg, mode, k)
            load_s = time.perf_counter() - t0
            config.setdefault("engine_dtype", llm.target.dtype_name)
            config.setdefault("target_path", str(llm.target.path))
            config.setdefault("target_weight_bytes_per_token", llm.target.model.weight_bytes_per_token())
            if llm.draft is not None:
                config.setdefault("draft_path", str(llm.draft.path))
                config.setdefault("draft_weight_bytes_per_token", llm.draft.model.weight_bytes_per_token())
            if rendered is None:
                rendered = _render(prompts, llm.tokenizer, llm.max_model_len, cfg.max_tokens)
            if cfg.warmup:
                _warmup(llm, cfg, next(iter(rendered.values()))[0])
            for dataset, ids in rendered.items():
                ssd_before = _ssd_counts(llm)
                tp_before = llm.tensor_parallel_stats()
                run, outputs = _run_engine(llm, cfg, dataset, ids, f"{label} {dataset}")
                if tp_before is not None:
                    run["tensor_parallel"] = tp_run_stats(tp_before, llm.tensor_parallel_stats())
                if mode == "ssd":
                    run.update(_ssd_run_stats(llm, ssd_before))
                elif mode == "auto":     # the chooser's decisions and predicted vs measured tokens/s
                    run.update({k2: v for k2, v in llm.engine.spec_metrics().delta(ssd_before).to_dict().items()
                                if k2.startswith("auto_")})
                run["label"] = label
                run["load_s"] = load_s
                tokens = [o.token_ids for o in outputs]
                if mode == "ar":
                    ar_ids[dataset] = tokens
                    run["measured_ms_per_token"] = _ms_per_step(outputs)
                    if bandwidth:
                        bound = config["target_weight_bytes_per_token"] / (bandwidth * 1e9) * 1e3
                        run["bandwidth_bound_ms_per_token"] = bound
                        if run["measured_ms_per_token"]:
                            run["bandwidth_utilization"] = bound / run["measured_ms_per_token"]
                else:
                    run["k"] = k
                    run["matches_ar"] = _matches(tokens, ar_ids.get(dataset)) if greedy else None
                    if run["matches_ar"] is not None and run["matches_ar"] < 1.0:
                        log.error("%s on %s: greedy tokens differ from AR on %.0f%% of prompts (exactness bug?)",
                                  label, dataset, 100 * (1 - run["matches_ar"]))
                runs.append(run)
            spans = [(x.track, x.name, x.start, x.end) for x in llm.engine.tracer.spans]
            timelines[label] = window(spans[-400:])
            if hasattr(llm, "close"):
                llm.close()
            del llm
            _release_memory()

    if cfg.peers:
        runs += _run_peers(cfg, prompts, rendered, ar_ids, config)

    return {"machine": machine, "config": config, "runs": runs, "summary": summarize(runs),
            "timelines": timelines, "elapsed_s": time.perf_counter() - t_start}


def tp_run_stats(before: dict, after: dict) -> dict:
    """Per-rank compute vs all-reduce time of one run (from two cumulative `tensor_parallel_stats`)."""
    steps = after["forwards"] - before["forwards"]
    ranks = []
    for b, a in zip(before["ranks"], after["ranks"]):
        busy, comm = a["busy_s"] - b["busy_s"], a["allreduce_s"] - b["allreduce_s"]
        ranks.append(dict(rank=a["rank"], busy_s=busy, allreduce_s=comm, compute_s=busy - comm,
                          allreduces=a["allreduces"] - b["allreduces"],
                          allreduce_ms_per_step=comm / steps * 1e3 if steps else None,
                          compute_ms_per_step=(busy - comm) / steps * 1e3 if steps else None))
    return dict(size=len(ranks), steps=steps, ranks=ranks)


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


def _ssd_counts(llm):
    if llm.engine.mode in ("ssd", "auto") or llm.engine.degraded_from == "ssd":
        return llm.engine.spec_metrics()
    return None


def _ssd_run_stats(llm, before: dict | None) -> dict:
    """SSD speculation-cache metrics of one dataset run (differences of the engine's counters)."""
    after = _ssd_counts(llm)
    if after is None or before is None:
        return {"degraded_from": llm.engine.degraded_from}
    return {**after.delta(before).to_dict(), "degraded_from": llm.engine.degraded_from}
