"""`ssd bench`: running our engine's configurations (mode x K) over the prompt sets.

Interleaved (the default): every configuration's engine is built first (the loaded weights are
shared, each engine has its own KV cache and draft worker), then every batch of prompts runs once
per configuration, in an order that rotates by one configuration per batch. A slow or fast phase
of the machine (this VM's memory bandwidth varies 24-58 GB/s) then falls on every configuration
alike instead of on whichever ran at that time; measured run-order effects were up to 20% when the
modes ran one after another. Sequential (``interleave=False``): one engine at a time, built, run
over everything, freed (less memory: for models that do not fit several KV caches).
"""
from __future__ import annotations

import gc
import logging
import statistics
import time
from dataclasses import dataclass, field

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineSpec:
    label: str
    mode: str
    k: int
    draft_vocab: int | None = None      # the draft's reduced head (None: the engine's default)


def engine_specs(modes: list[str], ks: list[int], draft_vocabs: list[int] | None = None) -> list[EngineSpec]:
    """AR once; SD and SSD at every K; auto once, with the largest K as its cap (it picks 0..K per
    sequence and round itself). Every draft mode once per `draft_vocabs` value (labelled `vocab=N`,
    `vocab=all` for 0, where there are several)."""
    out = []
    dvs = draft_vocabs or [None]
    for mode in sorted(modes, key=lambda m: m != "ar"):
        if mode == "ar":
            out.append(EngineSpec("ar", "ar", ks[0]))
            continue
        for dv in dvs:
            tail = "" if len(dvs) == 1 else f" vocab={dv or 'all'}"
            if mode == "auto":
                out.append(EngineSpec(("auto" if len(ks) == 1 else f"auto k<={ks[-1]}") + tail, "auto", ks[-1], dv))
            else:
                out += [EngineSpec((mode if len(ks) == 1 else f"{mode} k={k}") + tail, mode, k, dv) for k in ks]
    return out


def rotation(labels: list[str], turn: int) -> list[str]:
    """The run order of one batch: the configurations rotated by `turn` (each goes first equally often)."""
    i = turn % len(labels) if labels else 0
    return labels[i:] + labels[:i]


@dataclass
class Cell:
    """What one configuration measured over one (batch size, prompt set)."""

    outputs: list = field(default_factory=list)
    wall: float = 0.0
    decode_wall: float = 0.0
    before: object = None          # the engine's speculation counters before the cell (SpecSnapshot)
    after: object = None           # ... and right after it (later cells run on the same engine)
    tp_before: dict | None = None  # tensor-parallel timings before the cell (LLM.tensor_parallel_stats)
    tp_after: dict | None = None
    batches: list = field(default_factory=list)   # per generate() call: (decode tokens, decode seconds)
    forward_ms: list = field(default_factory=list)   # per generate() call: mean target forward after the first token
    draft_prefill_s: float = 0.0                     # the in-process draft's prompt prefills (trace spans)


def median(xs: list[float | None]) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def params(temperature: float, seed: int, index: int, max_tokens: int):
    from ssd import SamplingParams

    s = None if temperature == 0 else seed * 1_000_003 + index
    return SamplingParams(temperature=temperature, seed=s, max_tokens=max_tokens, ignore_eos=True)


def run_chunk(llm, cell: Cell, chunk: list[list[int]], plist: list) -> None:
    """One generate() call over `chunk` (concurrent requests); adds its outputs and times to `cell`.
    Decode time = wall time after the batch's first token (never flattering for batches > 1)."""
    spans = llm.engine.tracer.spans
    n0, t0 = len(spans), time.perf_counter()
    outs = llm.generate(chunk, plist)
    wall = llm.last_stats["wall_s"]
    ttfts = [o.metrics.ttft_s for o in outs if o.metrics.ttft_s is not None]
    decode_wall = max(wall - (min(ttfts) if ttfts else wall), 0.0)
    cell.wall += wall
    cell.decode_wall += decode_wall
    cell.outputs += outs
    cell.batches.append((sum(max(o.metrics.num_generated_tokens - 1, 0) for o in outs), decode_wall))
    forward_ms, draft_prefill_s = span_stats(spans[n0:], t0 + (min(ttfts) if ttfts else 0.0))
    cell.forward_ms.append(forward_ms)
    cell.draft_prefill_s += draft_prefill_s


def span_stats(spans: list, first_token: float) -> tuple[float | None, float]:
    """(mean ms of the target's forwards after `first_token` (decode and verify spans), seconds the
    in-process draft spent prefilling prompts) of one generate() call's trace spans. They tell a
    mode's own per-step costs from the machine's phase: the same plain step took 63-80 ms per batch
    in both AR and auto in one interleaved run."""
    fwd = [s.end - s.start for s in spans if s.track == "target" and s.name in ("decode", "verify")
           and s.start >= first_token]
    prefill = sum(s.end - s.start for s in spans if s.track == "draft" and s.name == "prefill")
    return (sum(fwd) / len(fwd) * 1e3 if fwd else None), prefill


