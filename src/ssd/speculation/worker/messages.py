"""Typed messages between the engine and a draft worker (docs/ARCHITECTURE.md 3).

Each message is a dataclass that encodes itself into one int64 list and one float32 tensor and
decodes from them; both sides use these classes, so the wire layout is written down once. The
configuration travels as JSON text (no pickle crosses the wire); everything on the hot path (a
round's requests and replies) is plain integers and floats.

A verification outcome is (accepted, bonus): how many of the draft tokens the target accepted and
the token it emitted after them. A round's speculation length is `num_draft` (at most the engine's K).
"""
from __future__ import annotations

import enum
import json
from dataclasses import asdict, dataclass, field
from typing import ClassVar

import torch

__all__ = ["Add", "Error", "Free", "Hello", "Kind", "Reply", "Request", "Shutdown", "Source", "SpanKind",
           "Speculate", "Speculation", "WorkerConfig", "decode", "encode"]


class Kind(enum.IntEnum):
    CONFIG = 1       # engine -> worker, first message after rendezvous: the whole configuration
    HELLO = 2        # worker -> engine: loaded and ready
    ERROR = 3        # worker -> engine: could not start (text)
    ADD = 4          # engine -> worker: a sequence to draft for
    FREE = 5         # engine -> worker: sequences to drop
    SPECULATE = 6    # engine -> worker: last round's outcomes, asks for the next speculation
    SPECULATION = 7  # worker -> engine: the speculation per sequence
    SHUTDOWN = 8


class Source(enum.IntEnum):
    """Where a reply's speculation came from."""

    NONE = 0         # no draft asked for (num_draft 0)
    CACHE = 1        # a complete pre-drafted chain for the real outcome: a cache hit
    NEURAL = 2       # drafted just in time by the draft model (a miss)
    PARTIAL = 3      # a partially pre-drafted chain finished just in time (a miss)
    FAST = 4         # the prompt-lookup backup (a miss; deterministic proposal)
    NO_ROOM = 5      # the worker has no KV room for this sequence: it dropped it (engine re-adds later)


class SpanKind(enum.IntEnum):
    ANSWER = 1
    PREDRAFT = 2
    PREFILL = 3


@dataclass
class WorkerConfig:
    model: str                    # draft model spec as the engine resolved it (a worker may override the path)
    dtype: str
    k: int                        # speculation length K
    target_vocab: int             # proposals are shipped over the target's vocabulary width
    num_blocks: int               # KV blocks for sequences (the target's count); scratch comes on top
    block_size: int
    max_model_len: int
    max_num_seqs: int             # sizes the pre-draft chain pool
    fanout_budget: int | None = None   # chains per sequence per round; None: sized from measured timings
    saguaro_c: float = 1.0
    backup: str = "auto"          # auto | neural | fast
    chains_per_seq: int = 8       # most chains one sequence gets per round (with a big budget)
    draft_vocab: int = 0          # rows of the draft's reduced head (layers/reduced_head.py); 0: all

    kind: ClassVar[Kind] = Kind.CONFIG

    def __post_init__(self):
        if self.fanout_budget is not None and self.fanout_budget < 1:
            raise ValueError(f"fanout_budget must be >= 1 or None (auto), got {self.fanout_budget}")
        if self.backup not in ("auto", "neural", "fast"):
            raise ValueError(f"backup must be auto, neural or fast, got {self.backup!r}")

    def encode(self):
        return _text(json.dumps(asdict(self))), []

    @classmethod
    def decode(cls, ints, floats):
        return cls(**json.loads(_untext(ints)))


@dataclass
class Hello:
    vocab: int                    # the draft's own vocabulary width
    pid: int
    kind: ClassVar[Kind] = Kind.HELLO

    def encode(self):
        return [self.vocab, self.pid], []

    @classmethod
    def decode(cls, ints, floats):
        return cls(*ints[:2])


@dataclass
class Error:
    text: str
    kind: ClassVar[Kind] = Kind.ERROR

    def encode(self):
        return _text(self.text), []

    @classmethod
    def decode(cls, ints, floats):
        return cls(_untext(ints))


@dataclass
class Add:
    """Draft for `seq_id` from `tokens` (its committed context)."""

    seq_id: int
    seed: int
    temperature: float
    top_k: int
    top_p: float
    tokens: list[int]
    kind: ClassVar[Kind] = Kind.ADD

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def encode(self):
        return [self.seq_id, self.seed, self.top_k, *self.tokens], [self.temperature, self.top_p]

    @classmethod
    def decode(cls, ints, floats):
        return cls(ints[0], ints[1], float(floats[0]), ints[2], float(floats[1]), list(ints[3:]))


