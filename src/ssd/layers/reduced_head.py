"""A draft's LM head over part of the vocabulary (`draft_vocab`).

The head of a small draft is a large share of what one draft step reads: Qwen2.5-0.5B's tied
151,936-row head is 153 of its 452 MB as stored (Q8_0 in the default GGUF), 85 of 306 MB as the
default CPU draft runs it (requantized to Q4_1), about 2 ms of a 16-21 ms draft step on 2 threads.
Most of what the target emits lies in few rows, so the draft scores only:

- `rows` base ids: the most frequent ones where a ranking ships for the tokenizer
  (data/<family>-token-ranks.npz, made by scripts/token_ranks.py from ShareGPT assistant turns and
  the Python standard library), else the lowest ids (byte-level BPE ids grow with merge order, so
  the low ids are the short, common tokens);
- the tokenizer's special and added tokens (end of turn, end of text, chat markers);
- every token the draft has been fed (prompts and committed tokens), up to `max_extra` of them: the
  names and identifiers of a request are usually in its prompt, and a long-running engine so keeps
  the tokens of its own workload.

Every other token gets logit -inf, so the draft never proposes it. This is exact by construction:
the verifier's rejection sampling needs only that q is the distribution the draft sampled from,
which holds for any q; a token outside the set is emitted by the target from the residual
max(p - q, 0), where it keeps its whole mass. What it costs is acceptance where the target's
token is outside the set (that position is always rejected), which mode "auto" sees as it sees any
acceptance. Only a draft's head is cut: the target's is never approximated.

The base rows run in the head's own format (the low-bit kernel for a GGUF draft), their scores
scattered into the full-width row; the extra rows are dequantized once into a float32 buffer
(`max_extra` x hidden) and scored with a plain matmul.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch
from torch import nn

log = logging.getLogger(__name__)

MAX_EXTRA = 4096                # rows beyond the base that may be added (fed tokens, specials)
DATA = Path(__file__).resolve().parent / "data"


def base_vocab_fingerprint(tokenizer) -> tuple[int, str]:
    """(number of base ids: those below the first added token, sha256 of their token strings): what a
    shipped ranking must match."""
    added = [int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {})]
    size = len(tokenizer)
    base = min([i for i in added if i > 0] + [size])
    tokens = tokenizer.convert_ids_to_tokens(list(range(base)))
    return base, hashlib.sha256("\n".join(t or "" for t in tokens).encode()).hexdigest()


@functools.lru_cache(maxsize=None)
def _rankings() -> list[tuple[dict, np.ndarray]]:
    out = []
    for path in sorted(DATA.glob("*-token-ranks.npz")):
        with np.load(path) as z:
            out.append((json.loads(z["meta"].tobytes().decode()), z["ranks"].astype(np.int64)))
    return out


def base_ids(tokenizer, rows: int, vocab: int) -> tuple[list[int], str]:
    """The `rows` base ids of the reduced head, ascending, and where they came from."""
    rows = min(rows, vocab)
    if tokenizer is not None and _rankings():
        size, digest = base_vocab_fingerprint(tokenizer)
        for meta, ranks in _rankings():
            if meta["base_size"] == size and meta["sha256"] == digest:
                picked = ranks[ranks < vocab][:rows]
                return sorted(int(i) for i in picked), "the most frequent (shipped ranking)"
    return list(range(rows)), "the lowest ids (no shipped ranking for this tokenizer)"


class ReducedHead(nn.Module):
    """logits(hidden [N, H]) -> [N, vocab] float32: the model's head scores for the kept ids, -inf for
    the others. `observe(token_ids)` keeps the ids the draft is fed from then on."""

    def __init__(self, model, base: list[int], always: Iterable[int] = (), max_extra: int = MAX_EXTRA):
        super().__init__()
        self.vocab = model.cfg.vocab_size
        if not base or base != sorted(set(base)) or base[-1] >= self.vocab:
            raise ValueError("the base ids of a reduced head must be distinct, ascending and in the vocabulary")
        self.base = torch.tensor(base, dtype=torch.long)
        self.prefix = model.head_rows(base)
        self._dense_rows = model.head_dense_rows      # ids -> float32 rows (a method: not a submodule)
        self.max_extra = max_extra
        self.ids = torch.empty(max_extra, dtype=torch.long)
        self.weight = torch.empty(max_extra, model.cfg.hidden_size, dtype=torch.float32)
        self.count = 0
        self._known: set[int] = set(base)
        self._full_logged = False
        self.observe(always)

    def observe(self, token_ids: Iterable[int]) -> None:
        """Keep the ids among `token_ids` that are not kept yet (while there is room)."""
        new = sorted(t for t in {int(t) for t in token_ids} - self._known if 0 <= t < self.vocab)
        if not new:
            return
        room = self.max_extra - self.count
        if len(new) > room:
            if not self._full_logged:
                log.info("draft_vocab: the %d extra rows of the draft's reduced head are all taken; tokens "
                         "first seen from now on are not proposed (exact either way)", self.max_extra)
                self._full_logged = True
            new = new[:room]
            if not new:
                return
        n, c = len(new), self.count
        self.ids[c:c + n] = torch.tensor(new, dtype=torch.long)
        self.weight[c:c + n] = self._dense_rows(new)
        self.count += n
        self._known.update(new)

    def kept(self) -> torch.Tensor:
        """The ids this head scores now, ascending."""
        return torch.cat([self.base, self.ids[:self.count]]).sort().values

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        x = hidden.float()
        out = torch.full((x.shape[0], self.vocab), float("-inf"), dtype=torch.float32, device=x.device)
        out.index_copy_(1, self.base, self.prefix(hidden).float())
        if self.count:
            out.index_copy_(1, self.ids[:self.count], x @ self.weight[:self.count].T)
        return out

    def weight_bytes(self) -> int:
        """Bytes of weights one step reads (the base rows in their format, the extra rows in float32)."""
        return self.prefix.weight_bytes() + self.count * self.weight.shape[1] * 4


def special_ids(tokenizer) -> list[int]:
    """The tokenizer's special and added tokens (end of turn, end of text, chat markers)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    ids.update(int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {}))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return sorted(int(i) for i in ids)


def step_weight_bytes(model, head: ReducedHead | None) -> int:
    """Bytes of weights one draft step reads with this head (None: the model's own, whole head)."""
    whole = model.weight_bytes_per_token()
    return whole if head is None else whole - model.lm_head.weight_bytes() + head.weight_bytes()


def draft_head(model, tokenizer, rows: int) -> ReducedHead | None:
    """The reduced head for a draft (None: score the whole vocabulary; rows = 0 asks for that, and a
    head whose weights are kept only packed cannot be cut, which is logged)."""
    vocab = model.cfg.vocab_size
    if rows < 0:
        raise ValueError(f"draft_vocab must be >= 0 (0 = the whole vocabulary), got {rows}")
    if rows == 0 or rows >= vocab:
        return None
    if model.head_weight() is None:
        log.warning("draft_vocab=%d: the draft keeps its LM head only packed (an untied FBGEMM head) or "
                    "vocab-parallel, so it scores the whole vocabulary", rows)
        return None
    base, source = base_ids(tokenizer, rows, vocab)
    head = ReducedHead(model, base, special_ids(tokenizer), MAX_EXTRA)
    log.info("draft head: %d of %d vocabulary rows (%d base ids, %s; %d special tokens; then the tokens it "
             "is fed)", len(base) + head.count, vocab, len(base), source, head.count)
    return head
