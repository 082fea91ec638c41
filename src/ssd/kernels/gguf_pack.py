"""GGUF quantized tensors as they are stored, unpacked into one uniform description and packed
for the low-bit kernel (qgemm.cpp). No weight is requantized: the codes, scales and mins are the
stored ones, only laid out differently.

Uniform description of a weight W [N, K] (`QWeight`): every weight is

    w[n, k] = (dS[n, k // SB] * sc[n, k // SUB]) * code[n, k] + dO[n, k // SB] * mn[n, k // SUB]

with `code` an unsigned integer (uint8), dS/dO fp16 per super-block of SB values and sc/mn
small signed integers per sub-block of SUB values (absent = 1):

    format  SB   SUB  code            dS     dO        sc       mn      stored bits/weight
    Q8_0    32   32   q + 128 (8 bit) d      -128 d    -        -       8.5 -> 9.0
    Q5_0    32   32   q (5 bit)       d      -16 d     -        -       5.5 -> 7.0 (6-bit codes)
    Q4_K    256  32   q (4 bit)       d      -dmin     scale    min     4.5 -> 4.625
    Q6_K    256  16   q (6 bit)       d      -32 d     scale    scale   6.56 -> 6.625
    Q4_0    32   32   q (4 bit)       d      -8 d      -        -       4.5 -> 5.0
    Q4_1    32   32   q (4 bit)       d      m         -        -       5.0 -> 5.0

The scale products are exact in fp32 (fp16 x 8-bit integer), and -128 d, -16 d, -32 d are exact
in fp16, so `dequantize` reproduces the `gguf` package's values bit for bit (tested).
Other GGUF types are not handled here; the loader dequantizes them to 16 bits and says so.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

TILE = 16
BLK = 32

# GGML type id -> (name, elements per block, bytes per block)
GGML_TYPES = {8: ("Q8_0", 32, 34), 6: ("Q5_0", 32, 22), 12: ("Q4_K", 256, 144), 14: ("Q6_K", 256, 210),
              2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20)}
SUPPORTED = {v[0] for v in GGML_TYPES.values()}


@dataclass
class QWeight:
    """W [N, K] in the uniform description above (row-major numpy arrays)."""

    fmt: str
    code: np.ndarray            # uint8 [N, K]
    dS: np.ndarray              # float16 [N, K // SB]
    dO: np.ndarray              # float16 [N, K // SB]
    sc: np.ndarray | None       # int8 [N, K // SUB]
    mn: np.ndarray | None       # int8 [N, K // SUB]
    SB: int
    SUB: int
    bits: int                   # 4, 6 or 8: how the kernel stores the codes
    sym: int = 0                # c > 0 when w = S * (code - c) exactly (dO * mn == -c * dS * sc)

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.code.shape)

    def rows(self, idx) -> "QWeight":
        pick = lambda a: None if a is None else a[idx]  # noqa: E731
        return QWeight(self.fmt, self.code[idx], self.dS[idx], self.dO[idx], pick(self.sc), pick(self.mn),
                       self.SB, self.SUB, self.bits, self.sym)

    def layout(self) -> tuple:
        return (self.SB, self.SUB, self.bits, self.sc is None, self.mn is None, self.sym)

    def nbytes_packed(self) -> int:
        n, k = self.shape
        n = -(-n // TILE) * TILE
        total = n * k * self.bits // 8 + 2 * 2 * n * (k // self.SB)      # codes + dS/dO
        total += sum(n * (k // self.SUB) for a in (self.sc, self.mn) if a is not None)
        return total


def concat_rows(parts: list[QWeight]) -> QWeight:
    """Stack weights along N (e.g. q, k, v into one GEMM). All parts must share a layout."""
    first = parts[0]
    if any(p.layout() != first.layout() or p.shape[1] != first.shape[1] for p in parts):
        raise ValueError("concat_rows: parts have different layouts")
    cat = lambda name: None if getattr(first, name) is None else np.concatenate([getattr(p, name) for p in parts])  # noqa: E731,E501
    fmt = first.fmt if all(p.fmt == first.fmt for p in parts) else "+".join(sorted({p.fmt for p in parts}))
    return QWeight(fmt, cat("code"), cat("dS"), cat("dO"), cat("sc"), cat("mn"), first.SB, first.SUB, first.bits,
                   first.sym)


def _f16(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).view(np.float16)


def unpack(raw: np.ndarray, type_id: int, shape: tuple[int, int]) -> QWeight:
    """raw: the tensor's bytes as stored in the GGUF file; shape: (N, K) in torch order."""
    name, bs, nbytes = GGML_TYPES[type_id]
    N, K = shape
    if K % bs:
        raise ValueError(f"{name} tensor with K={K} not a multiple of its block {bs}")
    b = np.asarray(raw, dtype=np.uint8).reshape(N, K // bs, nbytes)
    if name == "Q8_0":
        d = _f16(b[..., 0:2]).reshape(N, -1)
        q = b[..., 2:].view(np.int8).astype(np.int16) + 128
        return QWeight(name, q.astype(np.uint8).reshape(N, K), d, (d * np.float16(-128)), None, None, 32, 32, 8, 128)
    if name in ("Q4_0", "Q4_1", "Q5_0"):
        off = 4 if name == "Q4_1" else 2
        d = _f16(b[..., 0:2]).reshape(N, -1)
        if name == "Q5_0":
            qh = np.ascontiguousarray(b[..., 2:6]).view(np.uint32)            # [N, nb, 1]
            qs = b[..., 6:22]
        else:
            qh, qs = None, b[..., off:off + 16]
        lo = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)                     # [N, nb, 32]
        if qh is not None:
            hi = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
            lo = lo | (hi << 4)
        if name == "Q4_1":
            dO, bits = _f16(b[..., 2:4]).reshape(N, -1), 4
        else:
            dO = d * np.float16(-16 if name == "Q5_0" else -8)
            bits = 6 if name == "Q5_0" else 4
        sym = {"Q5_0": 16, "Q4_0": 8}.get(name, 0)
        return QWeight(name, lo.reshape(N, K), d, dO, None, None, 32, 32, bits, sym)
    if name == "Q4_K":
        d = _f16(b[..., 0:2]).reshape(N, -1)
        dmin = _f16(b[..., 2:4]).reshape(N, -1)
        s = b[..., 4:16].reshape(N, -1, 3, 4)
        sd, sm, smd = s[..., 0, :], s[..., 1, :], s[..., 2, :]
        sc = np.concatenate([sd & 0x3F, (smd & 0x0F) | ((sd >> 2) & 0x30)], axis=-1)
        mn = np.concatenate([sm & 0x3F, (smd >> 4) | ((sm >> 2) & 0x30)], axis=-1)
        qs = b[..., 16:].reshape(N, -1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        code = (qs & 0x0F).reshape(N, K)
        return QWeight(name, code, d, -dmin, sc.reshape(N, -1).astype(np.int8), mn.reshape(N, -1).astype(np.int8),
                       256, 32, 4)
    if name == "Q6_K":
        ql, qh = b[..., 0:128], b[..., 128:192]
        sc = b[..., 192:208].view(np.int8).reshape(N, -1)
        d = _f16(b[..., 208:210]).reshape(N, -1)
        lo = ql.reshape(N, -1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 1, 2, 1)
        lo = (lo & 0x0F).reshape(N, -1, 8, 32)
        hi = qh.reshape(N, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
        hi = (hi & 0x03).reshape(N, -1, 8, 32)
        code = (lo | (hi << 4)).reshape(N, K)
        return QWeight(name, code, d, d * np.float16(-32), sc, sc, 256, 16, 6, 32)
    raise ValueError(f"unsupported GGUF type {name}")


def dequantize(w: QWeight, dtype=np.float32) -> np.ndarray:
    """The weights as numbers: computed exactly in float64, rounded once (= gguf's values)."""
    N, K = w.shape
    rep = lambda a, n: np.repeat(a.astype(np.float64), n, axis=1)  # noqa: E731
    S = rep(w.dS, w.SB)
    O = rep(w.dO, w.SB)
    if w.sc is not None:
        S = S * rep(w.sc, w.SUB)
    if w.mn is not None:
        O = O * rep(w.mn, w.SUB)
    return (S * w.code + O).astype(dtype)


@dataclass
class PackedWeight:
    """A QWeight laid out for qgemm: columns in tiles of 16, codes interleaved by 4."""

    codes: torch.Tensor
    dS: torch.Tensor
    dO: torch.Tensor
    sc: torch.Tensor | None
    mn: torch.Tensor | None
    N: int
    K: int
    SB: int
    SUB: int
    bits: int
    fmt: str
    sym: int = 0


def _tiles(a: np.ndarray, Np: int) -> np.ndarray:
    """[N, X] -> [NT, X, 16] (padding columns with zeros)."""
    N, X = a.shape
    if Np != N:
        a = np.concatenate([a, np.zeros((Np - N, X), dtype=a.dtype)])
    return np.ascontiguousarray(a.reshape(Np // TILE, TILE, X).transpose(0, 2, 1))


def pack(w: QWeight) -> PackedWeight:
    N, K = w.shape
    if K % BLK:
        raise ValueError(f"K={K} is not a multiple of {BLK}")
    Np = -(-N // TILE) * TILE
    NT, nb = Np // TILE, K // BLK
    code = w.code if Np == N else np.concatenate([w.code, np.zeros((Np - N, K), dtype=np.uint8)])
    # [NT, 16 cols, nb, 8 groups, 4] -> [NT, nb, 8, 16, 4]
    v = code.reshape(NT, TILE, nb, 8, 4).transpose(0, 2, 3, 1, 4).reshape(NT, nb, 8, 64)
    if w.bits in (4, 6):
        lo = v & 0x0F
        nib = lo[:, :, :4] | (lo[:, :, 4:] << 4)                                   # [NT, nb, 4, 64]
        if w.bits == 6:
            hi = (v >> 4) & 0x03                                                   # vector 4h+i -> plane h, pair i
            hi = hi.reshape(NT, nb, 2, 4, 64)
            planes = hi[:, :, :, 0] | (hi[:, :, :, 1] << 2) | (hi[:, :, :, 2] << 4) | (hi[:, :, :, 3] << 6)
            nib = np.concatenate([nib.reshape(NT, nb, 256), planes.reshape(NT, nb, 128)], axis=-1)
        v = nib
    codes = torch.from_numpy(np.ascontiguousarray(v).reshape(-1))
    t = lambda a: None if a is None else torch.from_numpy(_tiles(a, Np).reshape(-1))  # noqa: E731
    dS = torch.from_numpy(_tiles(w.dS, Np).reshape(-1).view(np.int16))
    dO = torch.from_numpy(_tiles(w.dO, Np).reshape(-1).view(np.int16))
    return PackedWeight(codes, dS, dO, t(w.sc), t(w.mn), N, K, w.SB, w.SUB, w.bits, w.fmt, w.sym)


def quantize_q8_0(w: torch.Tensor) -> QWeight:
    """Load-time quantization of a float weight to Q8_0 (lossy; for safetensors models).
    Same rule as llama.cpp / the gguf package: per 32 values d = amax/127, q = round(w / d), d
    stored as fp16."""
    a = w.float().numpy().astype(np.float32)
    N, K = a.shape
    if K % 32:
        raise ValueError(f"Q8_0 needs K divisible by 32 (K={K})")
    blocks = a.reshape(N, K // 32, 32)
    d32 = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d32 == 0, 0, 1 / d32).astype(np.float32)
    t = blocks * inv
    q = (np.sign(t) * np.floor(np.abs(t) + 0.5)).astype(np.int16) + 128     # round half away from zero
    d = d32[..., 0].astype(np.float16)
    return QWeight("Q8_0", q.astype(np.uint8).reshape(N, K), d, d * np.float16(-128), None, None, 32, 32, 8, 128)


def quantize_q4_1(w: np.ndarray | torch.Tensor) -> QWeight:
    """Load-time Q4_1 (4-bit, per 32 values a fp16 scale and min; llama.cpp's rule) of a float
    weight: lossy, meant for drafts, whose numbers never change what the target emits."""
    a = (w.float().numpy() if isinstance(w, torch.Tensor) else np.asarray(w)).astype(np.float32)
    N, K = a.shape
    if K % 32:
        raise ValueError(f"Q4_1 needs K divisible by 32 (K={K})")
    blocks = a.reshape(N, K // 32, 32)
    lo, hi = blocks.min(axis=-1, keepdims=True), blocks.max(axis=-1, keepdims=True)
    d32 = (hi - lo) / np.float32(15)
    with np.errstate(divide="ignore"):
        inv = np.where(d32 == 0, 0, 1 / d32).astype(np.float32)
    q = np.minimum(15, np.floor((blocks - lo) * inv + np.float32(0.5))).astype(np.uint8)
    return QWeight("Q4_1", q.reshape(N, K), d32[..., 0].astype(np.float16), lo[..., 0].astype(np.float16),
                   None, None, 32, 32, 4, 0)


def to_4bit(w: QWeight) -> QWeight:
    """A weight with 4-bit codes: as stored if it has them, else requantized to Q4_1 from its exact values."""
    return w if w.bits == 4 else quantize_q4_1(dequantize(w))
