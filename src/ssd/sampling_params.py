"""Per-request sampling parameters, validated on construction."""
from __future__ import annotations

from dataclasses import dataclass, field


MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    """How to turn a request's logits into tokens.

    temperature 0 means greedy (argmax). top_k <= 0 and top_p == 1 disable those filters.
    A seed makes the request reproducible regardless of its batch mates. logprobs, speculate and
    max_draft: see README "Python API".
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int = 256
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None       # None: none; n: each token's logprob and the n most likely (n <= 20)
    speculate: bool = True            # False: this request gets no draft tokens (AR rounds) in SD/SSD/auto
    max_draft: int | None = None      # at most this many draft tokens per round for this request (<= K)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> None:
        def bad(msg: str) -> ValueError:
            return ValueError(f"invalid sampling parameter: {msg}")

        if not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool):
            raise bad(f"temperature must be a number, got {self.temperature!r}")
        if not 0.0 <= float(self.temperature) <= 100.0:
            raise bad(f"temperature must be in [0, 100], got {self.temperature} (use 0 for greedy)")
        self.temperature = float(self.temperature)
        if not isinstance(self.top_p, (int, float)) or not 0.0 < float(self.top_p) <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r} (use 1 to disable)")
        self.top_p = float(self.top_p)
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad(f"top_k must be an integer >= 0, got {self.top_k!r} (use 0 or -1 to disable)")
        if self.top_k == -1:
            self.top_k = 0
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad(f"seed must be an integer or None, got {self.seed!r}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise bad(f"seed must be in [0, 2**63), got {self.seed}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or isinstance(self.logprobs, bool)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad(f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}")
        if not isinstance(self.speculate, bool):
            raise bad(f"speculate must be true or false, got {self.speculate!r}")
        if self.max_draft is not None and (not isinstance(self.max_draft, int) or isinstance(self.max_draft, bool)
                                           or self.max_draft < 0):
            raise bad(f"max_draft must be an integer >= 0 or None, got {self.max_draft!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise bad(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise bad(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
