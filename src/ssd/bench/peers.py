"""Hugging Face ``transformers`` peers for the benchmark: the same weights, dtype and thread count
as our engine, decoded greedily with ``model.generate``.

* ``hf``: plain greedy generation.
* ``hf-assisted``: transformers' assisted generation (``assistant_model=``), its speculative
  decoding; with greedy decoding it must reproduce the plain greedy tokens.

Every prompt generates exactly ``max_new_tokens`` tokens: EOS is removed from the models'
generation configs, so it no longer stops generation (like ``SamplingParams(ignore_eos=True)``:
an EOS token may still be generated, and decoding continues after it).

Timing, per prompt, uses a streamer that timestamps every batch of tokens ``generate`` emits:

* ``ttft_s``: from calling ``generate`` to the first generated token (prefill + first token);
* ``decode_tokens_per_s``: tokens after the first emission / ``(t_last - t_first)``, i.e. the
  prefill excluded (the first emission is 1 token for ``hf``, a verified block for assisted);
* ``total_tokens_per_s``: ``n / wall``, prefill included.

A forward hook on the target model counts its forward calls, so ``mean_accepted_len`` (tokens
per target forward, the prefill forward included) is 1.0 for ``hf`` and > 1 when assisted
generation accepts drafts.
"""
from __future__ import annotations

import logging
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype | str:
    """``torch.dtype`` for a name such as ``"bf16"``; ``"auto"`` is passed through."""
    if isinstance(dtype, torch.dtype) or dtype == "auto":
        return dtype
    try:
        return _DTYPES[str(dtype).lower().removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)} or 'auto'") from None


@dataclass
class PeerResult:
    """Per-prompt outputs and timings of one :func:`hf_generate` call (lists are per prompt)."""

    mode: str  # "hf" | "hf-assisted"
    model_dir: str
    assistant_dir: str | None
    dtype: str
    threads: int
    max_new_tokens: int
    generated: list[list[int]] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    wall_s: list[float] = field(default_factory=list)
    decode_tokens_per_s: list[float] = field(default_factory=list)
    total_tokens_per_s: list[float] = field(default_factory=list)
    decode_s: list[float] = field(default_factory=list)
    decode_tokens: list[int] = field(default_factory=list)
    target_forwards: list[int] = field(default_factory=list)
    load_s: float = 0.0

    @property
    def generated_tokens(self) -> int:
        return sum(len(g) for g in self.generated)

    @property
    def tokens_per_s(self) -> float:
        """Aggregate end-to-end throughput: all generated tokens / all generation wall time."""
        wall = sum(self.wall_s)
        return self.generated_tokens / wall if wall > 0 else 0.0

    @property
    def decode_tokens_per_s_aggregate(self) -> float:
        """Aggregate decode throughput, prefill and the first emitted tokens excluded."""
        secs = sum(self.decode_s)
        return sum(self.decode_tokens) / secs if secs > 0 else 0.0

    @property
    def mean_accepted_len(self) -> float | None:
        fw = sum(self.target_forwards)
        return self.generated_tokens / fw if fw else None

    def to_run(self, dataset: str) -> dict[str, Any]:
        """This result as one ``runs`` entry of the report schema (see :mod:`ssd.bench.report`)."""
        def med(xs: list[float]) -> float | None:
            return statistics.median(xs) if xs else None

        ttft = med(self.ttft_s)
        return {
            "dataset": dataset,
            "mode": self.mode,
            "tokens_per_s": self.tokens_per_s,
            "tokens_per_s_median": med(self.total_tokens_per_s),
            "decode_tokens_per_s": self.decode_tokens_per_s_aggregate,
            "decode_tokens_per_s_median": med(self.decode_tokens_per_s),
            "ttft_ms_median": ttft * 1000 if ttft is not None else None,
            "acceptance_rate": None,
            "mean_accepted_len": self.mean_accepted_len,
            "acceptance_by_position": None,
            "num_prompts": len(self.generated),
            "generated_tokens": self.generated_tokens,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class _TimingStreamer:
    """A ``generate`` streamer that records when each batch of new tokens arrives."""

    def __init__(self) -> None:
        self.prompt_seen = False
        self.times: list[float] = []
        self.counts: list[int] = []

    def put(self, value: torch.Tensor) -> None:
        now = time.perf_counter()
        if not self.prompt_seen:  # generate first pushes the prompt itself
            self.prompt_seen = True
            return
        self.times.append(now)
        self.counts.append(int(value.numel()))

    def end(self) -> None:
        pass


def _load(model_dir: str | Path, dtype: torch.dtype | str, model_kwargs: dict[str, Any] | None):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype, **(model_kwargs or {}))
    model.eval()
    gc = model.generation_config
    # EOS must not stop generation; a pad id keeps generate from falling back to (absent) EOS.
    if gc.pad_token_id is None:
        eos = gc.eos_token_id
        gc.pad_token_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    gc.eos_token_id = None
    gc.do_sample = False
    for attr in ("temperature", "top_p", "top_k"):  # silence "sampling flag set but do_sample=False"
        if hasattr(gc, attr):
            setattr(gc, attr, None)
    return model


