"""Load a model (HF folder, hub id, GGUF file or a built-in name) into our decoder."""
from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from ssd.layers.linear import fbgemm_fp16_available
from ssd.models.config import ModelConfig
from ssd.models.decoder import DecoderModel
from ssd.models.parts import OnDevice

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    model: DecoderModel
    config: ModelConfig
    tokenizer: object
    path: Path
    dtype_name: str
    bytes_read: int | None = None      # weight bytes read from safetensors files (None: not counted)


LOW_BIT = ("gguf", "q8_0", "q4_1")


def resolve_dtype(dtype: str, device: torch.device) -> tuple[torch.dtype, str | None]:
    """-> (storage dtype, backend: None | "fp16" | "int8" | "gguf").
    'auto' = fp16 weights via FBGEMM on CPU, bf16 on CUDA (load_model picks 'gguf' first for GGUF
    models on CPU). 'int8' = FBGEMM int8 (CPU only). 'gguf' = the GGUF's low-bit weights as stored,
    'q8_0' = load-time Q8_0 quantization of float weights (lossy), 'q4_1' = 4-bit codes everywhere
    (GGUF 4-bit tensors as stored, the others and float models requantized to Q4_1: lossy, for
    drafts), all on the low-bit kernel."""
    if dtype in LOW_BIT:
        if device.type != "cpu":
            raise ValueError(f"dtype {dtype} runs on the CPU low-bit kernels; on CUDA use bfloat16")
        return torch.float32, "gguf"
    if dtype == "auto":
        dtype = "bfloat16" if device.type == "cuda" else ("float16" if fbgemm_fp16_available() else "float32")
    if dtype == "int8":
        if device.type != "cpu" or not fbgemm_fp16_available():
            raise ValueError("dtype int8 needs a CPU with PyTorch's FBGEMM backend; on CUDA use bfloat16")
        return torch.float16, "int8"
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, gguf, q8_0, q4_1, float32, bfloat16, "
                         "float16, int8")
    td = DTYPES[dtype]
    packed = "fp16" if device.type == "cpu" and td == torch.float16 else None
    if packed and not fbgemm_fp16_available():
        raise ValueError("dtype float16 on CPU needs PyTorch's FBGEMM backend, which this build lacks; "
                         "use dtype float32 or bfloat16")
    return td, packed


def draft_dtype_for(dtype: str, draft_dtype: str | None, device: str | torch.device,
                    spec: str | Path | None = None) -> str:
    """The draft's dtype: as asked; else, when the target's dtype is 'auto' on a CPU: 'q4_1' for a
    GGUF draft (4-bit codes: its 4-bit tensors as stored, the wider ones requantized) and FBGEMM
    int8 for a float one (a draft's numerics change only how often it is right, never what the
    target emits; fewer bytes make each draft step cheaper); else the target's dtype."""
    if draft_dtype is not None:
        return draft_dtype
    if dtype == "auto" and torch.device(device).type == "cpu":
        if spec is not None and _gguf_source(spec) is not None and _fast_kernels():
            return "q4_1"
        if fbgemm_fp16_available():
            return "int8"
    return dtype


def _gguf_source(spec) -> Path | None:
    from ssd.models.registry import gguf_source

    try:
        return gguf_source(str(spec), progress=False)
    except Exception:  # a known model whose parts are missing: resolve_model reports that
        return None


def _fast_kernels() -> bool:
    from ssd.kernels.build import KernelBuildError, load_qgemm

    try:
        return fast_low_bit_cpu(load_qgemm().best_isa())
    except KernelBuildError:
        return False


def fast_low_bit_cpu(best_isa: int) -> bool:
    """Whether 'auto' takes the low-bit kernels: where their AVX-512 VNNI or AVX2 path runs (AVX2 on
    an AVX2-only host: about 2x FBGEMM fp16 for AR decode, reading 1/3 of the bytes); not the
    portable path (compiled generic C++, about 20x slower)."""
    return best_isa >= 1


def _is_linear_weight(name: str) -> bool:
    return name.endswith("_proj.weight") or name == "lm_head.weight"


