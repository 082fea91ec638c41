"""Runs one model over a paged KV cache: packs a ragged batch, builds attention metadata once,
and returns logits only for the rows the caller needs."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ssd.engine.block_manager import BlockManager
from ssd.layers.attention import AttentionMetadata, block_slots
from ssd.models.decoder import DecoderModel


@dataclass
class ForwardItem:
    """New tokens of one sequence. `start` = position of tokens[0] (tokens before it are cached);
    logits are returned for the last `num_logits` tokens."""

    seq_id: int
    tokens: list[int]
    start: int
    num_logits: int = 1
    slots: torch.Tensor | None = None   # explicit context slots (len start+len(tokens)); default: block table


@dataclass
class StepBatch:
    """One packed forward: what every tensor-parallel rank needs to run its shard (logit rows are
    rank 0's business)."""

    tokens: list[int]
    positions: list[int]
    query_lens: list[int]
    ctx_slots: list[torch.Tensor]     # per item: cache slot of every context position after the step
    logit_rows: list[int]


class ModelRunner:
    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, device: torch.device,
                 head: torch.nn.Module | None = None):
        """head: scores the logit rows instead of the model's own LM head (a draft's ReducedHead, which
        also sees every token fed)."""
        self.model = model
        self.head = head
        self.device = device
        cfg = model.cfg
        self.block_manager = BlockManager(num_blocks, block_size)
        shape = (num_blocks * block_size, model.kv_heads, cfg.head_dim)     # this rank's KV heads
        kv_dtype = self.kv_dtype(model, device)
        self.attention_kernel = kv_dtype == torch.float16 and device.type == "cpu"
        self.kv_caches = [(torch.zeros(shape, dtype=kv_dtype, device=device),
                           torch.zeros(shape, dtype=kv_dtype, device=device)) for _ in range(cfg.num_layers)]

    @staticmethod
    def kv_dtype(model: DecoderModel, device: torch.device | str) -> torch.dtype:
        """fp16 on CPU for the packed (fp16/int8/low-bit) weight paths, read by the C++ attention
        kernel (on CPUs with AVX-512; always for the low-bit path); the model's dtype otherwise
        (float32 stays the exact reference path)."""
        if torch.device(device).type == "cpu" and model.packed is not None:
            from ssd.kernels.build import KernelBuildError, load_qgemm

            try:
                if load_qgemm().best_isa() >= 2 or model.packed == "gguf":   # its fast path needs AVX-512
                    return torch.float16
            except KernelBuildError:
                pass
        return model.dtype

    @staticmethod
    def kv_bytes_per_token(model: DecoderModel, device: torch.device | str = "cpu") -> int:
        cfg = model.cfg
        itemsize = torch.empty(0, dtype=ModelRunner.kv_dtype(model, device)).element_size()
        return 2 * cfg.num_layers * model.kv_heads * cfg.head_dim * itemsize

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem]) -> list[torch.Tensor]:
        """-> one [num_logits, vocab] float32 tensor per item. The block manager must already hold
        room for every token (allocate/append done by the caller)."""
        batch = self.pack(items)
        hidden = self.run(batch)
        if not batch.logit_rows:
            return [hidden.new_zeros(0, self.model.cfg.vocab_size) for _ in items]
        logits = (self.head or self.model.logits)(hidden[torch.tensor(batch.logit_rows, dtype=torch.long, device=self.device)])
        return list(logits.split([it.num_logits for it in items]))

    def pack(self, items: list[ForwardItem]) -> StepBatch:
        bm = self.block_manager
        tokens, positions, logit_rows = [], [], []
        row = 0
        for it in items:
            n = len(it.tokens)
            if it.slots is None and it.start + n > bm.num_tokens(it.seq_id):
                raise RuntimeError(f"sequence {it.seq_id}: no KV room reserved for positions "
                                   f"[{it.start}, {it.start + n})")
            tokens.extend(it.tokens)
            positions.extend(range(it.start, it.start + n))
            logit_rows.extend(range(row + n - it.num_logits, row + n))
            row += n
        ctx_slots = [it.slots if it.slots is not None else
                     block_slots(bm.block_table(it.seq_id), bm.block_size, it.start + len(it.tokens))
                     for it in items]
        V = self.model.cfg.vocab_size
        if tokens and max(tokens) >= V:
            # a draft narrower than its target sees target-only ids (padding rows): any id of its own
            # will do, since the target verifies every proposal
            tokens = [x if x < V else 0 for x in tokens]
        return StepBatch(tokens, positions, [len(it.tokens) for it in items], ctx_slots, logit_rows)

    @torch.inference_mode()
    def run(self, batch: StepBatch) -> torch.Tensor:
        """The model over one packed batch -> final hidden states [T, hidden]."""
        if self.head is not None:
            self.head.observe(batch.tokens)
        meta = AttentionMetadata.build(batch.query_lens, batch.ctx_slots, self.device, kernel=self.attention_kernel)
        t = torch.tensor(batch.tokens, dtype=torch.long, device=self.device)
        pos = torch.tensor(batch.positions, dtype=torch.long, device=self.device)
        return self.model(t, pos, meta, self.kv_caches)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the KV of cache slots src -> dst in every layer (reusing already computed entries)."""
        src, dst = src.to(self.device), dst.to(self.device)
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k[src])
            v.index_copy_(0, dst, v[src])
