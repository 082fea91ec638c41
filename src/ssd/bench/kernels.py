"""Micro-benchmark of the low-bit GEMM on a model's real linear layers: ms per pass over all of
them for M rows (1 = decode, 5 = a K=4 verify, 16 = a batch of SSD chains), against the memory
bandwidth bound, at each thread count. `ssd bench --kernels` runs it."""
from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def target_linears(model: str):
    from ssd.models.loader import load_model

    lm = load_model(model, "gguf", progress=False, max_positions=64)
    return lm, [m for m in lm.model.modules() if m.__class__.__name__ == "QuantLinear"]


def time_pass(linears, M: int, repeats: int, settings: list[Callable[[], None]] | None = None) -> list[float]:
    """Median ms per pass over `linears` with M rows, once per setting (each applied before its pass;
    the settings alternate within every repeat, their order reversed every other one, so a drift of
    the machine falls on all alike)."""
    settings = settings or [lambda: None]
    xs = {m.in_features: torch.randn(M, m.in_features) for m in linears}
    for m in linears:                       # warm-up
        m(xs[m.in_features])
    ts: list[list[float]] = [[] for _ in settings]
    for rep in range(repeats):
        order = list(range(len(settings)))
        for i in order if rep % 2 == 0 else order[::-1]:
            settings[i]()
            t0 = time.perf_counter()
            for m in linears:
                m(xs[m.in_features])
            ts[i].append(time.perf_counter() - t0)
    return [statistics.median(t) * 1e3 for t in ts]


def run_kernel_bench(model: str, threads: list[int], rows: list[int], repeats: int = 7) -> dict:
    from ssd.bench.machine import machine_info, measure_bandwidth_gbps
    from ssd.kernels.build import ISA_NAMES, forced_isa, load_qgemm

    lm, linears = target_linears(model)
    ops = load_qgemm()
    prefetch = ops.set_prefetch(0)          # the current distance (set back below)
    ops.set_prefetch(prefetch)
    nbytes = sum(m.weight_bytes() for m in linears)
    isa = forced_isa()
    isa = ops.best_isa() if isa < 0 else isa
    out = {"model": model, "linears": len(linears), "weight_bytes": nbytes, "isa": ISA_NAMES[isa],
           "prefetch_bytes": prefetch,
           "formats": sorted({m.backend for m in linears}), "machine": machine_info(), "results": []}
    prev = torch.get_num_threads()
    try:
        for th in threads:
            bw = measure_bandwidth_gbps(th)
            torch.set_num_threads(th)
            bound = nbytes / (bw * 1e9) * 1e3
            t1 = None
            for M in rows:
                # the kernels' software prefetch (qgemm.cpp) on and off, interleaved
                ms, ms_off = time_pass(linears, M, repeats, [lambda: ops.set_prefetch(prefetch),
                                                             lambda: ops.set_prefetch(0)])
                ops.set_prefetch(prefetch)
                t1 = ms if M == rows[0] else t1
                out["results"].append({"threads": th, "rows": M, "ms": ms, "bandwidth_gbps": bw,
                                       "bound_ms": bound, "x_bound": ms / bound, "t_over_t1": ms / t1,
                                       "ms_no_prefetch": ms_off})
                log.info("threads %d M %d: %.1f ms (without prefetch %.1f; bound %.1f ms)", th, M, ms, ms_off, bound)
        del linears, lm
        torch.set_num_threads(threads[-1])
        out["attention"] = attention_bench([512, 2048, 4096])
        out["decode_step"] = decode_step_share(model)
        out["decode_step_threads"] = threads[-1]
    finally:
        torch.set_num_threads(prev)
    return out


def kernel_markdown(res: dict) -> str:
    lines = _gemm_lines(res)
    if res.get("attention"):
        lines += ["", "Attention, one sequence, ms per forward (28 layers, 12 heads / 2 KV heads, head dim 128):", "",
                  "| context | query rows | C++ kernel, fp16 cache in place | SDPA, gathered fp32 copy | ratio |",
                  "|---:|---:|---:|---:|---:|"]
        for a in res["attention"]:
            lines.append(f"| {a['context']} | {a['rows']} | {a['kernel_fp16_ms']:.2f} | {a['sdpa_fp32_gather_ms']:.2f} "
                         f"| {a['kernel_fp16_ms'] / a['sdpa_fp32_gather_ms']:.2f} |")
    if res.get("decode_step"):
        d = res["decode_step"]
        lines += ["", f"AR decode step at context {d['context']} ({res['decode_step_threads']} threads): "
                  f"{d['step_ms']:.1f} ms, of which linears {d['linears_ms']:.1f} ms; outside the linears "
                  f"(attention, norms, rope, embedding, Python): {d['outside_linears_share'] * 100:.0f}%."]
    return "\n".join(lines) + "\n"


