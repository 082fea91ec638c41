"""Linear layers with a weight backend chosen at load time.

On CPUs without AMX the fastest exact-enough path in PyTorch is FBGEMM's packed fp16 GEMM:
weights stored as fp16, activations and accumulation in fp32. It reads half the bytes of an
fp32 GEMM and a 5-token verify costs about 2x a 1-token decode (plain bf16 costs 5x on AVX2).
Everywhere else (CUDA, fp32/bf16 requests) a plain torch matmul in the model dtype is used.
"""
from __future__ import annotations

import torch
from torch import nn


def fbgemm_fp16_available() -> bool:
    return hasattr(torch.ops.quantized, "linear_prepack_fp16") and "fbgemm" in torch.backends.quantized.supported_engines


class Linear(nn.Module):
    """y = x @ W.T + b. `packed_fp16` packs W for FBGEMM (CPU only, fp32 activations)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, packed_fp16: bool, dtype: torch.dtype):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.packed_fp16 = packed_fp16
        if packed_fp16:
            b = None if bias is None else bias.float()
            self._packed = torch.ops.quantized.linear_prepack_fp16(weight.float(), b)
            self.weight = None
            self.bias = None
        else:
            self.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
            self.bias = None if bias is None else nn.Parameter(bias.to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed_fp16:
            return torch.ops.quantized.linear_dynamic_fp16(x, self._packed)
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def weight_bytes(self) -> int:
        if self.packed_fp16:
            return self.out_features * self.in_features * 2
        return self.weight.numel() * self.weight.element_size()
