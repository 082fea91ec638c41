"""Timeline of target and draft work, written as Chrome/Perfetto trace JSON (`--trace FILE`).

Spans use time.perf_counter (CLOCK_MONOTONIC on Linux, shared by all processes on a host), so the
SSD draft worker's spans, reported in microseconds with its answers, line up with the engine's."""
from __future__ import annotations

import json
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Span:
    track: str      # "target" | "draft"
    name: str       # "prefill", "decode", "draft", "verify", "wait", "answer", "predraft", ...
    start: float    # seconds, perf_counter clock
    end: float


class Tracer:
    def __init__(self):
        self.spans: list[Span] = []

    @contextmanager
    def span(self, track: str, name: str):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.spans.append(Span(track, name, t0, time.perf_counter()))

    def add(self, track: str, name: str, start: float, end: float) -> None:
        self.spans.append(Span(track, name, start, end))

    def chrome_events(self) -> list[dict]:
        tids = {"target": 1, "draft": 2}
        events = [{"name": "thread_name", "ph": "M", "pid": os.getpid(), "tid": tid, "args": {"name": track}}
                  for track, tid in tids.items()]
        for s in self.spans:
            events.append({"name": s.name, "ph": "X", "pid": os.getpid(), "tid": tids.get(s.track, 3),
                           "ts": s.start * 1e6, "dur": max(s.end - s.start, 0.0) * 1e6, "cat": s.track})
        return events

    def write(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps({"traceEvents": self.chrome_events(), "displayTimeUnit": "ms"}))
        return path


class NullTracer:
    """Tracing off: spans cost one function call."""

    spans: list[Span] = []

    @contextmanager
    def span(self, track: str, name: str):
        yield

    def add(self, track: str, name: str, start: float, end: float) -> None:
        pass
