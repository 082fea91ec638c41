"""Convert a llama.cpp GGUF file into an HF-format model folder.

The folder holds config.json, generation_config.json, the tokenizer files (with the GGUF's chat
template) and safetensors weights with HF tensor names.  Quantized tensors are dequantized with
gguf-py, so the result is the deterministic model that the GGUF encodes (not the original
checkpoint).  Tensors are streamed one at a time straight into the safetensors file, so peak
memory is about one fp32 tensor plus its converted copy.

Supported GGUF architectures: llama (Llama / SmolLM / Mistral-style), qwen2 and qwen3.
"""
from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import struct
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from .config import UnsupportedModelError

logger = logging.getLogger(__name__)

# general.architecture -> (HF architectures entry, HF model_type)
GGUF_ARCHITECTURES: dict[str, tuple[str, str]] = {
    "llama": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
}

# llama.cpp's converter interleaves the rotary halves of Q/K rows for these architectures only.
_PERMUTED_QK = {"llama"}

_TOP_LEVEL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^([a-z_]+)\.(weight|bias)$")
# Tensors that carry no HF weight (their information goes into config.json).
_SKIPPED_TENSORS = {"rope_freqs.weight"}

# End-of-generation control tokens, recognised by text like llama.cpp does.
_EOG_TOKEN_TEXTS = {
    "<|endoftext|>", "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end_of_text|>",
    "<end_of_turn>", "<|end|>", "<|return|>", "<|call|>",
}
_TOKEN_TYPE_CONTROL = 3

_SAFETENSORS_DTYPES = {
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
}

# ----------------------------------------------------------------------------- reading


class FastGGUFReader(gguf.GGUFReader):
    """gguf.GGUFReader over a plain ndarray view of the file mapping instead of an np.memmap.

    The reader slices its buffer once per metadata element, and np.memmap's Python-level
    slicing overhead makes a 150k-token vocabulary take ~30 s to parse; over a plain view of
    the same mapping it takes a few seconds.  Behaviour is otherwise identical.
    """

    @property
    def data(self) -> np.ndarray:
        return self._buffer

    @data.setter
    def data(self, value: np.ndarray) -> None:
        self._buffer = value.view(np.ndarray) if isinstance(value, np.memmap) else value


_READER_PATCH_LOCK = threading.RLock()


@contextmanager
def fast_gguf_reader():
    """Make code that builds `gguf.GGUFReader` (transformers' GGUF loaders) use FastGGUFReader."""
    with _READER_PATCH_LOCK:
        original = gguf.GGUFReader
        gguf.GGUFReader = FastGGUFReader
        try:
            yield
        finally:
            gguf.GGUFReader = original


# ----------------------------------------------------------------------------- metadata