def _gemm_lines(res: dict) -> list[str]:
    m = res["machine"]["cpu"]
    flags = [f for f in m["flags"] if f.startswith(("avx", "amx", "fma", "f16c"))] if m.get("flags") else []
    lines = [f"# Low-bit GEMM on {res['model']}'s {res['linears']} linear layers",
             "", f"Host: {m['model']}, {m['usable_cpus']} usable CPUs; flags: {' '.join(flags)}",
             f"Kernel path: {res['isa']}; weights as stored: {', '.join(res['formats'])}, "
             f"{res['weight_bytes'] / 1e9:.3f} GB read per pass.", "",
             f"Software prefetch {res.get('prefetch_bytes', '?')} bytes ahead; `no prefetch` is the same pass with it "
             "off, interleaved with it.", "",
             "| threads | rows M | ms per pass | no prefetch ms | ratio | bandwidth bound ms (GB/s) | x bound | t(M)/t(1) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["results"]:
        off = r.get("ms_no_prefetch")
        off_s = f"{off:.1f} | {r['ms'] / off:.2f}" if off else "- | -"
        lines.append(f"| {r['threads']} | {r['rows']} | {r['ms']:.1f} | {off_s} | {r['bound_ms']:.1f} "
                     f"({r['bandwidth_gbps']:.1f}) | {r['x_bound']:.2f} | {r['t_over_t1']:.2f} |")
    return lines


def write_kernel_report(res: dict, out_dir: Path, stem: str) -> list[Path]:
    from ssd.bench.report import write_json_and_markdown

    return write_json_and_markdown(res, kernel_markdown(res), out_dir, stem)


def attention_bench(contexts: list[int], heads: int = 12, kv_heads: int = 2, head_dim: int = 128, layers: int = 28,
                    rows: tuple[int, ...] = (1, 5), repeats: int = 7) -> list[dict]:
    """ms per forward (all `layers`) of attention for one sequence of each context length: the C++
    kernel over the fp16 paged cache vs SDPA over a gathered fp32 copy (the pre-kernel path)."""
    from ssd.layers.attention import AttentionMetadata, paged_attention

    out = []
    for L in contexts:
        slots = torch.randperm(L + 64)[:L]
        kc16 = torch.randn(L + 64, kv_heads, head_dim).half()
        vc16 = torch.randn(L + 64, kv_heads, head_dim).half()
        kc32, vc32 = kc16.float(), vc16.float()
        for T in rows:
            q = torch.randn(T, heads, head_dim)
            k = torch.randn(T, kv_heads, head_dim)
            v = torch.randn(T, kv_heads, head_dim)
            res = {"context": L, "rows": T}
            for name, kernel, kc, vc in (("kernel_fp16", True, kc16, vc16), ("sdpa_fp32_gather", False, kc32, vc32)):
                meta = AttentionMetadata.build([T], [slots], torch.device("cpu"), kernel=kernel)
                paged_attention(q, k, v, kc, vc, meta, head_dim ** -0.5)
                ts = []
                for _ in range(repeats):
                    t0 = time.perf_counter()
                    for _ in range(layers):
                        paged_attention(q, k, v, kc, vc, meta, head_dim ** -0.5)
                    ts.append(time.perf_counter() - t0)
                res[name + "_ms"] = statistics.median(ts) * 1e3
            out.append(res)
            log.info("attention L=%d T=%d: %s", L, T, res)
    return out


def decode_step_share(model: str, context: int = 256, repeats: int = 9) -> dict:
    """Share of an AR decode step (M=1) spent outside the linear layers."""
    from ssd import LLM
    from ssd.engine.model_runner import ForwardItem

    lm = LLM(model, progress=False, kv_cache_gb=0.25)
    runner = lm.engine.target
    linears = [m for m in runner.model.modules() if m.__class__.__name__ == "QuantLinear"]
    ids = list(range(1000, 1000 + context))
    runner.block_manager.allocate(55_555, ids + [7])
    runner.forward([ForwardItem(55_555, ids, 0, 1)])
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.forward([ForwardItem(55_555, [7], context, 1)])
        ts.append(time.perf_counter() - t0)
    runner.block_manager.free(55_555)
    step = statistics.median(ts) * 1e3
    lin = time_pass(linears, 1, repeats)[0]
    return {"context": context, "step_ms": step, "linears_ms": lin, "outside_linears_share": max(0.0, 1 - lin / step)}
