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


# two-sided 90% quantiles of Student's t by degrees of freedom (1..30; the normal's beyond)
_T90 = [6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
        1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697]


def paired_ratio(a: list[float | None] | None, b: list[float | None] | None) -> dict | None:
    """a / b over batches that ran on both (same prompts, one right after the other): the geometric
    mean of the per-batch ratios and its 90% t-interval (on the logs; None below 2 pairs). The
    ratio of two single-run aggregates hides how noisy a cell is; this says it."""
    if not a or not b or len(a) != len(b):
        return None
    logs = [math.log(x / y) for x, y in zip(a, b) if x and y]
    if not logs:
        return None
    n, mean = len(logs), sum(logs) / len(logs)
    out = {"n": n, "ratio": math.exp(mean), "lo": None, "hi": None}
    if n >= 2:
        sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
        half = (_T90[n - 2] if n - 1 <= len(_T90) else 1.645) * sd / math.sqrt(n)
        out.update(lo=math.exp(mean - half), hi=math.exp(mean + half))
    return out


def goal_verdict(p: dict | None, goal: float = 0.97) -> str:
    """'met' (the interval lies at or above the goal), 'missed' (below it), 'within noise' (it
    straddles it), or 'one batch' (no interval)."""
    if p is None:
        return "-"
    if p["lo"] is None:
        return "one batch"
    return "met" if p["lo"] >= goal else "missed" if p["hi"] < goal else "within noise"


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
        paired = paired_ratio(a.get("batch_" + key), best.get("batch_" + key))
        out.append({"batch_size": bs, "dataset": ds, "best_fixed": best_lab, "best_fixed_value": best[key],
                    "auto_value": a[key], "auto_vs_best": a[key] / best[key],
                    "auto_plain_round_share": a.get("auto_plain_round_share"),
                    "auto_worker_round_share": a.get("auto_worker_round_share"),
                    "auto_rows_by_num_draft": a.get("auto_rows_by_num_draft"),
                    "auto_worker_rows_by_num_draft": a.get("auto_worker_rows_by_num_draft"), "paired": paired,
                    "verdict": goal_verdict(paired)})
    return out


def _k_shares(rows_by_k: list[int], worker_rows_by_k: list[int]) -> str:
    """The chosen draft lengths' shares of sequence-rounds (0..K); with a worker, local and SSD rounds apart."""
    def shares(xs):
        return " ".join(f"{n / sum(xs):.2f}" for n in xs) if sum(xs) else "-"
    if not sum(worker_rows_by_k):
        return shares(rows_by_k)
    w = list(worker_rows_by_k) + [0] * (len(rows_by_k) - len(worker_rows_by_k))
    return f"local {shares([a - b for a, b in zip(rows_by_k, w)])}; SSD {shares(w)}"


def auto_markdown(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    out = ["", "auto against the best fixed configuration of the same cell (decode tokens/s; goal >= 0.97x). "
           "Paired: per batch of prompts (each ran on both, one right after the other), the geometric mean of "
           "auto / best and its 90% interval; the verdict compares the interval with the goal (the best is "
           "picked after the fact, which favours it):",
           "", "| batch | dataset | best fixed | its tok/s | auto tok/s | auto / best | paired batches | paired "
           "ratio [90% CI] | verdict | auto plain rounds | auto SSD rounds | auto K shares (0..K) |",
           "| ---: | --- | --- | ---: | ---: | ---: | ---: | --- | --- | ---: | ---: | --- |"]
    share_of = lambda x: "-" if x is None else f"{x:.2f}"     # noqa: E731
    for r in rows:
        share = r.get("auto_plain_round_share")
        k_shares = _k_shares(r.get("auto_rows_by_num_draft") or [], r.get("auto_worker_rows_by_num_draft") or [])
        p = r.get("paired")
        if p is None:
            n, ci = "-", "-"
        else:
            n = str(p["n"])
            ci = f"{p['ratio']:.2f}x" + ("" if p["lo"] is None else f" [{p['lo']:.2f}, {p['hi']:.2f}]")
        out.append(f"| {r['batch_size']} | {r['dataset']} | {r['best_fixed']} | {r['best_fixed_value']:.2f} | "
                   f"{r['auto_value']:.2f} | {r['auto_vs_best']:.2f}x | {n} | {ci} | {r.get('verdict', '-')} | "
                   f"{share_of(share)} | {share_of(r.get('auto_worker_round_share'))} | {k_shares} |")
    return out