def _field(reader, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    value = field.contents()
    return value


def _f32(value: float) -> float:
    """The shortest decimal that round-trips the GGUF float32 (9.99999975e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def _hf_shape(tensor) -> tuple[int, ...]:
    # GGUF lists dimensions fastest-varying first; torch/numpy want the reverse.
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def _hf_name(gguf_name: str) -> str:
    m = _BLOCK_RE.match(gguf_name)
    if m:
        layer, part, kind = m.groups()
        if part in _BLOCK_NAMES:
            return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"
    else:
        m = _TOP_RE.match(gguf_name)
        if m and m.group(1) in _TOP_LEVEL_NAMES:
            return f"{_TOP_LEVEL_NAMES[m.group(1)]}.{m.group(2)}"
    raise UnsupportedModelError(f"GGUF tensor {gguf_name!r} has no counterpart in the supported HF models")


def _llama3_rope_scaling(rope_freqs: np.ndarray, head_dim: int, theta: float) -> dict[str, Any] | None:
    """Recover HF's llama3 rope_scaling from llama.cpp's precomputed `rope_freqs` factors."""
    factors = np.asarray(rope_freqs, dtype=np.float64).reshape(-1)
    factor = float(factors.max())
    if abs(factor - 1.0) < 1e-6:
        return None
    wavelen = 2 * math.pi / (theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    if len(wavelen) != len(factors):
        raise UnsupportedModelError(
            f"GGUF rope_freqs has {len(factors)} entries, expected {len(wavelen)} (head_dim {head_dim})"
        )
    factor = round(factor, 4)
    # Only the wavelengths orig/low and orig/high matter, so the first fitting triple is as good
    # as the original one; the usual Llama 3.x values are tried first.
    for orig in [8192] + [2**k for k in range(4, 18) if k != 13]:
        for low in (1.0, 2.0, 4.0):
            for high in (4.0, 2.0, 8.0, 1.0):
                if high <= low:
                    continue
                smooth = np.clip((orig / wavelen - low) / (high - low), 0.0, 1.0)
                expected = np.where(
                    wavelen < orig / high, 1.0,
                    np.where(wavelen > orig / low, factor, 1.0 / ((1 - smooth) / factor + smooth)),
                )
                if np.max(np.abs(expected - factors)) < 1e-3 * factor:
                    return {
                        "rope_type": "llama3",
                        "factor": factor,
                        "low_freq_factor": low,
                        "high_freq_factor": high,
                        "original_max_position_embeddings": orig,
                    }
    raise UnsupportedModelError(
        "the GGUF carries rope frequency factors (rope_freqs) that do not match llama3 rope scaling; "
        "ssd cannot convert this model"
    )


def _metadata_rope_scaling(reader, arch: str) -> dict[str, Any] | None:
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    factor = _field(reader, f"{arch}.rope.scaling.factor")
    orig = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if kind == "linear" and factor:
        return {"rope_type": "linear", "factor": _f32(factor)}
    if kind == "yarn" and factor:
        out: dict[str, Any] = {"rope_type": "yarn", "factor": _f32(factor)}
        if orig:
            out["original_max_position_embeddings"] = int(orig)
        return out
    raise UnsupportedModelError(f"unsupported rope scaling {kind!r} in GGUF metadata")


def _eog_token_ids(reader) -> list[int]:
    ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        value = _field(reader, key)
        if value is not None and int(value) not in ids:
            ids.append(int(value))
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    types = reader.fields.get("tokenizer.ggml.token_type")
    if tokens is not None and types is not None:
        kinds = np.asarray(types.contents())
        for idx in np.flatnonzero(kinds == _TOKEN_TYPE_CONTROL).tolist():
            if idx < len(tokens.data) and tokens.contents(int(idx)) in _EOG_TOKEN_TEXTS and idx not in ids:
                ids.append(int(idx))
    return ids


@dataclass
class _GGUFModel:
    arch: str
    config: dict[str, Any]
    generation_config: dict[str, Any]


def _build_config(reader, dtype: torch.dtype) -> _GGUFModel:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"unsupported GGUF architecture {arch!r}; ssd converts {', '.join(sorted(GGUF_ARCHITECTURES))} GGUFs "
            f"(HF {', '.join(a for a, _ in GGUF_ARCHITECTURES.values())})"
        )
    hf_arch, model_type = GGUF_ARCHITECTURES[arch]
    tensors = {t.name: t for t in reader.tensors}

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise UnsupportedModelError(f"GGUF metadata lacks {arch}.{key}")
        return value

    if "token_embd.weight" not in tensors:
        raise UnsupportedModelError("GGUF has no token_embd.weight tensor")
    vocab_size, hidden = _hf_shape(tensors["token_embd.weight"])
    heads = int(need("attention.head_count"))
    kv_heads = int(_field(reader, f"{arch}.attention.head_count_kv") or heads)
    head_dim = _field(reader, f"{arch}.attention.key_length")
    if head_dim is None and "blk.0.attn_q.weight" in tensors:
        head_dim = _hf_shape(tensors["blk.0.attn_q.weight"])[0] // heads
    head_dim = int(head_dim or hidden // heads)
    theta = _f32(_field(reader, f"{arch}.rope.freq_base") or 10000.0)
    eps = _f32(need("attention.layer_norm_rms_epsilon"))
    n_layers = int(need("block_count"))

    rope_scaling = _metadata_rope_scaling(reader, arch)
    if rope_scaling is None and "rope_freqs.weight" in tensors:
        from gguf.quants import dequantize

        t = tensors["rope_freqs.weight"]
        rope_scaling = _llama3_rope_scaling(dequantize(t.data, t.tensor_type), head_dim, theta)

    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    pad = _field(reader, "tokenizer.ggml.padding_token_id")
    eos_ids = _eog_token_ids(reader)
    eos: int | list[int] | None = eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None)

    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        "vocab_size": int(vocab_size),
        "hidden_size": int(hidden),
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": eps,
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length") or 4096),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": eos,
        "pad_token_id": None if pad is None else int(pad),
        "torch_dtype": str(dtype).removeprefix("torch."),
        "use_cache": True,
    }
    if arch == "llama":
        cfg["mlp_bias"] = "blk.0.ffn_up.bias" in tensors
    if arch in ("qwen2", "qwen3"):
        cfg["use_sliding_window"] = False
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg[k] is not None}
    return _GGUFModel(arch=arch, config=cfg, generation_config=gen)


# ----------------------------------------------------------------------------- tensors


def _unpermute_qk(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (its rotary pairs are interleaved per head).

    llama.cpp stores, per head, the rows (0, d/2, 1, d/2+1, ...) of the HF weight; HF keeps the
    two rotary halves contiguous.  Works on 2-D weights and 1-D biases.
    """
    rows = w.shape[0]
    half = rows // n_heads // 2
    rest = w.shape[1:]
    return w.reshape(n_heads, half, 2, *rest).swapaxes(1, 2).reshape(rows, *rest)


@dataclass
class _Plan:
    gguf_name: str
    hf_name: str
    shape: tuple[int, ...]
    nbytes: int


def _plan_tensors(reader, dtype: torch.dtype) -> list[_Plan]:
    itemsize = torch.empty((), dtype=dtype).element_size()
    plans: list[_Plan] = []
    seen: set[str] = set()
    for t in reader.tensors:
        if t.name in _SKIPPED_TENSORS:
            continue
        hf = _hf_name(t.name)
        if hf in seen:
            raise UnsupportedModelError(f"GGUF has duplicate tensor {t.name!r}")
        seen.add(hf)
        shape = _hf_shape(t)
        plans.append(_Plan(t.name, hf, shape, itemsize * math.prod(shape)))
    return plans


def _load_tensor(tensor, shape: tuple[int, ...], arch: str, cfg: dict[str, Any], dtype: torch.dtype) -> torch.Tensor:
    from gguf.quants import dequantize

    w = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)
    if arch in _PERMUTED_QK:
        if ".attn_q." in tensor.name:
            w = _unpermute_qk(w, cfg["num_attention_heads"])
        elif ".attn_k." in tensor.name:
            w = _unpermute_qk(w, cfg["num_key_value_heads"])
    if not w.flags.writeable or not w.flags.c_contiguous:
        w = np.array(w, dtype=np.float32, order="C")
    return torch.from_numpy(w).to(dtype).contiguous()


