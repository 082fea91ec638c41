"""Partial weight reads: a rank of a tensor-parallel target asks for its rows (column-parallel
layers) or input columns (row-parallel layers) of a weight, and a getter that can (`part`) reads
only those bytes. A getter without `part` falls back to reading the whole tensor and slicing it.

Getter protocol (models/decoder.py `WeightGetter`): `get(name)` -> tensor | QWeight; optionally
`get.part(name, rows, cols)` with half-open (start, stop) ranges or None, and `get.block(name)` ->
the quant block along the input dimension (1 for float weights).
"""
from __future__ import annotations

import torch

from ssd.kernels.gguf_pack import QWeight

Range = "tuple[int, int] | None"


def read_part(get, name: str, rows=None, cols=None):
    if rows is None and cols is None:
        return get(name)
    part = getattr(get, "part", None)
    if part is not None:
        return part(name, rows, cols)
    return slice_weight(get(name), rows, cols)


def weight_block(get, name: str) -> int:
    block = getattr(get, "block", None)
    return 1 if block is None else block(name)


def slice_weight(w, rows=None, cols=None):
    if isinstance(w, QWeight):
        if rows is not None:
            w = w.rows(slice(*rows))
        return w if cols is None else qweight_cols(w, *cols)
    if rows is not None:
        w = w[rows[0]:rows[1]]
    if cols is not None:
        w = w[:, cols[0]:cols[1]]
    return w.contiguous()


def qweight_cols(w: QWeight, c0: int, c1: int) -> QWeight:
    """Input columns [c0, c1) of a low-bit weight; both bounds on its super-blocks (SB values)."""
    if c0 % w.SB or c1 % w.SB:
        raise ValueError(f"{w.fmt} columns [{c0}, {c1}) do not fall on its blocks of {w.SB}")
    sub = lambda a: None if a is None else a[:, c0 // w.SUB:c1 // w.SUB]  # noqa: E731
    return QWeight(w.fmt, w.code[:, c0:c1], w.dS[:, c0 // w.SB:c1 // w.SB], w.dO[:, c0 // w.SB:c1 // w.SB],
                   sub(w.sc), sub(w.mn), w.SB, w.SUB, w.bits, w.sym)


class OnDevice:
    """A getter whose tensors are moved to `device` (parts and blocks passed through)."""

    def __init__(self, get, device: torch.device):
        self.get, self.device = get, device

    def _to(self, w):
        return w.to(self.device) if isinstance(w, torch.Tensor) and self.device.type != "cpu" else w

    def __call__(self, name: str):
        return self._to(self.get(name))

    def part(self, name: str, rows=None, cols=None):
        return self._to(read_part(self.get, name, rows, cols))

    def block(self, name: str) -> int:
        return weight_block(self.get, name)
