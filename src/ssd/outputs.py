"""What generate() and stream() hand back: text, ids, finish reason and metrics."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ssd.engine.logprobs import TokenLogprob
from ssd.engine.sequence import Sequence, SpecStats


@dataclass
class RequestMetrics:
    ttft_s: float | None
    total_s: float
    num_prompt_tokens: int
    num_generated_tokens: int
    decode_tokens_per_s: float | None    # tokens after the first / time after the first
    tokens_per_s: float                  # all generated tokens / total time
    target_forwards: int                 # decode-phase target forwards (AR: one per token)
    acceptance_rate: float | None        # accepted / proposed draft tokens (SD)
    mean_accepted_len: float | None      # tokens committed per target forward in decode (SD)
    acceptance_by_position: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, seq: Sequence) -> "RequestMetrics":
        end = seq.finish_time or seq.arrival_time
        total = max(end - seq.arrival_time, 1e-9)
        n = len(seq.output_token_ids)
        ttft = None if seq.first_token_time is None else seq.first_token_time - seq.arrival_time
        decode_tps = None
        if ttft is not None and n > 1 and end > seq.first_token_time:
            decode_tps = (n - 1) / (end - seq.first_token_time)
        return cls(ttft, total, len(seq.prompt_token_ids), n, decode_tps, n / total, seq.spec.rounds,
                   *spec_rates(seq.spec, n))

    def to_dict(self) -> dict:
        return asdict(self)


def spec_rates(spec: SpecStats, generated: int) -> tuple[float | None, float | None, list[float]]:
    if spec.draft_tokens == 0:
        return None, None, []
    by_pos = [a / p if p else 0.0 for a, p in zip(spec.accepted_by_pos, spec.proposed_by_pos)]
    decode_tokens = max(generated - 1, 0)
    return spec.accepted_tokens / spec.draft_tokens, decode_tokens / max(spec.rounds, 1), by_pos


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None
    metrics: RequestMetrics
    spec: SpecStats = field(default_factory=SpecStats, repr=False)
    logprobs: list[TokenLogprob] | None = None   # per generated token, when SamplingParams.logprobs was set


@dataclass
class StreamChunk:
    request_id: str
    text: str                     # new text since the previous chunk (UTF-8 safe)
    token_ids: list[int]          # tokens committed in this step (an SD round may commit several)
    finished: bool
    finish_reason: str | None
    output: RequestOutput | None = None   # the full result on the final chunk
    logprobs: list[TokenLogprob] | None = None   # per token of this chunk, when asked for


def aggregate(outputs: list[RequestOutput], wall_s: float | None = None) -> dict:
    """Batch-level metrics over finished requests (wall_s: elapsed time of the whole batch)."""
    gen = sum(o.metrics.num_generated_tokens for o in outputs)
    spec = SpecStats()
    for o in outputs:
        spec.merge(o.spec)
    wall = wall_s if wall_s is not None else max((o.metrics.total_s for o in outputs), default=0.0)
    ttfts = sorted(o.metrics.ttft_s for o in outputs if o.metrics.ttft_s is not None)
    decode_tokens = sum(max(o.metrics.num_generated_tokens - 1, 0) for o in outputs)
    acc, mal, by_pos = spec_rates(spec, 0)
    return {"requests": len(outputs), "generated_tokens": gen, "wall_s": wall,
            "tokens_per_s": gen / wall if wall else None,
            "ttft_s_median": ttfts[len(ttfts) // 2] if ttfts else None,
            "target_forwards": spec.rounds,
            "acceptance_rate": acc,
            "mean_accepted_len": decode_tokens / spec.rounds if spec.rounds and acc is not None else None,
            "acceptance_by_position": by_pos}
