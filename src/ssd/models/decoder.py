"""One decoder for the Llama / Qwen2 / Qwen3 families (config switches: q/k/v bias, q/k RMSNorm,
tied embeddings, Llama-3 rope scaling). Works on a packed batch of new tokens over a paged KV cache."""
from __future__ import annotations

import math
from typing import Callable

import numpy as np
import torch
from torch import nn

from ssd.distributed.sharding import RankShard, check_row_split, plan, vocab_split
from ssd.kernels.gguf_pack import QWeight, dequantize
from ssd.layers.attention import AttentionMetadata, paged_attention
from ssd.layers.linear import Linear
from ssd.layers.qlinear import QuantEmbedding, QuantLinear
from ssd.layers.norm import RMSNorm
from ssd.layers.rotary import RotaryEmbedding
from ssd.models.config import ModelConfig
from ssd.models.parts import read_part, weight_block

# (name) -> tensor, or a QWeight for GGUF low-bit weights kept as stored; raises KeyError naming
# the missing tensor
WeightGetter = Callable[[str], "torch.Tensor | QWeight"]


def cat_rows(parts: list) -> "torch.Tensor | list[QWeight]":
    """Stack weights along the output dimension (q/k/v, gate/up): a tensor for float weights, the
    list of parts for low-bit ones (QuantLinear merges those of one layout into one GEMM)."""
    if all(isinstance(p, torch.Tensor) for p in parts):
        return torch.cat(parts)
    if all(isinstance(p, QWeight) for p in parts):
        return list(parts)
    from ssd.kernels.gguf_pack import dequantize

    return torch.cat([torch.from_numpy(dequantize(p)) if isinstance(p, QWeight) else p.float() for p in parts])


