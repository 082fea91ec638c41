"""auto against the best fixed configuration, pooled over several `ssd bench` JSON reports of the same
configurations (replicates): per (batch size, dataset) cell, the batches of every report side by side.
A pair never crosses reports (each report's batches ran one right after the other), so the paired
ratio stays valid when the reports ran at different machine speeds; the best fixed configuration is
the one with the highest geometric mean over all the cell's batches, among those in every report.

    ssd bench --pool benchmarks/results/A.json benchmarks/results/B.json
"""
from __future__ import annotations

from ssd.bench.summary import geomean, goal_verdict, paired_ratio

KEY = "batch_decode_tokens_per_s"


def pooled_auto_vs_best(reports: list[dict]) -> list[dict]:
    """One row per (batch size, dataset) cell that has an auto run and a fixed one in every report."""
    cells: dict[tuple, dict[str, list[list[float]]]] = {}
    for rep in reports:
        for r in rep["runs"]:
            if r.get("mode") in ("ar", "sd", "ssd", "auto") and r.get(KEY):
                cell = cells.setdefault((r.get("batch_size"), r["dataset"]), {})
                # auto matched by mode: its label names the K it may reach ("auto" where --k gave one
                # value, "auto k<=4" over a K grid), and a report holds one auto run per cell
                label = "auto" if r["mode"] == "auto" else r.get("label") or r["mode"]
                cell.setdefault(label, []).append(list(r[KEY]))
    out = []
    for (bs, ds), by_label in cells.items():
        full = {lab: sum(parts, []) for lab, parts in by_label.items() if len(parts) == len(reports)}
        autos = [lab for lab in full if lab.startswith("auto")]
        fixed = [lab for lab in full if not lab.startswith("auto")]
        if not autos or not fixed:
            continue
        means = {lab: geomean(xs) for lab, xs in full.items()}
        best = max(fixed, key=lambda lab: means[lab] or 0.0)
        auto = autos[0]
        vs = {lab: paired_ratio(full[auto], full[lab]) for lab in fixed}
        out.append({"batch_size": bs, "dataset": ds, "reports": len(reports), "best_fixed": best,
                    "geomeans": means, "paired": vs[best], "verdict": goal_verdict(vs[best]), "vs_each": vs})
    return out


def _ci(p: dict | None) -> str:
    if p is None:
        return "-"
    return f"{p['ratio']:.3f}x" + ("" if p["lo"] is None else f" [{p['lo']:.3f}, {p['hi']:.3f}]") + f" n={p['n']}"


def pool_markdown(rows: list[dict]) -> str:
    lines = ["| batch | dataset | best fixed | auto / best, paired [90% CI] | verdict (goal 0.97x) | auto against each |",
             "| ---: | --- | --- | --- | --- | --- |"]
    for r in rows:
        each = "; ".join(f"{lab} {_ci(p)}" for lab, p in r["vs_each"].items())
        lines.append(f"| {r['batch_size']} | {r['dataset']} | {r['best_fixed']} | {_ci(r['paired'])} | "
                     f"{r['verdict']} | {each} |")
    return "\n".join(lines)
