"""`ssd bench` summaries: geometric means and ratios per mode, SSD cache metrics, the AR
bandwidth bound, and auto against the best fixed configuration in every cell."""
from __future__ import annotations

import math
from typing import Any

PEERS = ("hf", "hf-assisted", "llama.cpp")


def geomean(xs: list[float]) -> float | None:
    xs = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else None


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


def _f(x, d=2, suffix=""):
    return "-" if x is None else f"{x:.{d}f}{suffix}"


def _summary_table(summary: dict) -> list[str]:
    bases = [b for b in ("ar", "sd", *PEERS) if any(f"vs_{b}" in e for e in summary.values())]
    header = ["mode", "tok/s geomean", "decode tok/s geomean"]
    for b in bases:
        header += [f"x {b}", f"decode x {b}"]
    header.append("matches AR")
    lines = ["| " + " | ".join(header) + " |", "| --- | " + " | ".join(["---:"] * (len(header) - 1)) + " |"]
    for lab, e in summary.items():
        row = [lab, _f(e.get("tokens_per_s_geomean")), _f(e.get("decode_tokens_per_s_geomean"))]
        for b in bases:
            same = b == lab
            row += ["1.00x" if same else _f(e.get(f"vs_{b}"), 2, "x"),
                    "1.00x" if same else _f(e.get(f"decode_vs_{b}"), 2, "x")]
        row.append(_f(e.get("matches_ar"), 2))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def summary_markdown(result: dict) -> str:
    """The summary (geomeans and ratios; one table per batch size when several ran), SSD cache
    metrics, auto against the best fixed configuration, and the AR bandwidth bound as Markdown."""
    by_batch = result.get("summary_by_batch_size") or {}
    summary = result.get("summary") or {}
    if not summary and not by_batch:
        return ""
    f = _f
    out = ["Geometric means over datasets; x: geometric mean of per-dataset throughput ratios (overall = "
           "prefill included; decode = after the first token); x sd compares SSD with SD at the same k; "
           "matches AR: fraction of prompts with token ids identical to our AR run (greedy exactness canary)."]
    if by_batch:
        for bs, s in by_batch.items():
            out += ["", f"Batch size {bs}:", "", *_summary_table(s)]
    else:
        out += ["", *_summary_table(summary)]
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
            ds = r['dataset'] if r.get("batch_size") in (None, 1) or not by_batch else f"{r['dataset']} b{r['batch_size']}"
            by_k = " ".join("-" if h is None else f"{h:.2f}" for h in r.get("cache_hit_rate_by_k") or [])
            out.append(f"| {ds} | {r.get('label', 'ssd')} | {f(r.get('cache_hit_rate'))} | {by_k or '-'} | "
                       f"{f(r.get('tokens_per_round_on_hit'))} | {f(r.get('tokens_per_round_on_miss'))} | "
                       f"{f(r.get('ms_per_round'), 0)} ({f(r.get('verify_ms_per_round'), 0)}) | "
                       f"{f(r.get('target_idle_fraction'))} | {f(r.get('draft_busy_fraction'))} | "
                       f"{r.get('degraded_from') or '-'} |")
    bound = [r for r in result.get("runs", []) if r.get("bandwidth_bound_ms_per_token") is not None]
    if bound:
        out += ["", "AR memory-bandwidth bound (weights read once per decode step, "
                f"{result['machine'].get('bandwidth_gbps', 0):.1f} GB/s measured):", ""]
        for r in bound:
            where = r['dataset'] if not by_batch else f"{r['dataset']} batch {r.get('batch_size')}"
            out.append(f"- {where}: bound {r['bandwidth_bound_ms_per_token']:.3g} ms/token "
                       f"({1e3 / r['bandwidth_bound_ms_per_token']:.3g} tok/s), measured "
                       f"{f(r.get('measured_ms_per_token'), 1)} ms/token"
                       + (f" ({r['bandwidth_utilization'] * 100:.0f}% of the bound)"
                          if r.get("bandwidth_utilization") else ""))
    out += auto_markdown(auto_vs_best(result.get("runs", [])))
    return "\n".join(out) + "\n"


def batch_sizes_of(runs: list[dict]) -> list:
    return sorted({r.get("batch_size") for r in runs}, key=lambda b: (b is None, b))


def auto_vs_best(runs: list[dict], key: str = "decode_tokens_per_s") -> list[dict]:
    """Per (batch size, dataset): the best fixed configuration of our engine (AR, SD or SSD at some
    K) and auto's throughput as a multiple of it. The issue's goal is >= 0.97 in every cell."""
    cells: dict[tuple, dict[str, dict]] = {}
    for r in runs:
        if r.get("mode") in ("ar", "sd", "ssd", "auto"):
            cells.setdefault((r.get("batch_size"), r["dataset"]), {})[r.get("label") or r["mode"]] = r
    out = []
    for (bs, ds), by_label in cells.items():
        autos = [r for r in by_label.values() if r["mode"] == "auto" and r.get(key)]
        fixed = [(lab, r) for lab, r in by_label.items() if r["mode"] != "auto" and r.get(key)]
        if not autos or not fixed:
            continue
        best_lab, best = max(fixed, key=lambda lr: lr[1][key])
        a = autos[0]
        out.append({"batch_size": bs, "dataset": ds, "best_fixed": best_lab, "best_fixed_value": best[key],
                    "auto_value": a[key], "auto_vs_best": a[key] / best[key],
                    "auto_plain_round_share": a.get("auto_plain_round_share")})
    return out


def auto_markdown(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    out = ["", "auto against the best fixed configuration of the same cell (decode tokens/s; goal >= 0.97x):",
           "", "| batch | dataset | best fixed | its tok/s | auto tok/s | auto / best | auto plain rounds |",
           "| ---: | --- | --- | ---: | ---: | ---: | ---: |"]
    for r in rows:
        share = r.get("auto_plain_round_share")
        out.append(f"| {r['batch_size']} | {r['dataset']} | {r['best_fixed']} | {r['best_fixed_value']:.2f} | "
                   f"{r['auto_value']:.2f} | {r['auto_vs_best']:.2f}x | "
                   f"{'-' if share is None else f'{share:.2f}'} |")
    return out
