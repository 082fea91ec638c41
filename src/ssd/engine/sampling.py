"""Batch helpers between sequences and the sampler module."""
from __future__ import annotations

import torch

from ssd.engine.sequence import Sequence
from ssd.layers.sampler import logits_to_probs, sample


def probs_for(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    """logits [B, V] (row b belongs to seqs[b]) -> probabilities under each sequence's params."""
    temp = torch.tensor([s.params.temperature for s in seqs], dtype=torch.float32)
    top_k = torch.tensor([s.params.top_k for s in seqs], dtype=torch.long)
    top_p = torch.tensor([s.params.top_p for s in seqs], dtype=torch.float32)
    return logits_to_probs(logits.float().cpu(), temp, top_k, top_p)


def sample_tokens(logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
    if all(s.params.greedy for s in seqs):
        return logits.argmax(dim=-1).tolist()
    return sample(probs_for(logits, seqs), [s.generator for s in seqs]).tolist()
