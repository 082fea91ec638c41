"""Gantt chart of target and draft work for a few decoding rounds, one panel per mode."""
from __future__ import annotations

import logging
from pathlib import Path

log = logging.getLogger(__name__)

COLORS = {"prefill": "#999999", "worker prefill": "#bbbbbb", "decode": "#1f77b4", "verify": "#1f77b4",
          "draft": "#ff7f0e", "answer": "#9467bd", "predraft": "#2ca02c", "wait": "#d62728"}


def window(spans: list[tuple[str, str, float, float]], skip_rounds: int = 3, length_s: float = 1.5):
    """Spans (track, name, start, end) inside a window that starts at the (skip_rounds+1)-th target
    decode/verify span, times made relative to it."""
    prefills = [s[3] for s in spans if s[0] == "target" and s[1] == "prefill"]
    after = max(prefills, default=float("-inf"))     # the last request's decoding, unbroken by prefills
    rounds = sorted(s[2] for s in spans if s[0] == "target" and s[1] in ("decode", "verify") and s[2] >= after)
    if not rounds:
        return []
    t0 = rounds[min(skip_rounds, len(rounds) - 1)]
    return [(tr, name, a - t0, b - t0) for tr, name, a, b in spans if b > t0 and a < t0 + length_s]


def render_timeline(timelines: dict[str, list[tuple[str, str, float, float]]], path: str | Path,
                    title: str = "decoding timeline") -> Path | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("matplotlib is not installed: no timeline plot")
        return None
    labels = [k for k, v in timelines.items() if v]
    if not labels:
        return None
    fig, axes = plt.subplots(len(labels), 1, figsize=(10, 1.3 * len(labels) + 0.8), sharex=True, squeeze=False)
    seen = set()
    for ax, label in zip(axes[:, 0], labels):
        for track, name, a, b in timelines[label]:
            y = 1 if track == "target" else 0
            lab = None if name in seen else name
            seen.add(name)
            ax.barh(y, max(b - a, 1e-4) * 1e3, left=a * 1e3, height=0.6, color=COLORS.get(name, "#8c564b"),
                    edgecolor="white", linewidth=0.5, label=lab)
        ax.set_yticks([0, 1], ["draft", "target"])
        ax.set_ylabel(label, rotation=0, ha="right", va="center", fontweight="bold")
        ax.set_xlim(0, None)
    axes[-1, 0].set_xlabel("ms")
    fig.legend(loc="lower center", ncol=len(seen), fontsize=8, frameon=False)
    fig.suptitle(title, x=0.02, ha="left")
    fig.tight_layout(rect=(0, 0.05, 1, 0.95))
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