class DecoderLayer(nn.Module):
    """With a tensor-parallel shard (ssd/distributed/sharding.py): q/k/v and gate/up hold this rank's
    output rows (its heads, its KV heads, its intermediate columns), o_proj and down its input
    columns; their partial outputs are summed over ranks by `reduce` (in place). The families here
    have no o_proj/down bias, so nothing is added more than once."""

    def __init__(self, cfg: ModelConfig, i: int, get: WeightGetter, make_linear: Callable,
                 shard: RankShard | None = None, reduce: Callable | None = None):
        super().__init__()
        p = f"model.layers.{i}."
        d = cfg.head_dim
        full = shard is None or shard.is_full
        # this rank's rows of q, of k and v, and of gate and up (None: all)
        qr, kvr, fr = (None, None, None) if full else \
            ((shard.heads.q[0] * d, shard.heads.q[1] * d), (shard.heads.kv[0] * d, shard.heads.kv[1] * d), shard.ffn)
        part = lambda n, r=None, c=None: read_part(get, n, r, c)  # noqa: E731
        bias = (lambda n, r: part(p + n + ".bias", r)) if cfg.attention_bias else (lambda n, r: None)
        a = p + "self_attn."
        # q, k and v share one GEMM (one weight read per token instead of three).
        qkv_w = cat_rows([part(a + "q_proj.weight", qr), part(a + "k_proj.weight", kvr),
                          part(a + "v_proj.weight", kvr)])
        qkv_b = torch.cat([bias("self_attn.q_proj", qr), bias("self_attn.k_proj", kvr),
                           bias("self_attn.v_proj", kvr)]) if cfg.attention_bias else None
        self.qkv = make_linear(qkv_w, qkv_b)
        if not full:
            check_row_split(qr, weight_block(get, a + "o_proj.weight"), f"layer {i} self_attn.o_proj",
                            f"its heads are split at multiples of head_dim {d}: pick a tensor_parallel_size "
                            "whose head split lands on those blocks, or a float dtype")
        self.o_proj = make_linear(part(a + "o_proj.weight", None, qr), None)
        self.gate_up = make_linear(cat_rows([part(p + "mlp.gate_proj.weight", fr),
                                             part(p + "mlp.up_proj.weight", fr)]), None)
        self.down = make_linear(part(p + "mlp.down_proj.weight", None, fr), None)
        self.reduce = None if full else reduce
        self.input_norm = RMSNorm(get(p + "input_layernorm.weight"), cfg.rms_norm_eps)
        self.post_norm = RMSNorm(get(p + "post_attention_layernorm.weight"), cfg.rms_norm_eps)
        self.q_norm = RMSNorm(get(a + "q_norm.weight"), cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(get(a + "k_norm.weight"), cfg.rms_norm_eps) if cfg.qk_norm else None
        self.h, self.hkv, self.d = (cfg.num_heads, cfg.num_kv_heads, d) if full else \
            (shard.heads.num_q, shard.heads.num_kv, d)
        self.ffn = cfg.intermediate_size if full else shard.ffn[1] - shard.ffn[0]
        self.scale = cfg.head_dim ** -0.5
        self.fused = None          # (ops module, isa) when DecoderModel enables the C++ glue

    def forward(self, x, positions, rope, k_cache, v_cache, meta: AttentionMetadata):
        if self.fused is not None:
            return self._forward_fused(x, positions, rope, k_cache, v_cache, meta)
        T = x.shape[0]
        qkv = self.qkv(self.input_norm(x))
        q, k, v = qkv.split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], dim=-1)
        q, k, v = q.view(T, self.h, self.d), k.view(T, self.hkv, self.d), v.view(T, self.hkv, self.d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        x = x + self._sum(self.o_proj(attn.reshape(T, self.h * self.d)))
        gate, up = self.gate_up(self.post_norm(x)).split([self.ffn, self.ffn], dim=-1)
        return x + self._sum(self.down(nn.functional.silu(gate) * up))

    def _sum(self, y: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a row-parallel layer's partial output (identity without TP)."""
        if self.reduce is None:
            return y
        return self.reduce(y)

    def _forward_fused(self, x, positions, rope, k_cache, v_cache, meta: AttentionMetadata):
        """The same layer with its row-wise glue in C++ (CPU low-bit path, float32 activations)."""
        ops, isa = self.fused
        T = x.shape[0]
        eps = self.input_norm.eps
        qkv = self.qkv(ops.rms_norm(x, self.input_norm.weight, eps))
        qn = self.q_norm.weight if self.q_norm is not None else _EMPTY
        kn = self.k_norm.weight if self.k_norm is not None else _EMPTY
        q, k, v = ops.qkv_rope(qkv, positions, rope.cos, rope.sin, self.h, self.hkv, self.d, qn, kn,
                               self.q_norm.eps if self.q_norm is not None else eps)
        attn = paged_attention(q, k, v, k_cache, v_cache, meta, self.scale)
        x = x + self._sum(self.o_proj(attn.reshape(T, self.h * self.d)))
        h = self.gate_up(ops.rms_norm(x, self.post_norm.weight, self.post_norm.eps))
        return x + self._sum(self.down(ops.silu_mul(h, isa)))


_EMPTY = torch.empty(0)


def _plan_shard(cfg: ModelConfig, get: WeightGetter, rank: int, world: int) -> RankShard:
    """This rank's shard; the intermediate split falls on down_proj's quant blocks (all layers)."""
    unit = 1
    for i in range(cfg.num_layers):
        unit = math.lcm(unit, weight_block(get, f"model.layers.{i}.mlp.down_proj.weight"))
    return plan(cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size, world, rank, unit, cfg.vocab_size)


class DecoderModel(nn.Module):
    """forward(tokens [T], positions [T], meta, kv caches) -> hidden [T, hidden]; logits(hidden) -> [N, vocab]."""

    def __init__(self, cfg: ModelConfig, get: WeightGetter, dtype: torch.dtype, packed: str | None,
                 max_positions: int, shard: tuple[int, int] | None = None, reduce: Callable | None = None,
                 gather: Callable | None = None):
        """shard: (rank, world) of a tensor-parallel target; reduce: in-place sum over the ranks;
        gather(t, widths): rank 0's logits from every rank's vocab columns (None on other ranks).
        The embedding and LM head are vocab-parallel: each rank holds its rows of the vocabulary
        (sharding.vocab_split); a lookup is masked to them and summed over ranks, and each rank's
        logits for its rows are gathered on rank 0."""
        super().__init__()
        self.cfg = cfg
        self.packed = packed
        self.shard = None if shard is None else _plan_shard(cfg, get, *shard)
        self.kv_heads = cfg.num_kv_heads if self.shard is None else self.shard.heads.num_kv
        split = self.shard is not None and not self.shard.is_full
        self.vocab_rows = self.shard.vocab if split else None
        self.vocab_widths = [b - a for a, b in vocab_split(cfg.vocab_size, self.shard.world)] if split else None
        self.reduce, self.gather = (reduce, gather) if split else (None, None)
        self.dtype = torch.float32 if packed else dtype      # FBGEMM and GGUF kernels take fp32 activations
        # packed == "gguf": low-bit weights run in QuantLinear; float ones (F16/F32 tensors in a GGUF,
        # or types the kernel lacks) in FBGEMM fp16.
        float_backend = "fp16" if packed == "gguf" else packed

        def make_linear(w, b):
            if isinstance(w, (QWeight, list)):
                return QuantLinear(w, b)
            return Linear(w, b, float_backend, self.dtype)

        embed = read_part(get, "model.embed_tokens.weight", self.vocab_rows)
        rows = cfg.vocab_size if self.vocab_rows is None else self.vocab_rows[1] - self.vocab_rows[0]
        if tuple(embed.shape) != (rows, cfg.hidden_size):
            raise ValueError(f"embed_tokens (rows {self.vocab_rows or 'all'}) has shape {tuple(embed.shape)}, "
                             f"config says ({rows}, {cfg.hidden_size}) of a vocabulary of {cfg.vocab_size}: the "
                             "weights do not match config.json")
        # The embedding table is only gathered from, so it stays compact (bf16/fp16, or as stored in
        # the GGUF with rows dequantized on demand).
        if isinstance(embed, QWeight):
            self.embed = QuantEmbedding(embed, self.dtype)
        else:
            self.embed = nn.Parameter(embed.to(dtype), requires_grad=False)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, get, make_linear, self.shard, reduce)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(get("model.norm.weight").to(self.dtype), cfg.rms_norm_eps)
        head = embed if cfg.tie_word_embeddings else read_part(get, "lm_head.weight", self.vocab_rows)
        self.lm_head = make_linear(head, None)
        # low-bit head weights as stored (shared with the embedding when tied): a draft's reduced head
        # (layers/reduced_head.py) takes rows of them
        self._head_q = head if isinstance(head, QWeight) else None
        self._make_linear = make_linear
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, max_positions, self.dtype)
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.weight.data = m.weight.data.to(self.dtype)
        if packed == "gguf":
            from ssd.kernels.build import forced_isa, load_qgemm

            fused = (load_qgemm(), forced_isa())
            for layer in self.layers:
                layer.fused = fused
            self._fused_norm = fused[0]
        else:
            self._fused_norm = None

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        x = self._embed(tokens)
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            x = layer(x, positions, self.rope, kc, vc, meta)
        if self._fused_norm is not None:
            return self._fused_norm.rms_norm(x, self.norm.weight, self.norm.eps)
        return self.norm(x)

    def _lookup(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens) if isinstance(self.embed, QuantEmbedding) else self.embed[tokens].to(self.dtype)

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """Vocab-parallel: this rank's rows, zeros for the others' tokens, summed over ranks (exact:
        one rank contributes each row)."""
        if self.vocab_rows is None:
            return self._lookup(tokens)
        v0, v1 = self.vocab_rows
        mine = (tokens >= v0) & (tokens < v1)
        x = self._lookup(torch.where(mine, tokens - v0, 0)).masked_fill(~mine.unsqueeze(-1), 0)
        return self.reduce(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[N, vocab] float32; with a vocab-parallel head, on rank 0 only (None on the other ranks)."""
        out = self.lm_head(hidden).float()
        return out if self.gather is None else self.gather(out, self.vocab_widths)

    def head_weight(self):
        """The LM head's weights [vocab, hidden] as kept in memory (a QWeight, or a tensor: the plain
        head's, or the embedding table a tied head shares), or None where only a packed copy of an untied
        head is kept (FBGEMM), or the head is vocab-parallel."""
        if self.vocab_rows is not None:
            return None
        if self._head_q is not None:
            return self._head_q
        if isinstance(self.lm_head, Linear) and self.lm_head.weight is not None:
            return self.lm_head.weight
        if self.cfg.tie_word_embeddings and isinstance(self.embed, nn.Parameter):
            return self.embed
        return None

    def head_rows(self, ids: list[int]) -> nn.Module:
        """A linear layer of the LM head's rows `ids` (in that order) in the head's own format."""
        w = self.head_weight()
        if w is None:
            raise ValueError("this model keeps its LM head only packed (or vocab-parallel): it cannot be cut")
        if isinstance(w, QWeight):
            return self._make_linear(w.rows(np.asarray(ids, dtype=np.int64)), None)
        return self._make_linear(w.data[torch.as_tensor(ids, dtype=torch.long)].contiguous(), None)

    def head_dense_rows(self, ids: list[int]) -> torch.Tensor:
        """The LM head's rows `ids` as float32 [len(ids), hidden] (the stored values)."""
        w = self.head_weight()
        if isinstance(w, QWeight):
            return torch.from_numpy(dequantize(w.rows(np.asarray(ids, dtype=np.int64)))).float()
        return w.data[torch.as_tensor(ids, dtype=torch.long)].float()

    def weight_bytes_per_token(self) -> int:
        """Bytes of weights read by one decode step (the memory-bandwidth bound's numerator)."""
        linears = [m for m in self.modules() if isinstance(m, (Linear, QuantLinear))]
        return sum(m.weight_bytes() for m in linears) + self.cfg.hidden_size * self.embed.element_size()