def _shards(plans: list[_Plan], max_shard_bytes: int | None) -> list[list[_Plan]]:
    if not max_shard_bytes:
        return [plans]
    shards: list[list[_Plan]] = [[]]
    size = 0
    for p in plans:
        if shards[-1] and size + p.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return shards


def _write_safetensors(path: Path, plans: list[_Plan], reader, arch: str, cfg: dict[str, Any],
                       dtype: torch.dtype, bar) -> None:
    """Write one safetensors file, streaming tensor by tensor (the header is known up front)."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for p in plans:
        header[p.hf_name] = {
            "dtype": _SAFETENSORS_DTYPES[dtype],
            "shape": list(p.shape),
            "data_offsets": [offset, offset + p.nbytes],
        }
        offset += p.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    tensors = {t.name: t for t in reader.tensors}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for p in plans:
            t = _load_tensor(tensors[p.gguf_name], p.shape, arch, cfg, dtype)
            data = t.reshape(-1).view(torch.uint8).numpy()
            if data.nbytes != p.nbytes:  # pragma: no cover - guards the header we wrote
                raise RuntimeError(f"{p.hf_name}: {data.nbytes} bytes, header says {p.nbytes}")
            f.write(data)
            del t, data
            bar.update(1)


# ----------------------------------------------------------------------------- tokenizer


def _save_tokenizer(gguf_path: Path, out_dir: Path, reader) -> None:
    from transformers import AutoTokenizer

    with fast_gguf_reader():
        tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    template = _field(reader, "tokenizer.chat_template")
    if template and not getattr(tok, "chat_template", None):
        tok.chat_template = template
    tok.save_pretrained(str(out_dir))


# ----------------------------------------------------------------------------- entry point


def convert_gguf(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    progress: bool = True,
    max_shard_bytes: int | None = None,
) -> Path:
    """Convert `gguf_path` into the HF folder `out_dir` (replaced if it exists) and return it.

    Weights are dequantized and stored as `dtype` (bfloat16, float16 or float32) in
    model.safetensors, or in shards of at most `max_shard_bytes` with a
    model.safetensors.index.json.  The folder appears atomically: everything is written into a
    temporary sibling folder that is renamed at the end.
    """
    from tqdm.auto import tqdm

    gguf_path = Path(gguf_path)
    out_dir = Path(out_dir)
    if dtype not in _SAFETENSORS_DTYPES:
        raise ValueError(f"unsupported dtype {dtype}; use one of {list(_SAFETENSORS_DTYPES)}")
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file {str(gguf_path)!r} does not exist")

    reader = FastGGUFReader(str(gguf_path))
    model = _build_config(reader, dtype)
    plans = _plan_tensors(reader, dtype)
    shards = _shards(plans, max_shard_bytes)
    logger.info(
        "converting %s (%s, %d layers, %d tensors) to %s in %s",
        gguf_path.name, model.config["architectures"][0], model.config["num_hidden_layers"],
        len(plans), model.config["torch_dtype"], out_dir,
    )

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        with tqdm(total=len(plans), desc=f"converting {gguf_path.name}", unit="tensor", disable=not progress) as bar:
            if len(shards) == 1:
                _write_safetensors(tmp / "model.safetensors", plans, reader, model.arch, model.config, dtype, bar)
            else:
                weight_map: dict[str, str] = {}
                for i, shard in enumerate(shards, 1):
                    fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                    _write_safetensors(tmp / fname, shard, reader, model.arch, model.config, dtype, bar)
                    weight_map.update({p.hf_name: fname for p in shard})
                index = {"metadata": {"total_size": sum(p.nbytes for p in plans)}, "weight_map": weight_map}
                (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        (tmp / "config.json").write_text(json.dumps(model.config, indent=2) + "\n")
        (tmp / "generation_config.json").write_text(json.dumps(model.generation_config, indent=2) + "\n")
        _save_tokenizer(gguf_path, tmp, reader)
        del reader

        old = None
        if out_dir.exists():
            old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("wrote %s", out_dir)
    return out_dir
