"""Weights read straight from a GGUF file, low-bit tensors kept as stored.

`GGUFWeights(path)(hf_name)` returns a `QWeight` for the types the low-bit kernel runs (Q4_K, Q6_K,
Q5_0, Q8_0, Q4_0, Q4_1) and a float32 tensor otherwise (F32/F16/BF16 tensors, and quantized types
the kernel lacks, dequantized with the gguf package; those are logged once per type). Nothing is
converted to 16 bits on the way. Llama-family Q/K rows are un-permuted like the converter does.
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from ssd.kernels.gguf_pack import GGML_TYPES, QWeight, unpack
from ssd.models.gguf_convert import _PERMUTED_QK, FastGGUFReader, _hf_name, _hf_shape, _unpermute_qk

log = logging.getLogger(__name__)
_FLOAT_TYPES = {"F32", "F16", "BF16"}


class GGUFWeights:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.reader = FastGGUFReader(str(self.path))
        arch = self.reader.fields["general.architecture"].contents()
        self.arch = arch
        f = self.reader.fields
        self.n_heads = int(f[f"{arch}.attention.head_count"].contents())
        kv = f.get(f"{arch}.attention.head_count_kv")
        self.n_kv = int(kv.contents()) if kv is not None else self.n_heads
        self._by_hf = {}
        for t in self.reader.tensors:
            if t.name == "rope_freqs.weight":
                continue
            self._by_hf[_hf_name(t.name)] = t
        self._noted: set[str] = set()

    def _perm(self, gguf_name: str, rows: int) -> np.ndarray | None:
        if self.arch not in _PERMUTED_QK:
            return None
        if ".attn_q." in gguf_name:
            return _unpermute_qk(np.arange(rows), self.n_heads)
        if ".attn_k." in gguf_name:
            return _unpermute_qk(np.arange(rows), self.n_kv)
        return None

    def _tensor(self, name: str):
        t = self._by_hf.get(name)
        if t is None:
            raise KeyError(f"weight {name!r} is missing from {self.path.name}")
        return t

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(_hf_shape(self._tensor(name)))

    def block(self, name: str) -> int:
        """Values per quant block along the input dimension (1: a float tensor)."""
        t = self._tensor(name)
        tid = int(t.tensor_type)
        return GGML_TYPES[tid][1] if tid in GGML_TYPES and len(_hf_shape(t)) == 2 else 1

    def part(self, name: str, rows=None, cols=None) -> "torch.Tensor | QWeight":
        """Rows [r0, r1) (after the Q/K un-permutation, which stays within a head) and/or input columns
        [c0, c1) (on quant-block bounds) of a weight, reading only those bytes of the mapped file."""
        t = self._tensor(name)
        shape = _hf_shape(t)
        tid = int(t.tensor_type)
        perm = self._perm(t.name, shape[0])
        idx = np.arange(shape[0]) if perm is None else perm
        if rows is not None:
            idx = idx[rows[0]:rows[1]]
        if tid in GGML_TYPES and len(shape) == 2:
            fmt, bs, nbytes = GGML_TYPES[tid]
            raw = np.asarray(t.data).reshape(shape[0], -1)
            raw = raw[idx] if (rows is not None or perm is not None) else raw
            K = shape[1]
            if cols is not None:
                if cols[0] % bs or cols[1] % bs:
                    raise ValueError(f"{name}: {fmt} columns [{cols[0]}, {cols[1]}) do not fall on its blocks of {bs}")
                raw, K = raw[:, cols[0] // bs * nbytes:cols[1] // bs * nbytes], cols[1] - cols[0]
            return unpack(np.ascontiguousarray(raw), tid, (raw.shape[0], K))
        if t.tensor_type.name in ("F32", "F16"):
            w = np.asarray(t.data).reshape(shape)
            w = w[idx] if (rows is not None or perm is not None) else w
        else:       # BF16 and types without a kernel: dequantized whole, then sliced
            w = self(name).numpy()
            w = w[rows[0]:rows[1]] if rows is not None else w
        if cols is not None:
            w = w[:, cols[0]:cols[1]]
        return torch.from_numpy(np.array(w, dtype=np.float32, order="C"))

    def __call__(self, name: str) -> "torch.Tensor | QWeight":
        t = self._tensor(name)
        shape = _hf_shape(t)
        tid = int(t.tensor_type)
        tname = t.tensor_type.name
        perm = self._perm(t.name, shape[0])
        if tid in GGML_TYPES and len(shape) == 2:
            q = unpack(np.asarray(t.data).reshape(shape[0], -1), tid, shape)
            return q.rows(perm) if perm is not None else q
        from gguf.quants import dequantize

        if tname not in _FLOAT_TYPES and tname not in self._noted:
            self._noted.add(tname)
            log.info("%s: %s tensors have no low-bit kernel; they run dequantized (fp16 weights)",
                     self.path.name, tname)
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if perm is not None:
            w = w[perm]
        return torch.from_numpy(np.array(w, dtype=np.float32, order="C"))