@dataclass
class Free:
    seq_ids: list[int]
    kind: ClassVar[Kind] = Kind.FREE

    def encode(self):
        return list(self.seq_ids), []

    @classmethod
    def decode(cls, ints, floats):
        return cls(list(ints))


@dataclass
class Request:
    """One sequence of a round: the outcome of its last speculation, and how many tokens to draft."""

    seq_id: int
    accepted: int
    bonus: int
    num_draft: int


@dataclass
class Speculate:
    requests: list[Request]
    verify_s: float = 0.0         # the target's last verification time (sizes pre-drafting)
    kind: ClassVar[Kind] = Kind.SPECULATE

    def encode(self):
        ints = [x for r in self.requests for x in (r.seq_id, r.accepted, r.bonus, r.num_draft)]
        return ints, [self.verify_s]

    @classmethod
    def decode(cls, ints, floats):
        reqs = [Request(*ints[i:i + 4]) for i in range(0, len(ints), 4)]
        return cls(reqs, float(floats[0]) if len(floats) else 0.0)


@dataclass
class Reply:
    seq_id: int
    source: Source
    tokens: list[int]
    probs: torch.Tensor | None = None    # [len(tokens), V]: what the tokens were sampled from; None: one-hot

    @property
    def hit(self) -> bool:
        return self.source == Source.CACHE


@dataclass
class Speculation:
    replies: list[Reply]
    chains_drafted: int = 0       # cumulative, worker side
    busy_s: float = 0.0           # cumulative worker busy time
    spans: list[tuple[SpanKind, float, float]] = field(default_factory=list)   # (kind, start, end) seconds
    prefill_tokens: int = 0       # cumulative: tokens the worker computed when sequences were added
    prefill_s: float = 0.0        # cumulative: the time those prefills took
    kind: ClassVar[Kind] = Kind.SPECULATION

    def encode(self):
        ints = [len(self.replies), self.chains_drafted, len(self.spans), self.prefill_tokens]
        probs = []
        for r in self.replies:
            ints += [r.seq_id, int(r.source), int(r.probs is not None), len(r.tokens), *r.tokens]
            if r.probs is not None:
                probs.append(r.probs.reshape(-1).float())
        for kind, start, end in self.spans:
            ints += [int(kind), int(start * 1e6), int(end * 1e6)]
        return ints, torch.cat(probs + [torch.tensor([self.busy_s, self.prefill_s], dtype=torch.float32)])

    @classmethod
    def decode(cls, ints, floats, vocab: int):
        n, chains, n_spans, prefill_tokens = ints[:4]
        pos, off, replies = 4, 0, []
        for _ in range(n):
            seq_id, source, has_probs, m = ints[pos:pos + 4]
            tokens = list(ints[pos + 4:pos + 4 + m])
            pos += 4 + m
            probs = None
            if has_probs:
                probs = floats[off:off + m * vocab].view(m, vocab)
                off += m * vocab
            replies.append(Reply(seq_id, Source(source), tokens, probs))
        spans = [(SpanKind(ints[pos + 3 * i]), ints[pos + 3 * i + 1] / 1e6, ints[pos + 3 * i + 2] / 1e6)
                 for i in range(n_spans)]
        return cls(replies, chains, float(floats[-2]), spans, int(prefill_tokens), float(floats[-1]))


@dataclass
class Shutdown:
    kind: ClassVar[Kind] = Kind.SHUTDOWN

    def encode(self):
        return [], []

    @classmethod
    def decode(cls, ints, floats):
        return cls()


_TYPES = {c.kind: c for c in (WorkerConfig, Hello, Error, Add, Free, Speculate, Speculation, Shutdown)}


def encode(msg) -> tuple[Kind, torch.Tensor, torch.Tensor]:
    ints, floats = msg.encode()
    it = torch.as_tensor(ints, dtype=torch.long).reshape(-1)
    ft = floats if isinstance(floats, torch.Tensor) else torch.as_tensor(floats, dtype=torch.float32)
    return msg.kind, it, ft.reshape(-1).to(torch.float32)


def decode(kind: int, ints: torch.Tensor, floats: torch.Tensor, vocab: int | None = None):
    cls = _TYPES[Kind(kind)]
    if cls is Speculation:
        if vocab is None:
            raise ValueError("decoding a Speculation needs the vocabulary width")
        return cls.decode(ints.tolist(), floats, vocab)
    return cls.decode(ints.tolist(), floats)


def _text(s: str) -> list[int]:
    return list(s.encode("utf-8"))


def _untext(ints) -> str:
    return bytes(ints).decode("utf-8", "replace")
