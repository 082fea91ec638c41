"""Linear layers with a weight backend chosen at load time.

On CPUs without AMX the fastest exact-enough path in PyTorch is FBGEMM's packed fp16 GEMM:
weights stored as fp16, activations and accumulation in fp32. It reads half the bytes of an
fp32 GEMM and a 5-token verify costs about 2x a 1-token decode (plain bf16 costs 5x on AVX2).
Everywhere else (CUDA, fp32/bf16 requests) a plain torch matmul in the model dtype is used.

`int8` (CPU, FBGEMM) stores weights as int8 with one scale per output row and quantizes the
activations per call: about 2x faster than fp16 here, but the numbers change (about 1% relative
error per layer), so it is meant for the draft, whose numerics cannot change what the target emits.
"""
from __future__ import annotations

import functools

import torch
from torch import nn


def fbgemm_fp16_available() -> bool:
    return hasattr(torch.ops.quantized, "linear_prepack_fp16") and "fbgemm" in torch.backends.quantized.supported_engines


def _quantize_rows_int8(w: torch.Tensor):
    """Symmetric int8 per output row (FBGEMM's packed format)."""
    import warnings

    w = w.float()
    scale = (w.abs().amax(dim=1) / 127.0).clamp_min(1e-12).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")     # torch marks the quantized tensor API deprecated; FBGEMM needs it
        return torch.quantize_per_channel(w, scale, torch.zeros_like(scale, dtype=torch.long), 0, torch.qint8)


@functools.lru_cache(maxsize=1)
def int8_reduce_range() -> bool:
    """FBGEMM's int8 GEMM on a CPU without VNNI multiplies u8 activations by s8 weights with
    vpmaddubsw, whose int16 pair sums saturate at full-range activations (logits off by ~40% on
    an AVX2-only EPYC, tested): quantize activations to 7 bits there, as PyTorch's x86 observers do."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return True
    return not ("avx512_vnni" in flags or "avx_vnni" in flags)


class Linear(nn.Module):
    """y = x @ W.T + b. `packed`: "fp16" (FBGEMM fp16 weights, fp32 activations), "int8" (FBGEMM
    int8 weights, dynamically quantized activations), or plain torch matmul in `dtype`."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed: str | None, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.backend = packed or "plain"
        if self.backend != "plain":
            b = None if bias is None else bias.float()
            if self.backend == "fp16":
                self._packed = torch.ops.quantized.linear_prepack_fp16(weight.float(), b)
            else:
                self._packed = torch.ops.quantized.linear_prepack(_quantize_rows_int8(weight), b)
            self.weight = None
            self.bias = None
        else:
            self.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
            self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "fp16":
            return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)
        if self.backend == "int8":
            return torch.ops.quantized.linear_dynamic(x, self._packed, int8_reduce_range())
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def weight_bytes(self) -> int:
        if self.backend != "plain":
            return self.out_features * self.in_features * (2 if self.backend == "fp16" else 1)
        return self.weight.numel() * self.weight.element_size()