def hf_generate(
    model_dir: str | Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    dtype: str | torch.dtype = "bfloat16",
    threads: int | None = None,
    assistant_dir: str | Path | None = None,
    *,
    num_assistant_tokens: int | None = None,
    warmup: bool = True,
    progress: bool = True,
    model_kwargs: dict[str, Any] | None = None,
) -> PeerResult:
    """Greedy-decode each prompt (token ids) with transformers, ``max_new_tokens`` tokens each.

    ``assistant_dir`` switches to assisted generation with that model as the draft;
    ``num_assistant_tokens`` fixes its draft length (constant schedule, no confidence-based early
    stop) instead of transformers' default heuristic schedule and confidence threshold. ``threads`` sets ``torch.set_num_threads`` for the call (restored
    afterwards). Models are loaded once per call; a short untimed warm-up generation runs first
    unless ``warmup=False``.
    """
    from tqdm.auto import tqdm

    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    torch_dtype = resolve_dtype(dtype)
    prev_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    mode = "hf-assisted" if assistant_dir is not None else "hf"
    result = PeerResult(
        mode=mode,
        model_dir=str(model_dir),
        assistant_dir=str(assistant_dir) if assistant_dir is not None else None,
        dtype=str(torch_dtype).removeprefix("torch."),
        threads=torch.get_num_threads(),
        max_new_tokens=max_new_tokens,
    )
    try:
        t0 = time.perf_counter()
        model = _load(model_dir, torch_dtype, model_kwargs)
        assistant = None
        if assistant_dir is not None:
            assistant = _load(assistant_dir, torch_dtype, model_kwargs)
            if num_assistant_tokens is not None:
                assistant.generation_config.num_assistant_tokens = int(num_assistant_tokens)
                assistant.generation_config.num_assistant_tokens_schedule = "constant"
                # no early stop on low draft confidence: always draft num_assistant_tokens
                assistant.generation_config.assistant_confidence_threshold = 0.0
        result.load_s = time.perf_counter() - t0
        logger.info("%s: loaded %s%s in %.1fs", mode, model_dir,
                    f" + assistant {assistant_dir}" if assistant_dir else "", result.load_s)
        device = model.device

        forwards = [0]
        hook = model.register_forward_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))

        def run(ids: list[int], n: int, streamer: Any = None) -> torch.Tensor:
            input_ids = torch.tensor([ids], dtype=torch.long, device=device)
            kwargs: dict[str, Any] = dict(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                max_new_tokens=n,
                do_sample=False,
                streamer=streamer,
            )
            if assistant is not None:
                kwargs["assistant_model"] = assistant
            with torch.inference_mode():
                out = model.generate(**kwargs)
            return out[0, input_ids.shape[1]:]

        try:
            if warmup and prompts:
                run(prompts[0][-64:], min(4, max_new_tokens))
            for ids in tqdm(prompts, desc=mode, unit="prompt", disable=not progress):
                forwards[0] = 0
                streamer = _TimingStreamer()
                start = time.perf_counter()
                new = run(ids, max_new_tokens, streamer)
                end = time.perf_counter()
                toks = [int(t) for t in new.tolist()]
                if len(toks) != max_new_tokens:
                    logger.warning("%s generated %d tokens instead of %d", mode, len(toks), max_new_tokens)
                first = streamer.times[0] if streamer.times else end
                ttft = first - start
                wall = end - start
                last = streamer.times[-1] if streamer.times else end
                result.generated.append(toks)
                result.ttft_s.append(ttft)
                result.wall_s.append(wall)
                result.total_tokens_per_s.append(len(toks) / wall if wall > 0 else 0.0)
                # tokens after the first emission (1 token for plain generate, possibly
                # several for assisted generation, whose first emission is a verified block)
                dec_toks = len(toks) - (streamer.counts[0] if streamer.counts else len(toks))
                dec_time = last - first
                result.decode_s.append(dec_time)
                result.decode_tokens.append(dec_toks)
                result.decode_tokens_per_s.append(dec_toks / dec_time if dec_time > 0 else 0.0)
                result.target_forwards.append(forwards[0])
        finally:
            hook.remove()
    finally:
        torch.set_num_threads(prev_threads)
    logger.info("%s: %d prompts, %.2f tok/s end-to-end, %.2f tok/s decode", mode, len(result.generated),
                result.tokens_per_s, result.decode_tokens_per_s_aggregate)
    return result
