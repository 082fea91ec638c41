"""auto's price of drafting in a worker (SSD) round: the target waits for the worker only when the
speculation cache misses (docs/ARCHITECTURE.md 4.1).

A round with K_b draft tokens for sequence b is a hit when the worker had pre-drafted for the outcome
of the previous round. With one draft core its pre-drafting goes almost all to the outcome "every
draft token accepted" (measured on the default pair: a hit rate of 0.89-0.94 after a fully accepted
round, 0-0.18 after any other), so a sequence whose per-token acceptance is a hits with probability

    p_b = h_full * a^K_b + h_part * (1 - a^K_b)

and the round (a batch waits for its slowest lookup) with probability prod_b p_b. A hit costs the
lookup (`hit_s`); a miss makes the worker draft the K = max K_b tokens while the target waits
(`hit_s + K * per_token_s`). A longer K commits more tokens per verify but misses more often and
waits longer on a miss: that is why SSD at K = 4 ran 7-17% slower than at K = 2 on a 2-core host,
which a chooser that priced worker drafting at zero could not see.

A round in which the worker first takes back sequences it does not hold (auto_ssd after a local stint
in which the target had the worker's cores) also waits for the worker to prefill their contexts:
`retake_s` per token it prefills (the context beyond the prefix it still holds: see step.retake_tokens),
measured from such rounds (the round's expected miss wait taken off).

All these quantities are measured from the rounds auto runs anyway (running means that turn into
exponential averages), starting from priors in units of the cost model (see chooser.UNIT_ROUNDS).
"""
from __future__ import annotations


def hit_probability(acceptance: list[float], num_draft: list[int], h_full: float, h_part: float) -> float:
    """Probability that every lookup of a round hits the speculation cache (sequences that draft nothing
    look nothing up)."""
    p = 1.0
    for a, k in zip(acceptance, num_draft):
        if k > 0:
            full = a ** k
            p *= h_full * full + h_part * (1.0 - full)
    return p


class Mean:
    """A running mean of the first `1 / alpha` observations (after a prior worth `weight` of them), then
    an exponential average with weight alpha."""

    def __init__(self, prior: float, weight: float = 2.0, alpha: float = 0.1):
        self.value, self.n, self.cap = prior, weight, 1.0 / alpha

    def add(self, x: float) -> None:
        self.n = min(self.n + 1.0, self.cap)
        self.value += (x - self.value) / self.n


class WorkerWait:
    """Expected wait for the worker in a round with these draft lengths, in the cost model's units."""

    def __init__(self, h_full: float = 0.9, h_part: float = 0.1, hit_s: float = 0.02, per_token_s: float = 0.3,
                 retake_s: float = 0.02):
        self.h_full, self.h_part = Mean(h_full), Mean(h_part)
        self.hit_s, self.per_token_s = Mean(hit_s), Mean(per_token_s)
        self.retake_s = Mean(retake_s, weight=1.0)
        self.rounds = 0          # worker rounds observed (hits and misses; not retakes)

    def measured(self, min_rounds: int = 5) -> bool:
        """Whether enough worker rounds were observed to predict the worker regime. Counted in rounds, not
        in misses: with a hit rate of 0.8 a first 16-round stint (its first rounds set the cost model's
        unit) saw two or three misses, so a count of misses left the worker unpredicted after it; its next
        visit, 128 rounds on, then ran although the worker had measured half the local regime's rate."""
        return self.rounds >= min_rounds

    def expected(self, acceptance: list[float], num_draft: list[int]) -> float:
        k = max(num_draft, default=0)
        if k <= 0:
            return 0.0
        p = hit_probability(acceptance, num_draft, self.h_full.value, self.h_part.value)
        return self.hit_s.value + (1.0 - p) * k * max(self.per_token_s.value, 0.0)

    def grow_wait(self, acceptance: list[float], old: list[int], new: list[int]) -> float:
        """The one-off extra wait (units) of the first round after lengthening asks from `old` to `new`: the
        chains the worker pre-drafted are `old` long, so where one would have hit, the worker first finishes
        it (a partial hit: the added steps, drafted while the target waits)."""
        grow = max((n - o for n, o in zip(new, old)), default=0)
        if grow <= 0:
            return 0.0
        p = hit_probability(acceptance, old, self.h_full.value, self.h_part.value)
        return p * grow * max(self.per_token_s.value, 0.0)

    def observe_lookup(self, previous_fully_accepted: bool, hit: bool) -> None:
        """One sequence's cache lookup (it speculated last round and asks for tokens now)."""
        (self.h_full if previous_fully_accepted else self.h_part).add(float(hit))

    def observe_round(self, all_hit: bool, k: int, wait: float) -> None:
        """The target waited `wait` (units) for a round whose longest draft was k tokens. Rounds in which
        the worker first took sequences back (their whole context to prefill) are not for this."""
        if k <= 0:
            return
        self.rounds += 1
        if all_hit:
            self.hit_s.add(wait)
        else:
            self.per_token_s.add(max(wait - self.hit_s.value, 0.0) / k)

    def observe_retake(self, tokens: int, k: int, wait: float) -> None:
        """The target waited `wait` (units) for a round in which the worker first prefilled `tokens` tokens
        of context it did not hold, and drafted up to k tokens (counted as a miss)."""
        if tokens > 0:
            miss = self.hit_s.value + k * max(self.per_token_s.value, 0.0)
            self.retake_s.add(max(wait - miss, 0.0) / tokens)
