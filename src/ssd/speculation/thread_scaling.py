"""auto_ssd where SSD rounds take cores from the target (the equal placement): how much slower the
target's forward runs on the threads it keeps in SSD rounds than on all of them. Measured once, when
the engine starts, on one of the target's MLP blocks (its largest GEMMs; a few ms); it bounds the
worker regime before the worker has run a round (SpeculativeStep.predicted_rate). Not a forward of the
model, and nothing per round."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

ROWS = (1, 4, 16)       # verify rows of a decode batch: 1 x (K + 1) to 4 x (K + 1)


def slowdown(run: Callable[[int], object], few: int, many: int, rows: tuple[int, ...] = ROWS,
             repeats: int = 5) -> float:
    """min over `rows` of (median time of run(rows) on `few` threads) / (median on `many`). The two
    thread counts alternate, so a phase of a shared machine slows both alike; the least ratio is the
    one most favourable to running on fewer threads. torch's thread count is restored."""
    before = torch.get_num_threads()
    ratios = []
    try:
        for r in rows:
            times: dict[int, list[float]] = {few: [], many: []}
            for n in (few, many):        # a first call per thread count is not timed (pools, caches)
                torch.set_num_threads(n)
                run(r)
            for _ in range(repeats):
                for n in (few, many):
                    torch.set_num_threads(n)
                    t0 = time.perf_counter()
                    run(r)
                    times[n].append(time.perf_counter() - t0)
            ratios.append(statistics.median(times[few]) / max(statistics.median(times[many]), 1e-9))
    finally:
        torch.set_num_threads(before)
    return min(ratios)


def target_slowdown(model, few: int, many: int) -> float:
    """slowdown() of the MLP of the target's middle layer (gate/up and down projections)."""
    layer = model.layers[len(model.layers) // 2]
    hidden, ffn = model.cfg.hidden_size, layer.ffn
    gen = torch.Generator().manual_seed(0)
    inputs = {r: (torch.randn(r, hidden, generator=gen).to(model.dtype),
                  torch.randn(r, ffn, generator=gen).to(model.dtype)) for r in ROWS}

    def run(r: int) -> None:
        x, h = inputs[r]
        layer.gate_up(x)
        layer.down(h)

    with torch.inference_mode():
        return slowdown(run, few, many)