def cell_entry(llm, cell: Cell, dataset: str, batch_size: int, max_tokens: int, desc: str) -> dict:
    """The run entry of one cell (schema: ssd.bench.report)."""
    from ssd.outputs import aggregate

    outputs = cell.outputs
    for o in outputs:
        if o.metrics.num_generated_tokens != max_tokens:
            log.warning("%s: prompt generated %d tokens instead of %d", desc, o.metrics.num_generated_tokens,
                        max_tokens)
    agg = aggregate(outputs, cell.wall)
    metrics = [o.metrics for o in outputs]
    gen = agg["generated_tokens"]
    decode_tokens = sum(max(m.num_generated_tokens - 1, 0) for m in metrics)
    rounds = sum(m.target_forwards for m in metrics)
    ttft = median([m.ttft_s for m in metrics])
    return {
        "dataset": dataset,
        "mode": llm.config.mode,
        "tokens_per_s": gen / cell.wall if cell.wall > 0 else None,
        "tokens_per_s_median": median([m.tokens_per_s for m in metrics]),
        "decode_tokens_per_s": decode_tokens / cell.decode_wall if cell.decode_wall > 0 else None,
        "decode_tokens_per_s_median": median([m.decode_tokens_per_s for m in metrics]),
        # one value per batch of prompts, in run order: the same batches ran on every configuration, one
        # right after the other, so auto's and a fixed configuration's values pair up (summary.paired_ratio)
        "batch_decode_tokens_per_s": [n / w if w > 0 else None for n, w in cell.batches],
        # per batch, the mean target forward (decode or verify) after the first token, from the trace
        "batch_target_forward_ms": cell.forward_ms,
        "draft_prefill_s": cell.draft_prefill_s,
        "ttft_ms_median": ttft * 1e3 if ttft is not None else None,
        "acceptance_rate": agg["acceptance_rate"],
        "mean_accepted_len": decode_tokens / rounds if rounds else None,
        "acceptance_by_position": agg["acceptance_by_position"] or None,
        "num_prompts": len(outputs),
        "generated_tokens": gen,
        "wall_s": cell.wall,
        "target_forwards": rounds,
        "batch_size": batch_size,
    }


def spec_counts(llm):
    """The engine's speculation counters (modes ssd and auto; also after SSD fell back to AR)."""
    if llm.engine.mode in ("ssd", "auto") or llm.engine.degraded_from == "ssd":
        return llm.engine.spec_metrics()
    return None


def spec_stats(llm, mode: str, before, after) -> dict:
    """SSD cache metrics / auto's decisions over one cell (differences of the engine's counters
    taken before and after it)."""
    if mode == "ssd":
        if after is None or before is None:
            return {"degraded_from": llm.engine.degraded_from}
        return {**after.delta(before).to_dict(), "degraded_from": llm.engine.degraded_from}
    if mode == "auto" and after is not None and before is not None:
        # the chooser's decisions and predicted vs measured tokens/s; with a worker its cache hits too
        return {k: v for k, v in after.delta(before).to_dict().items()
                if k.startswith("auto_") or k in ("cache_hit_rate", "cache_hit_rate_by_k")}
    return {}


def ms_per_step(outputs) -> float | None:
    """Mean decode time per step of one sequence (ms): sum(total - TTFT) / sum(tokens - 1)."""
    secs = sum(o.metrics.total_s - o.metrics.ttft_s for o in outputs if o.metrics.ttft_s is not None)
    steps = sum(max(o.metrics.num_generated_tokens - 1, 0) for o in outputs)
    return secs / steps * 1e3 if steps and secs > 0 else None


def release_memory() -> None:
    """Collect a freed engine now (the caller drops its last reference first)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def measure(llms: dict[str, object], specs: list[EngineSpec], rendered: dict[str, list[list[int]]],
            batch_sizes: list[int], temperature: float, seed: int, max_tokens: int, default_threads: int,
            progress: bool, turn: int = 0) -> dict[tuple[str, int, str], Cell]:
    """Run every (batch size, prompt set, batch of prompts) on every engine in `llms`, rotating
    their order per batch. -> {(label, batch size, dataset): Cell}."""
    from tqdm.auto import tqdm

    labels = [s.label for s in specs if s.label in llms]
    total = len(labels) * sum(len(range(0, len(ids), bs)) for bs in batch_sizes for ids in rendered.values())
    cells: dict[tuple[str, int, str], Cell] = {}
    with tqdm(total=total, desc="bench " + ",".join(labels), unit="batch", disable=not progress) as bar:
        for bs in batch_sizes:
            for dataset, ids in rendered.items():
                for lab in labels:
                    tp = getattr(llms[lab], "tensor_parallel_stats", None)
                    cells[(lab, bs, dataset)] = Cell(before=spec_counts(llms[lab]), tp_before=tp() if tp else None)
                for start in range(0, len(ids), bs):
                    chunk = ids[start:start + bs]
                    plist = [params(temperature, seed, start + i, max_tokens) for i in range(len(chunk))]
                    for lab in rotation(labels, turn):
                        llm = llms[lab]
                        threads = llm.config.threads or default_threads
                        if torch.get_num_threads() != threads:
                            torch.set_num_threads(threads)
                        run_chunk(llm, cells[(lab, bs, dataset)], chunk, plist)
                        bar.set_postfix_str(f"b{bs} {dataset} {lab}")
                        bar.update(1)
                    turn += 1
                for lab in labels:      # the counters of this cell only: the engines run later cells too
                    tp = getattr(llms[lab], "tensor_parallel_stats", None)
                    cell = cells[(lab, bs, dataset)]
                    cell.after, cell.tp_after = spec_counts(llms[lab]), tp() if tp else None
    torch.set_num_threads(default_threads)
    return cells


def warmup(llm, ids: list[int], temperature: float, seed: int, max_tokens: int) -> None:
    t0 = time.perf_counter()
    llm.generate([ids[-32:]], params(temperature, seed, 0, min(8, max_tokens)))
    log.info("warm-up generation took %.2fs", time.perf_counter() - t0)
