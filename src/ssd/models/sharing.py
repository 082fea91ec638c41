"""Engines in one process may share loaded weights (read-only at inference).

`ssd bench` holds every mode's engine at once to interleave their runs; without sharing, ten
engines over a 1.5B target would load it ten times. Inside `shared_weights()`, loading the same
(model, dtype, device, positions) again returns the first load; each engine keeps its own KV cache.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

_cache: dict | None = None


@contextlib.contextmanager
def shared_weights() -> Iterator[None]:
    """Within the block, `load_cached` returns one model object per distinct load request."""
    global _cache
    outer = _cache
    if outer is None:
        _cache = {}
    try:
        yield
    finally:
        if outer is None:
            _cache = None


def load_cached(load: Callable, spec, dtype: str, device, max_positions: int | None, progress: bool):
    """`load(spec, dtype, device, max_positions, progress)`, memoized inside `shared_weights()`."""
    if _cache is None:
        return load(spec, dtype, device, max_positions, progress)
    key = (str(spec), dtype, str(device), max_positions)
    if key not in _cache:
        _cache[key] = load(spec, dtype, device, max_positions, progress)
    return _cache[key]
