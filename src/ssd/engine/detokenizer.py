"""Incremental detokenization with stop strings and UTF-8-safe streaming.

Emits text deltas only when they are final: an incomplete multi-byte character (decoded as U+FFFD
at the end) and a tail that could still become a stop string are held back.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.text = ""          # final text so far (stop string excluded)
        self.emitted = 0        # characters of self.text already handed out
        self.stopped = False

    def update(self, token_ids: list[int], final: bool = False) -> str:
        """token_ids: the whole output so far. Returns the new text that is safe to show."""
        text = self.tokenizer.decode(token_ids, skip_special_tokens=True)
        hold = 0
        if not final and text.endswith("\ufffd"):
            hold = 1
        if self.stop:
            cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                text, hold, self.stopped = text[:cut], 0, True
            elif not final:
                hold = max(hold, self._stop_prefix_len(text))
        self.text = text
        safe = len(text) - hold if not self.stopped else len(text)
        delta = text[self.emitted:safe] if safe > self.emitted else ""
        self.emitted = max(self.emitted, safe)
        return delta

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of text that is a proper prefix of some stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:n]):
                    best = max(best, n)
                    break
        return best
