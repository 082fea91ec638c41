"""Benchmark reports: the result dict as JSON, a Markdown summary, and PNG plots.

Result schema (what :func:`write_report` and :func:`markdown_table` take)::

    {
      "machine": {...},            # ssd.bench.machine.machine_info(), optionally plus
                                   #   "bandwidth_gbps": float (measure_bandwidth_gbps)
      "config": {...},             # free-form, flat is best: target/draft model, dtype, threads,
                                   #   max_new_tokens, prompts per dataset, draft length k, seed ...
                                   #   an optional "title" names the report
      "runs": [                    # one entry per (dataset, mode)
        {
          "dataset": str,          # "humaneval" | "gsm8k" | "mtbench" | "sharegpt" | ...
          "mode": str,             # "ar" | "sd" | "ssd" (our engine) | "hf" | "hf-assisted" (peers)
          "label": str,            # optional display name, defaults to mode
          "tokens_per_s": float,   # aggregate: all generated tokens / all generation wall time
                                   #   (end to end, prefill included)
          "tokens_per_s_median": float | None,   # median over prompts of per-prompt tokens/s
          "decode_tokens_per_s": float | None,   # optional: aggregate, prefill excluded
          "decode_tokens_per_s_median": float | None,  # optional
          "ttft_ms_median": float | None,        # time to first token, median over prompts
          "acceptance_rate": float | None,       # accepted / proposed draft tokens (None for AR)
          "mean_accepted_len": float | None,     # generated tokens per target forward pass
                                                 #   (1.0 for AR; for SD this is accepted + 1)
          "acceptance_by_position": list[float] | None,
                                   # entry i: fraction of verification steps in which draft
                                   #   token i (0-based) was accepted (so positions < i were too)
          "num_prompts": int,
          "generated_tokens": int,
          ...                      # any further keys are kept in the JSON and ignored here
        },
        ...
      ]
    }

Missing optional keys are treated as ``None`` and shown as ``-``. The "× AR" columns divide a
run's throughput by that of the ``"ar"`` run of the same dataset.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MODE_ORDER = ("ar", "sd", "ssd", "hf", "hf-assisted")
_DASH = "-"


# --------------------------------------------------------------------------- helpers


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return dataclasses.asdict(obj)
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "tolist"):  # numpy / torch scalars and arrays
        return obj.tolist()
    if isinstance(obj, (set, tuple)):
        return list(obj)
    return str(obj)


def _num(x: Any) -> float | None:
    if x is None or isinstance(x, bool):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return None if math.isnan(v) else v


def _fmt(x: Any, digits: int = 2, suffix: str = "") -> str:
    v = _num(x)
    return _DASH if v is None else f"{v:.{digits}f}{suffix}"


def _label(run: dict) -> str:
    return str(run.get("label") or run.get("mode") or "?")


def _ordered_runs(runs: Iterable[dict]) -> list[dict]:
    runs = list(runs)
    datasets: list[str] = []
    for r in runs:
        if r.get("dataset") not in datasets:
            datasets.append(r.get("dataset"))

    def key(ir: tuple[int, dict]) -> tuple:
        i, r = ir
        mode = r.get("mode")
        mode_rank = MODE_ORDER.index(mode) if mode in MODE_ORDER else len(MODE_ORDER)
        bs = r.get("batch_size")
        return (bs is not None, bs or 0, datasets.index(r.get("dataset")), mode_rank, i)

    return [r for _, r in sorted(enumerate(runs), key=key)]


def _ar_baselines(runs: list[dict], field: str) -> dict[Any, float]:
    base: dict[Any, float] = {}
    for r in runs:
        v = _num(r.get(field))
        key = (r.get("dataset"), r.get("batch_size"))
        if r.get("mode") == "ar" and v and key not in base:
            base[key] = v
    return base


def _ratio(run: dict, base: dict[Any, float], field: str) -> str:
    v, b = _num(run.get(field)), base.get((run.get("dataset"), run.get("batch_size")))
    return _DASH if v is None or not b else f"{v / b:.2f}x"


# --------------------------------------------------------------------------- markdown


def markdown_table(result: dict) -> str:
    """The results as a Markdown table, one row per run (dataset x mode)."""
    runs = _ordered_runs(result.get("runs") or [])
    has_decode = any(_num(r.get("decode_tokens_per_s")) is not None for r in runs)
    tps_base = _ar_baselines(runs, "tokens_per_s")
    dec_base = _ar_baselines(runs, "decode_tokens_per_s")

    batched = len({r.get("batch_size") for r in runs}) > 1
    header = ["dataset"] + (["batch"] if batched else []) + ["mode", "prompts", "tokens", "tok/s", "tok/s median",
                                                             "x AR"]
    if has_decode:
        header += ["decode tok/s", "decode x AR"]
    header += ["accept rate", "tokens/target fwd", "TTFT ms median"]
    aligns = ["---"] + (["---:"] if batched else []) + ["---"] + ["---:"] * (len(header) - 2 - batched)
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(aligns) + " |"]
    for r in runs:
        row = [str(r.get("dataset", "?"))] + ([str(r.get("batch_size", _DASH))] if batched else []) + [
            _label(r),
            str(r.get("num_prompts", _DASH)),
            str(r.get("generated_tokens", _DASH)),
            _fmt(r.get("tokens_per_s")),
            _fmt(r.get("tokens_per_s_median")),
            _ratio(r, tps_base, "tokens_per_s"),
        ]
        if has_decode:
            row += [_fmt(r.get("decode_tokens_per_s")), _ratio(r, dec_base, "decode_tokens_per_s")]
        row += [
            _fmt(r.get("acceptance_rate"), 3),
            _fmt(r.get("mean_accepted_len"), 2),
            _fmt(r.get("ttft_ms_median"), 1),
        ]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def tensor_parallel_table(result: dict) -> str:
    """Per run and rank: a decode step's time split into compute and collectives (and, over shared
    memory, the part of the collectives spent waiting for the slower rank). Empty without TP runs."""
    runs = [r for r in _ordered_runs(result.get("runs") or []) if r.get("tensor_parallel")]
    if not runs:
        return ""
    lines = ["| dataset | batch | mode | transport | rank | decode steps | compute ms/step | collectives ms/step | "
             "of which waiting | collectives share |", "| --- | ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in runs:
        tp = r["tensor_parallel"]
        for rk in tp.get("ranks") or []:
            share = _num(rk.get("decode_allreduce_share"))
            lines.append("| " + " | ".join([
                str(r.get("dataset", "?")), str(r.get("batch_size", _DASH)), _label(r), str(tp.get("transport") or "gloo"),
                str(rk.get("rank")), str(tp.get("decode_steps", _DASH)), _fmt(rk.get("decode_compute_ms_per_step"), 1),
                _fmt(rk.get("decode_allreduce_ms_per_step"), 1), _fmt(rk.get("decode_wait_ms_per_step"), 1),
                _DASH if share is None else f"{share:.0%}"]) + " |")
    return "\n".join(lines) + "\n"


def _machine_lines(m: dict) -> list[str]:
    if not m:
        return ["(no machine info)"]
    out = []
    cpu = m.get("cpu") or {}
    if cpu:
        desc = f"{cpu.get('model') or 'unknown CPU'}"
        counts = [f"{cpu[k]} {k.replace('_', ' ')}" for k in ("logical_cpus", "physical_cores", "usable_cpus")
                  if cpu.get(k) is not None]
        if counts:
            desc += f" ({', '.join(counts)})"
        out.append(f"- CPU: {desc}")
        if cpu.get("flags"):
            out.append(f"- CPU flags: {' '.join(cpu['flags'])}")
    mem = m.get("memory") or {}
    if mem.get("total_gib") is not None:
        out.append(f"- Memory: {mem['total_gib']} GiB total, {mem.get('available_gib', '?')} GiB available")
    if m.get("bandwidth_gbps") is not None:
        out.append(f"- Measured read bandwidth: {_fmt(m['bandwidth_gbps'], 1)} GB/s")
    t = m.get("torch") or {}
    if t:
        out.append(f"- torch {t.get('version')} (CPU capability {t.get('cpu_capability')}), "
                   f"{m.get('torch_threads', '?')} threads")
    for d in m.get("cuda_devices") or []:
        out.append(f"- CUDA device {d.get('index')}: {d.get('name')} ({d.get('memory_gib')} GiB)")
    if m.get("python") or m.get("platform"):
        out.append(f"- Python {m.get('python', '?')} on {m.get('platform', '?')}")
    if m.get("date"):
        out.append(f"- Date: {m['date']}")
    known = {"cpu", "memory", "bandwidth_gbps", "torch", "torch_threads", "cuda_devices", "python",
             "platform", "date", "machine"}
    for k, v in m.items():
        if k not in known:
            out.append(f"- {k}: {v}")
    return out


def _config_lines(cfg: dict) -> list[str]:
    if not cfg:
        return ["(no config)"]
    lines = ["| setting | value |", "| --- | --- |"]
    for k, v in cfg.items():
        if k == "title":
            continue
        text = json.dumps(v, default=_jsonable) if isinstance(v, (dict, list)) else str(v)
        lines.append(f"| {k} | {text.replace('|', '&#124;')} |")
    return lines


def _markdown_report(result: dict, stem: str, images: dict[str, Path]) -> str:
    cfg = result.get("config") or {}
    parts = [f"# {cfg.get('title') or f'Benchmark {stem}'}", "", "## Machine", "",
             *_machine_lines(result.get("machine") or {}), "", "## Configuration", "",
             *_config_lines(cfg), "", "## Results", "", markdown_table(result).rstrip("\n"), "",
             "tok/s: generated tokens / generation wall time (aggregate over prompts, prefill "
             "included); decode tok/s excludes the prefill; x AR: ratio to our autoregressive "
             "run on the same dataset; accept rate: accepted / proposed draft tokens; "
             "tokens/target fwd: mean accepted length, generated tokens per target forward.", ""]
    tp = tensor_parallel_table(result)
    if tp:
        parts += ["## Tensor parallel: time per decode step, per rank", "", tp.rstrip("\n"), "",
                  "Decode steps: target forwards whose every query is at most 16 tokens (prefills excluded). "
                  "compute: the rank's forward minus its collectives; collectives: its all-reduces and the "
                  "logits gather, waiting for the other ranks included (`of which waiting`: that wait alone, "
                  "measured over shared memory only); share: collectives / the rank's whole step.", ""]
    titles = {"png_tokens_per_s": "Throughput", "png_acceptance_by_position": "Acceptance by draft position",
              "png_by_batch_size": "Throughput by batch size"}
    for key, path in images.items():
        parts += [f"## {titles.get(key, key)}", "", f"![{titles.get(key, key)}]({path.name})", ""]
    return "\n".join(parts)


# --------------------------------------------------------------------------- plots


def _plot_tokens_per_s(runs: list[dict], path: Path, title: str) -> bool:
    from matplotlib.figure import Figure

    runs = [r for r in runs if _num(r.get("tokens_per_s")) is not None]
    if not runs:
        return False
    batched = len({r.get("batch_size") for r in runs}) > 1

    def group(r):
        return f"{r.get('dataset')} b{r.get('batch_size')}" if batched else r.get("dataset")
    datasets = list(dict.fromkeys(group(r) for r in runs))
    labels = list(dict.fromkeys(_label(r) for r in runs))
    value = {(group(r), _label(r)): _num(r.get("tokens_per_s")) for r in runs}
    fig = Figure(figsize=(max(6.0, 1.5 + len(datasets) * (0.6 + 0.4 * len(labels))), 4.5))
    ax = fig.add_subplot()
    width = 0.8 / len(labels)
    for j, lab in enumerate(labels):
        xs, ys = [], []
        for i, d in enumerate(datasets):
            if (d, lab) in value:
                xs.append(i - 0.4 + width * (j + 0.5))
                ys.append(value[(d, lab)])
        bars = ax.bar(xs, ys, width=width, label=lab)
        ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=2)
    ax.set_xticks(range(len(datasets)), [str(d) for d in datasets])
    ax.set_ylabel("tokens/s (aggregate)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax.margins(y=0.12)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _plot_acceptance(runs: list[dict], path: Path, title: str) -> bool:
    from matplotlib.figure import Figure

    runs = [r for r in runs if r.get("acceptance_by_position")]
    if not runs:
        return False
    smallest = min((r.get("batch_size") or 1) for r in runs)     # one batch size, else too many lines
    runs = [r for r in runs if (r.get("batch_size") or 1) == smallest]
    # colour = dataset, line style and marker = mode
    datasets = list(dict.fromkeys(r.get("dataset") for r in runs))
    labels = list(dict.fromkeys(_label(r) for r in runs))
    styles, markers = ("-", "--", ":", "-."), ("o", "s", "^", "D")
    fig = Figure(figsize=(6.5, 4.5))
    ax = fig.add_subplot()
    for r in runs:
        ys = [_num(v) for v in r["acceptance_by_position"]]
        xs = [i + 1 for i, y in enumerate(ys) if y is not None]
        j = labels.index(_label(r))
        ax.plot(xs, [y for y in ys if y is not None], color=f"C{datasets.index(r.get('dataset')) % 10}",
                linestyle=styles[j % len(styles)], marker=markers[j % len(markers)],
                label=f"{r.get('dataset')} / {_label(r)}")
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate")
    ax.set_ylim(0, 1.05)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _plot_by_batch_size(runs: list[dict], path: Path, title: str, field: str = "decode_tokens_per_s") -> bool:
    """One panel per dataset: throughput by batch size, one line per configuration, auto highlighted."""
    from matplotlib.figure import Figure

    runs = [r for r in runs if _num(r.get(field)) is not None and r.get("batch_size") is not None]
    if len({r["batch_size"] for r in runs}) < 2:
        return False
    datasets = list(dict.fromkeys(r.get("dataset") for r in runs))
    labels = list(dict.fromkeys(_label(r) for r in runs))
    fig = Figure(figsize=(4.2 * len(datasets) + 1.5, 4.2))
    axes = [fig.add_subplot(1, len(datasets), i + 1) for i in range(len(datasets))]
    for ax, d in zip(axes, datasets):
        for j, lab in enumerate(labels):
            pts = sorted((r["batch_size"], _num(r.get(field))) for r in runs
                         if r.get("dataset") == d and _label(r) == lab)
            if not pts:
                continue
            auto = lab.startswith("auto")
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=lab, marker="o" if auto else ".",
                    linewidth=3.0 if auto else 1.2, color="black" if auto else f"C{j % 10}",
                    zorder=3 if auto else 2, alpha=1.0 if auto else 0.8)
        ax.set_xticks(sorted({r["batch_size"] for r in runs}))
        ax.set_xlabel("batch size")
        ax.set_title(str(d), fontsize=10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("decode tokens/s (aggregate)" if field.startswith("decode") else "tokens/s (aggregate)")
    axes[-1].legend(fontsize=7, loc="best")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


# --------------------------------------------------------------------------- entry point


def write_report(result: dict, out_dir: str | Path, stem: str) -> dict[str, Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and, when the data has them and matplotlib is
    installed, ``<stem>_tokens_per_s.png`` and ``<stem>_acceptance_by_position.png`` into
    ``out_dir`` (created if needed).

    Returns the written paths under the keys ``json``, ``md``, ``png_tokens_per_s``,
    ``png_acceptance_by_position`` (the PNG keys only when written).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}

    paths["json"] = out / f"{stem}.json"
    paths["json"].write_text(json.dumps(result, indent=2, default=_jsonable) + "\n", encoding="utf-8")

    runs = _ordered_runs(result.get("runs") or [])
    title = (result.get("config") or {}).get("title") or stem
    images: dict[str, Path] = {}
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        logger.warning("matplotlib is not installed; skipping plots (pip install matplotlib)")
    else:
        p = out / f"{stem}_tokens_per_s.png"
        if _plot_tokens_per_s(runs, p, f"{title}: throughput"):
            images["png_tokens_per_s"] = p
        p = out / f"{stem}_by_batch_size.png"
        if _plot_by_batch_size(runs, p, f"{title}: decode throughput by batch size"):
            images["png_by_batch_size"] = p
        p = out / f"{stem}_acceptance_by_position.png"
        if _plot_acceptance(runs, p, f"{title}: acceptance by draft position"):
            images["png_acceptance_by_position"] = p

    paths["md"] = out / f"{stem}.md"
    paths["md"].write_text(_markdown_report(result, stem, images), encoding="utf-8")
    paths.update(images)
    for k, p in paths.items():
        logger.info("wrote %s: %s", k, p)
    return paths


def write_json_and_markdown(result: dict, markdown: str, out_dir: str | Path, stem: str) -> list[Path]:
    """`<stem>.json` (the result, JSON-safe) and `<stem>.md` in out_dir: for the micro-benchmark reports."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    j, md = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    j.write_text(json.dumps(result, indent=2, default=_jsonable) + "\n")
    md.write_text(markdown)
    return [j, md]