def _low_bit_getter(spec, dtype: str, device: torch.device, folder_get):
    """A weight getter for the low-bit kernel, or None when the model/dtype does not take it."""
    if device.type != "cpu" or dtype not in ("auto",) + LOW_BIT:
        return None
    src = _gguf_source(spec) if dtype in ("auto", "gguf", "q4_1") else None
    if dtype == "gguf" and src is None:
        raise ValueError(f"dtype gguf needs a GGUF model (a .gguf file or a built-in model); {spec} is not one. "
                         "Use dtype q8_0 to quantize a float model at load time")
    if dtype == "auto" and src is None:
        return None
    from ssd.kernels.build import KernelBuildError, load_qgemm

    try:
        ops = load_qgemm()
    except KernelBuildError as e:
        if dtype != "auto":
            raise
        log.warning("%s; running %s with fp16 weights instead (slower)", e, spec)
        return None
    if dtype == "auto" and not fast_low_bit_cpu(ops.best_isa()):
        log.warning("this CPU has neither AVX2 nor AVX-512 VNNI, and the low-bit kernels' portable path is far "
                    "slower than FBGEMM fp16: running %s with fp16 weights (dtype='gguf' forces the low-bit path)",
                    spec)
        return None
    from ssd.kernels.gguf_pack import QWeight, quantize_q4_1, quantize_q8_0, to_4bit

    if src is not None:
        from ssd.models.gguf_weights import GGUFWeights

        weights = GGUFWeights(src)
        if dtype != "q4_1":
            return weights

        def get4(name):
            w = weights(name)
            if _is_linear_weight(name):
                if isinstance(w, QWeight):
                    return to_4bit(w)
                if w.dim() == 2 and w.shape[1] % 32 == 0:
                    return quantize_q4_1(w)
            return w

        def requantized(name):          # a float tensor that get4 quantizes whole (so in parts too)
            shape = weights.shape(name)
            return _is_linear_weight(name) and weights.block(name) == 1 and len(shape) == 2 and shape[1] % 32 == 0

        def part4(name, rows=None, cols=None):
            w = weights.part(name, rows, cols)
            if _is_linear_weight(name):
                if isinstance(w, QWeight):
                    return to_4bit(w)
                if requantized(name):
                    return quantize_q4_1(w)
            return w

        get4.reader = weights.reader
        get4.requantized = True
        get4.part = part4
        get4.block = lambda name: 32 if requantized(name) else weights.block(name)
        return get4
    quant = quantize_q4_1 if dtype == "q4_1" else quantize_q8_0

    def quantizes(name: str) -> bool:
        shape = folder_get.shape(name)
        return _is_linear_weight(name) and len(shape) == 2 and shape[1] % 32 == 0

    def get(name):
        w = folder_get(name)
        return quant(w) if quantizes(name) else w

    def part(name, rows=None, cols=None):
        w = folder_get.part(name, rows, cols)
        return quant(w) if quantizes(name) else w

    get.part = part
    get.block = lambda name: 32 if quantizes(name) else 1
    return get


class SafetensorsWeights:
    """Name -> tensor over all *.safetensors files in a folder, loaded lazily."""

    def __init__(self, folder: Path):
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors weights in {folder}; an HF model folder needs "
                                    "config.json, *.safetensors and tokenizer files")
        self._handles = [safe_open(str(f), framework="pt") for f in files]
        self._where = {k: h for h in self._handles for k in h.keys()}
        self.bytes_read = 0          # tensor bytes handed out (a tensor-parallel rank reads only its shard)

    def _handle(self, name: str):
        h = self._where.get(name)
        if h is None:
            raise KeyError(f"weight {name!r} is missing from the checkpoint")
        return h

    def __call__(self, name: str) -> torch.Tensor:
        return self._counted(self._handle(name).get_tensor(name))

    def shape(self, name: str) -> list[int]:
        return list(self._handle(name).get_slice(name).get_shape())

    def part(self, name: str, rows=None, cols=None) -> torch.Tensor:
        """Rows [r0, r1) and/or columns [c0, c1) of a weight, reading only those bytes."""
        sl = self._handle(name).get_slice(name)
        r = slice(None) if rows is None else slice(*rows)
        t = sl[r] if cols is None else sl[r, cols[0]:cols[1]]
        return self._counted(t.contiguous())

    def _counted(self, t: torch.Tensor) -> torch.Tensor:
        self.bytes_read += t.numel() * t.element_size()
        return t


def load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))


def load_model(spec: str | Path, dtype: str = "auto", device: str | torch.device = "cpu",
               max_positions: int | None = None, progress: bool = True, shard=None,
               reduce=None, gather=None) -> LoadedModel:
    """shard: (rank, world) of a tensor-parallel target (None: the whole model); reduce: the
    in-place sum over ranks (row-parallel layers, the vocab-parallel embedding); gather: rank 0's
    logits from every rank's vocab columns (ssd/distributed)."""
    from ssd.models.registry import resolve_model

    device = torch.device(device)
    path = resolve_model(str(spec), progress=progress)
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise FileNotFoundError(f"{path} has no config.json; it is not an HF model folder")
    cfg = ModelConfig.from_hf(json.loads(cfg_file.read_text()))
    td, packed = resolve_dtype(dtype, device)
    t0 = time.perf_counter()
    get = SafetensorsWeights(path)
    low_bit = _low_bit_getter(spec, dtype, device, get)
    if low_bit is not None:
        get, td, packed = low_bit, torch.float32, "gguf"
    max_pos = max_positions or cfg.max_position_embeddings
    with torch.device(device) if device.type != "cpu" else _nullctx():
        model = DecoderModel(cfg, OnDevice(get, device), td, packed, max_pos, shard, reduce, gather)
    model.eval()
    tok = load_tokenizer(path)
    name = {"fp16": "float16 (FBGEMM, fp32 activations)", "int8": "int8 (FBGEMM, per-row weights, dynamic "
            "activations)"}.get(packed, str(td).replace("torch.", ""))
    if packed == "gguf":
        fmts = sorted({f for m in model.modules() if m.__class__.__name__ == "QuantLinear"
                       for f in m.backend.split(":", 1)[1].split(",")})
        if getattr(get, "requantized", False):
            src = "from the GGUF, wider codes requantized to Q4_1 (lossy)"
        elif hasattr(get, "reader"):
            src = "as stored in the GGUF"
        else:
            src = f"quantized to {dtype.upper()} at load (lossy)"
        name = f"low-bit {'/'.join(fmts)} {src} (int8 activations per 32 values)"
    where = "" if shard is None else f" (tensor-parallel shard {shard[0]} of {shard[1]})"
    log.info("loaded %s (%s, %d layers) as %s on %s%s in %.1fs", path.name, cfg.architecture, cfg.num_layers,
             name, device, where, time.perf_counter() - t0)
    return LoadedModel(model, cfg, tok, path, name, getattr(get, "bytes_read", None))


class _nullctx:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False

