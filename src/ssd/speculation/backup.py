"""The fast backup proposer: a speculation at near-zero cost when the cache misses (docs/ARCHITECTURE.md 1.3).

Prompt lookup: the sequence's own context often repeats itself (code, quoted text, lists), so the
tokens that followed the most recent earlier occurrence of its last few tokens are a cheap guess
at what comes next. The proposal is deterministic, so the verifier must treat it as one-hot
proposal distributions (`onehot_probs`): token d accepted with probability p(d), bonus from
norm(max(p - onehot(d), 0)). That is exact; the guess only affects speed.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["ngram_proposal", "onehot_probs"]


def ngram_proposal(context_tokens: Sequence[int], num_draft: int, n: int = 3) -> list[int] | None:
    """K tokens proposed by matching the context's last n (then n-1, ..., 1) tokens earlier on.

    The most recent earlier occurrence of the longest matching suffix wins; the proposal is the
    num_draft tokens that followed it. When the match is so recent that fewer than num_draft
    tokens follow it, the copy continues through the proposal itself (the context is read as
    periodic from the match on: ...a b a b -> a b a b ...), so a proposal always has exactly
    num_draft tokens. Returns None when no suffix of length 1..n occurs earlier.
    """
    if num_draft < 0 or n < 1:
        raise ValueError(f"need num_draft >= 0 and n >= 1, got {num_draft} and {n}")
    tokens = list(context_tokens)
    length = len(tokens)
    for size in range(min(n, length - 1), 0, -1):
        suffix = tokens[length - size :]
        last = suffix[-1]
        for start in range(length - size - 1, -1, -1):  # most recent first, never the suffix itself
            if tokens[start + size - 1] == last and tokens[start : start + size] == suffix:
                stream = tokens[:]
                follow = start + size  # < length: at least one real token follows the match
                for j in range(num_draft):
                    stream.append(stream[follow + j])
                return stream[length:]
    return None


def onehot_probs(tokens: Sequence[int] | Tensor, vocab_size: int, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None) -> Tensor:
    """[len(tokens), V] one-hot proposal distributions of a deterministic proposal."""
    ids = torch.as_tensor(tokens, dtype=torch.long, device=device).reshape(-1)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"token ids must be in [0, {vocab_size}), got {ids.tolist()}")
    return torch.nn.functional.one_hot(ids, vocab_size).to(dtype)
