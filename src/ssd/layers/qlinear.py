"""Linear and embedding layers over GGUF low-bit weights kept as stored (see ssd/kernels).

`QuantLinear` runs the qgemm kernel: activations are quantized per row and per 32 values to int8
(llama.cpp's approximation, at a finer block), weights are never requantized. A row's result is
bitwise independent of the other rows, of M and of the thread count.
"""
from __future__ import annotations

import torch
from torch import nn

from ssd.kernels.gguf_pack import QWeight, concat_rows, pack


def _groups(parts: list[QWeight]) -> list[list[QWeight]]:
    """Consecutive parts with the same layout go into one GEMM."""
    out: list[list[QWeight]] = []
    for p in parts:
        if out and out[-1][0].layout() == p.layout():
            out[-1].append(p)
        else:
            out.append([p])
    return out


class QuantLinear(nn.Module):
    """y = x @ W.T + b with W given as one or more QWeight row blocks (e.g. q, k, v)."""

    def __init__(self, parts: QWeight | list[QWeight], bias: torch.Tensor | None):
        super().__init__()
        from ssd.kernels.build import forced_isa, load_qgemm

        parts = [parts] if isinstance(parts, QWeight) else list(parts)
        self._ops = load_qgemm()
        self._isa = forced_isa()
        self.in_features = parts[0].shape[1]
        self.out_features = sum(p.shape[0] for p in parts)
        self.backend = "gguf:" + ",".join(sorted({p.fmt for p in parts}))
        self._packed = [pack(g[0] if len(g) == 1 else concat_rows(g)) for g in _groups(parts)]
        self._bytes = sum(p.nbytes_packed() for p in parts)
        bias_parts = [None] * len(self._packed) if bias is None else \
            list(bias.float().contiguous().split([p.N for p in self._packed]))
        self._bias = [None if b is None else b.contiguous() for b in bias_parts]
        self.weight = None
        self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if x2.dtype != torch.float32:
            x2 = x2.float()
        outs = [self._ops.qgemm(x2, p.codes, p.dS, p.dO, p.sc, p.mn, b, p.N, p.SB, p.SUB, p.bits, p.sym, self._isa)
                for p, b in zip(self._packed, self._bias)]
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        return y.reshape(*shape[:-1], self.out_features)

    def weight_bytes(self) -> int:
        return self._bytes


class QuantEmbedding(nn.Module):
    """Token embedding rows dequantized on demand (exactly gguf's values), never the whole table."""

    def __init__(self, w: QWeight, dtype: torch.dtype):
        super().__init__()
        self.code = torch.from_numpy(w.code)
        self.dS = torch.from_numpy(w.dS.view("int16")).view(torch.float16)
        self.dO = torch.from_numpy(w.dO.view("int16")).view(torch.float16)
        self.sc = None if w.sc is None else torch.from_numpy(w.sc)
        self.mn = None if w.mn is None else torch.from_numpy(w.mn)
        self.SB, self.SUB, self.dtype = w.SB, w.SUB, dtype
        self.num_embeddings, self.embedding_dim = w.shape

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        S = self.dS[tokens].double().repeat_interleave(self.SB, dim=-1)
        O = self.dO[tokens].double().repeat_interleave(self.SB, dim=-1)
        if self.sc is not None:
            S = S * self.sc[tokens].double().repeat_interleave(self.SUB, dim=-1)
        if self.mn is not None:
            O = O * self.mn[tokens].double().repeat_interleave(self.SUB, dim=-1)
        return (S * self.code[tokens].double() + O).to(self.dtype)

    def element_size(self) -> float:
        return self.code.element_size()
