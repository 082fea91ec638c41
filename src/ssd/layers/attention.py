"""Attention over a paged KV cache for a ragged batch of sequences.

The batch is packed: T new tokens from B sequences, sequence b owning rows
[query_start[b], query_start[b] + query_len[b]). Each new token's K/V is written to its slot in the
cache, then every sequence attends over all of its cached positions (prefix + new tokens) with a
causal mask. Gathers and masks are built once per forward (`AttentionMetadata`) and shared by all
layers.

With an fp16 KV cache on CPU (`kernel=True`), every row (decode, verify, pre-drafted chains and
prompt chunks of any length) goes through the C++ kernel, which reads the cache in place and gives
each row a result that depends on its sequence's cache and its position only: not on its batch
mates, nor on how its prompt was split (a prefix-cache hit) or padded. Until 2026-12-03 prompt
chunks of more than 16 tokens went through PyTorch's SDPA over a batch padded to its longest
sequence, so a prompt's prefill changed in the last bits with its batch mates (greedy tokens of 3 of
8 prompts differed at batch 4 from alone, from the 2nd, 49th and 62nd token); the kernel is as fast
as that SDPA for 160-2048-token prompts on a 2-core AVX-512 host. Other paths (fp32 caches, CUDA)
use SDPA.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def block_slots(block_table: list[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """Cache slots of positions [0, num_tokens) of a sequence with this block table."""
    nblk = (num_tokens + block_size - 1) // block_size
    offsets = torch.arange(block_size)
    return (torch.tensor(block_table[:nblk], dtype=torch.long).unsqueeze(1) * block_size + offsets).reshape(-1)[
        :num_tokens]


@dataclass
class KernelRows:
    """Rows handled by the C++ kernel (all of them): packed row, sequence (row of gather_slots),
    keys to attend."""

    rows: torch.Tensor
    seq: torch.Tensor
    nkeys: torch.Tensor
    slots: torch.Tensor          # [B, L] slot table (= gather_slots of the whole batch)
    ops: object = None           # the compiled kernels and the code path, looked up once per forward
    isa: int = -1


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor   # [T] cache slot for each new token
    gather_slots: torch.Tensor   # [B, L] cache slots of each sequence's context (padded with slot 0)
    pad_index: torch.Tensor      # [B, Q] packed row of each padded query (padded with row 0)
    unpad_index: torch.Tensor    # [T] flat index into [B*Q] of each packed row
    mask: torch.Tensor | None    # [B, 1, Q, L] True = attend; None when no masking is needed
    kernel: KernelRows | None = None

    @classmethod
    def build(cls, query_lens: list[int], context_slots: list[torch.Tensor], device: torch.device,
              kernel: bool = False) -> "AttentionMetadata":
        """context_slots[b]: cache slot of every context position of sequence b after this step
        (its cached prefix followed by its query_lens[b] new tokens). kernel: attend through the
        batch-invariant C++ kernel (fp16 cache on CPU) instead of SDPA."""
        if kernel:
            return cls._build_kernel(query_lens, context_slots, device)
        context_lens = [len(c) for c in context_slots]
        B, Q, L = len(query_lens), max(query_lens), max(context_lens)
        gather = torch.zeros(B, L, dtype=torch.long)
        pad = torch.zeros(B, Q, dtype=torch.long)
        slot_parts, unpad_parts = [], []
        row = 0
        for b, (q, slots) in enumerate(zip(query_lens, context_slots)):
            ctx = len(slots)
            gather[b, :ctx] = slots
            slot_parts.append(slots[ctx - q:])
            pad[b, :q] = torch.arange(row, row + q)
            unpad_parts.append(torch.arange(b * Q, b * Q + q))
            row += q
        mask = None
        if Q > 1 or any(c != L for c in context_lens):
            ctx_t = torch.tensor(context_lens, device=device).view(B, 1, 1)
            ql_t = torch.tensor(query_lens, device=device).view(B, 1, 1)
            qi = torch.arange(Q, device=device).view(1, Q, 1)
            kj = torch.arange(L, device=device).view(1, 1, L)
            qpos = ctx_t - ql_t + qi                    # absolute position of each query
            mask = (kj <= qpos) & (kj < ctx_t)
            mask = mask | (kj == 0)                     # padded query rows still see one key (no NaN)
            mask = mask.unsqueeze(1)
        return cls(
            slot_mapping=torch.cat(slot_parts).to(device),
            gather_slots=gather.to(device),
            pad_index=pad.to(device),
            unpad_index=torch.cat(unpad_parts).to(device),
            mask=mask,
        )


    @classmethod
    def _build_kernel(cls, query_lens: list[int], context_slots: list[torch.Tensor], device: torch.device
                      ) -> "AttentionMetadata":
        B, L = len(query_lens), max(len(c) for c in context_slots)
        gather = torch.zeros(B, L, dtype=torch.long)
        slot_parts, kseq, knk = [], [], []
        for b, (q, slots) in enumerate(zip(query_lens, context_slots)):
            ctx = len(slots)
            gather[b, :ctx] = slots
            slot_parts.append(slots[ctx - q:])
            kseq.extend([b] * q)
            knk.extend(range(ctx - q + 1, ctx + 1))
        from ssd.kernels.build import forced_isa, load_qgemm

        t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        kr = KernelRows(torch.arange(len(kseq), device=device), t(kseq), t(knk), gather.to(device),
                        load_qgemm(), forced_isa())
        return cls(slot_mapping=torch.cat(slot_parts).to(device), gather_slots=gather.to(device),
                   pad_index=torch.zeros(0, 0, dtype=torch.long), unpad_index=torch.zeros(0, dtype=torch.long),
                   mask=None, kernel=kr)


def _sdpa(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
          scale: float) -> torch.Tensor:
    B, Q = meta.pad_index.shape
    T, H, D = q.shape
    qp = q[meta.pad_index].transpose(1, 2)                       # [B, H, Q, D]
    kp = k_cache[meta.gather_slots].to(q.dtype).transpose(1, 2)  # [B, Hkv, L, D]
    vp = v_cache[meta.gather_slots].to(q.dtype).transpose(1, 2)
    out = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.mask, scale=scale,
                                         enable_gqa=kp.shape[1] != H)
    return out.transpose(1, 2).reshape(B * Q, H, D)[meta.unpad_index]


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D]; caches: [num_slots, Hkv, D]. Returns [T, H, D]."""
    k_cache.index_copy_(0, meta.slot_mapping, k.to(k_cache.dtype))
    v_cache.index_copy_(0, meta.slot_mapping, v.to(v_cache.dtype))
    kr = meta.kernel
    if kr is None:
        return _sdpa(q, k_cache, v_cache, meta, scale)
    q = q.contiguous()
    out = torch.empty_like(q)
    if kr.rows.numel():
        kr.ops.paged_attention_rows(q, k_cache, v_cache, kr.slots, kr.rows, kr.seq, kr.nkeys, out, scale, kr.isa)
    return out
