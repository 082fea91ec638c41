"""Which draft worker drafts for which sequence (data-parallel drafts, docs/ARCHITECTURE.md 4.2).

A new sequence goes to the live worker with the fewest live sequences (the lowest index on a tie)
and stays there while it lives. A worker that fails is marked dead: its sequences lose their
worker and are placed again, by the same rule, the next time they need one.
"""
from __future__ import annotations

from typing import Sequence


def pick_worker(loads: Sequence[int], live: Sequence[bool]) -> int | None:
    """The live worker with the fewest sequences, the lowest index on a tie; None when none is live."""
    best = None
    for w, (n, up) in enumerate(zip(loads, live)):
        if up and (best is None or n < loads[best]):
            best = w
    return best


class Assignment:
    """Sequence -> worker, with each worker's load (live sequences) and liveness."""

    def __init__(self, num_workers: int):
        if num_workers < 1:
            raise ValueError(f"need at least one draft worker, got {num_workers}")
        self.owner: dict[int, int] = {}
        self.loads = [0] * num_workers
        self.live = [True] * num_workers

    def num_live(self) -> int:
        return sum(self.live)

    def get(self, seq_id: int) -> int | None:
        return self.owner.get(seq_id)

    def place(self, seq_id: int) -> int | None:
        """The sequence's worker, choosing one if it has none (None: no worker is live)."""
        w = self.owner.get(seq_id)
        if w is None:
            w = pick_worker(self.loads, self.live)
            if w is not None:
                self.owner[seq_id] = w
                self.loads[w] += 1
        return w

    def drop(self, seq_id: int) -> None:
        w = self.owner.pop(seq_id, None)
        if w is not None:
            self.loads[w] -= 1

    def fail(self, w: int) -> list[int]:
        """Mark worker w dead; returns the sequences it held (now without a worker)."""
        self.live[w] = False
        gone = [s for s, o in self.owner.items() if o == w]
        for s in gone:
            del self.owner[s]
        self.loads[w] = 0
        return gone
