"""Model hyper-parameters for the Llama / Qwen2 / Qwen3 decoder family, read from HF config.json."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF `architectures` entry -> (attention bias on q/k/v, RMSNorm on q/k heads)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
}


class UnsupportedModelError(ValueError):
    pass


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise UnsupportedModelError(
                f"unsupported model architecture {archs or cfg.get('model_type')!r}; "
                f"ssd supports {', '.join(sorted(SUPPORTED_ARCHITECTURES))} "
                "(the Llama-3, SmolLM, Qwen2/Qwen2.5 and Qwen3 families)"
            )
        bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        bias = bool(cfg.get("attention_bias", bias))
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        rope_scaling = cfg.get("rope_scaling") or None
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None and isinstance(cfg.get("rope_parameters"), dict):
            rope_theta = cfg["rope_parameters"].get("rope_theta")
            if cfg["rope_parameters"].get("rope_type", "default") != "default":
                rope_scaling = dict(cfg["rope_parameters"])
        if rope_scaling is not None and rope_scaling.get("rope_type", rope_scaling.get("type")) in (None, "default"):
            rope_scaling = None
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta or 10000.0),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bias,
            qk_norm=qk_norm,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=[int(e) for e in eos_ids],
        )
