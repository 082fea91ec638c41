"""Micro-benchmark of the low-bit GEMM on a model's real linear layers: ms per pass over all of
them for M rows (1 = decode, 5 = a K=4 verify, 16 = a batch of SSD chains), against the memory
bandwidth bound, at each thread count. `ssd bench --kernels` runs it."""
from __future__ import annotations

import json
import logging
import statistics
import time
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def target_linears(model: str):
    from ssd.models.loader import load_model

    lm = load_model(model, "gguf", progress=False, max_positions=64)
    return lm, [m for m in lm.model.modules() if m.__class__.__name__ == "QuantLinear"]


def time_pass(linears, M: int, repeats: int) -> float:
    xs = {m.in_features: torch.randn(M, m.in_features) for m in linears}
    for m in linears:                       # warm-up
        m(xs[m.in_features])
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for m in linears:
            m(xs[m.in_features])
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def run_kernel_bench(model: str, threads: list[int], rows: list[int], repeats: int = 7) -> dict:
    from ssd.bench.machine import machine_info, measure_bandwidth_gbps
    from ssd.kernels.build import ISA_NAMES, forced_isa, load_qgemm

    lm, linears = target_linears(model)
    nbytes = sum(m.weight_bytes() for m in linears)
    isa = forced_isa()
    isa = load_qgemm().best_isa() if isa < 0 else isa
    out = {"model": model, "linears": len(linears), "weight_bytes": nbytes, "isa": ISA_NAMES[isa],
           "formats": sorted({m.backend for m in linears}), "machine": machine_info(), "results": []}
    prev = torch.get_num_threads()
    try:
        for th in threads:
            bw = measure_bandwidth_gbps(th)
            torch.set_num_threads(th)
            bound = nbytes / (bw * 1e9) * 1e3
            t1 = None
            for M in rows:
                ms = time_pass(linears, M, repeats)
                t1 = ms if M == rows[0] else t1
                out["results"].append({"threads": th, "rows": M, "ms": ms, "bandwidth_gbps": bw,
                                       "bound_ms": bound, "x_bound": ms / bound, "t_over_t1": ms / t1})
                log.info("threads %d M %d: %.1f ms (bound %.1f ms)", th, M, ms, bound)
    finally:
        torch.set_num_threads(prev)
    return out


def kernel_markdown(res: dict) -> str:
    m = res["machine"]["cpu"]
    flags = [f for f in m["flags"] if f.startswith(("avx", "amx", "fma", "f16c"))] if m.get("flags") else []
    lines = [f"# Low-bit GEMM on {res['model']}'s {res['linears']} linear layers",
             "", f"Host: {m['model']}, {m['usable_cpus']} usable CPUs; flags: {' '.join(flags)}",
             f"Kernel path: {res['isa']}; weights as stored: {', '.join(res['formats'])}, "
             f"{res['weight_bytes'] / 1e9:.3f} GB read per pass.", "",
             "| threads | rows M | ms per pass | bandwidth bound ms (GB/s) | x bound | t(M)/t(1) |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in res["results"]:
        lines.append(f"| {r['threads']} | {r['rows']} | {r['ms']:.1f} | {r['bound_ms']:.1f} ({r['bandwidth_gbps']:.1f}) "
                     f"| {r['x_bound']:.2f} | {r['t_over_t1']:.2f} |")
    return "\n".join(lines) + "\n"


def write_kernel_report(res: dict, out_dir: Path, stem: str) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    j, md = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    j.write_text(json.dumps(res, indent=2) + "\n")
    md.write_text(kernel_markdown(res))
    return [j, md]
