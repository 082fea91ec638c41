"""How much to pre-draft, and which backup answers a miss: pure policies fed with measured timings
(docs/ARCHITECTURE.md 1.1, 1.3). The worker injects its measurements; nothing here runs a model.
"""
from __future__ import annotations

from ssd.speculation.fanout import budget_from_timings


class EMA:
    def __init__(self, value: float, alpha: float = 0.1):
        self.value, self.alpha = value, alpha

    def update(self, x: float) -> None:
        self.value += self.alpha * (x - self.value)


class BudgetPolicy:
    """Chains per sequence per round.

    A draft step over R rows costs t(R) = step_s * (1 + row_cost * (R - 1)) (calibrated once at start)
    times a measured slowdown (target and draft share memory bandwidth). The budget is the most chains
    whose K batched steps, after the catch-up step, end within `safety` of the last verification. At
    least 1: a chain cut short is resumed by the backup, so trying one is never wasted. A fixed budget
    overrides the model; both are capped by the chain pool's share per sequence.
    """

    def __init__(self, k: int, fixed: int | None = None, step_s: float = 0.0, row_cost: float = 1.0,
                 safety: float = 0.9):
        self.k, self.fixed, self.safety = k, fixed, safety
        self.step_s, self.row_cost = step_s, row_cost
        self.slowdown = EMA(1.0, alpha=0.2)     # measured / modelled pre-draft time
        self.verify_s = 0.0                      # last verification, reported by the engine

    def step_time(self, rows: int) -> float:
        return self.step_s * (1 + self.row_cost * (rows - 1))

    def budget(self, nseq: int, cap: int, steps: int | None = None) -> int:
        """steps: the chains' length this round (default K; auto asks for less)."""
        cap = max(1, cap)
        k = self.k if steps is None else max(1, steps)
        if self.fixed is not None:
            return min(self.fixed, cap)
        if not self.step_s or not self.verify_s:
            return 1
        step = self.step_s * self.slowdown.value
        b = budget_from_timings(self.verify_s, step, k, nseq, row_cost=self.row_cost,
                                overhead_s=step * (1 + self.row_cost * (nseq - 1)), safety=self.safety,
                                max_budget=cap)
        return max(1, b)

    def observe_predraft(self, nseq: int, budget: int, completed: bool, took_s: float,
                         steps: int | None = None) -> None:
        """Learn the slowdown: measured over modelled time of a complete pre-draft (of chains `steps`
        long; default K). A pre-draft cut short only says it was slower than the verification allowed."""
        if not self.step_s:
            return
        k = self.k if steps is None else max(1, steps)
        ratio = took_s / (self.step_time(nseq) + k * self.step_time(nseq * budget))
        self.slowdown.update(ratio if completed else max(ratio, self.slowdown.value * 1.25))


class BackupPolicy:
    """neural | fast for a miss in a batch of b sequences.

    One neural miss stalls the whole batch for a just-in-time draft; a fast (prompt-lookup) miss
    stalls nothing but yields fewer tokens. With hit rate h, verification time v, just-in-time time j
    and tokens per round y_hit, y_neural, y_fast:
        neural(b) = (h y_hit + (1 - h) y_neural) / (v + (1 - h^b) j),   fast = (h y_hit + (1 - h) y_fast) / v
    and the fast backup wins from the smallest b with fast > neural(b) (the critical batch size).
    """

    def __init__(self, mode: str, k: int):
        if mode not in ("auto", "neural", "fast"):
            raise ValueError(f"backup must be auto, neural or fast, got {mode!r}")
        self.mode = mode
        self.hit_rate = EMA(0.5)
        self.jit_s = EMA(0.0)
        self.verify_s = 0.0
        self.tokens_per_round = {"cache": EMA(k * 0.7 + 1), "neural": EMA(k * 0.7 + 1), "fast": EMA(1.3)}

    def observe_round(self, source: str, committed: int, hit: bool) -> None:
        """source: cache | neural | fast, where the speculation just verified came from."""
        self.tokens_per_round[source].update(committed)
        self.hit_rate.update(float(hit))

    def choose(self, batch: int) -> str:
        if self.mode != "auto":
            return self.mode
        return "fast" if batch >= self.critical_batch() else "neural"

    def critical_batch(self, limit: int = 256) -> int:
        h, v, jit = self.hit_rate.value, max(self.verify_s, 1e-4), self.jit_s.value
        y = {s: e.value for s, e in self.tokens_per_round.items()}
        fast = (h * y["cache"] + (1 - h) * y["fast"]) / v
        for b in range(1, limit + 1):
            if fast > (h * y["cache"] + (1 - h) * y["neural"]) / (v + (1 - h ** b) * jit):
                return b
        return limit + 1
