"""The OpenAI wire format: request models (validated strictly, unknown fields ignored), error
objects, and the JSON of responses and stream chunks."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from ssd.engine.sequence import SpecStats
from ssd.outputs import spec_rates

MAX_N = 64                     # choices per request
MAX_PROMPTS = 64               # prompts in one batched completions request
MAX_STOP = 16
MAX_LOGPROBS = 20              # top alternatives per token (SamplingParams.logprobs)
SEED_LIMIT = 2**63


class APIError(Exception):
    """An error with an OpenAI-style body: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    include_usage: bool = False


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None                 # extension (vLLM-style)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    ignore_eos: bool = False                 # extension
    speculate: bool | None = None            # extension: false = no draft tokens for this request
    max_draft: int | None = None             # extension: at most this many draft tokens per round
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Known OpenAI fields the engine does not implement: accepted at their neutral value only.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None


class CompletionRequest(_Request):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    role: str
    content: str | list[TextPart] | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    response_format: dict[str, Any] | None = None


_HINTS = {
    "prompt": "must be a string, a list of strings, a list of token ids or a list of token-id lists",
    "messages": "must be a list of {\"role\": string, \"content\": string or list of text parts} objects",
    "stop": "must be a string or a list of strings",
    "stream_options": "must be an object like {\"include_usage\": true}",
    "logit_bias": "must be an object mapping token ids to numbers",
}


def _describe(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None), list, dict)) else repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def validation_message(err: ValidationError, body: Any) -> tuple[str, str | None]:
    """One clear sentence for the first problem in `body`, and the offending parameter."""
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"]]
    param = loc[0] if loc else None
    if first["type"] == "missing":
        return f"missing required parameter '{'.'.join(loc)}'", param
    if first["type"] == "model_type" and not loc:
        return "the request body must be a JSON object", None
    got = body.get(param) if isinstance(body, dict) and param else None
    if param in _HINTS:
        return f"'{param}' {_HINTS[param]} (got {_describe(got)})", param
    path = ".".join(p for p in loc if not any(c in p for c in "[]"))   # drop union branch names
    return f"'{path}': {first['msg'].lower()} (got {_describe(first.get('input'))})", param


def check_unicode(body: Any) -> None:
    """Reject strings that are not valid Unicode (JSON can smuggle lone UTF-16 surrogates in)."""
    stack = [body]
    while stack:                       # iterative: the body may be nested deeply
        v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError:
                raise bad_request(f"the request contains a string that is not valid Unicode (a lone surrogate): "
                                  f"{v[:40]!r}") from None
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, list):
            stack.extend(v)


def parse(model: type[BaseModel], body: Any) -> BaseModel:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    check_unicode(body)
    try:
        return model.model_validate(body)
    except ValidationError as e:
        msg, param = validation_message(e, body)
        raise bad_request(msg, param) from None


def wanted_logprobs(req, chat: bool) -> int | None:
    """The engine's SamplingParams.logprobs for this request (None: none asked for)."""
    if chat:
        return (req.top_logprobs or 0) if req.logprobs else None
    return req.logprobs


def check_common(req: _Request) -> None:
    """Reject known fields whose non-default values the engine cannot honour (never silently ignore)."""
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"'n' must be between 1 and {MAX_N}, got {req.n}", "n")
    if req.seed is not None and not 0 <= req.seed < SEED_LIMIT:
        raise bad_request(f"'seed' must be an integer in [0, 2^63), got {req.seed}", "seed")
    if req.top_k is not None and req.top_k > 2**31 - 1:
        raise bad_request(f"'top_k' must be at most 2^31 - 1 (0 or -1 disables it), got {req.top_k}", "top_k")
    if isinstance(req.stop, list) and len(req.stop) > MAX_STOP:
        raise bad_request(f"at most {MAX_STOP} stop strings are supported, got {len(req.stop)}", "stop")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(req, name) not in (None, 0, 0.0):
            raise bad_request(f"'{name}' is not supported yet (only 0)", name)
    if req.logit_bias:
        raise bad_request("'logit_bias' is not supported yet", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise bad_request("'stream_options' is only allowed together with \"stream\": true", "stream_options")


def check_completion(req: CompletionRequest) -> None:
    check_common(req)
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"'logprobs' must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", "logprobs")
    if req.best_of not in (None, 1) and req.best_of != req.n:
        raise bad_request("'best_of' is not supported (only best_of == n)", "best_of")
    if req.suffix:
        raise bad_request("'suffix' is not supported", "suffix")
    if isinstance(req.prompt, list):
        if not req.prompt:
            raise bad_request("'prompt' must not be empty", "prompt")
        if isinstance(req.prompt[0], (str, list)) and len(req.prompt) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(req.prompt)}", "prompt")


def check_chat(req: ChatRequest) -> None:
    check_common(req)
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("'top_logprobs' needs \"logprobs\": true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"'top_logprobs' must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}", "top_logprobs")
    if req.tools:
        raise bad_request("'tools' (function calling) is not supported", "tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request("'response_format' other than {\"type\": \"text\"} is not supported", "response_format")
    if not req.messages:
        raise bad_request("'messages' must contain at least one message", "messages")
    for i, m in enumerate(req.messages):
        if m.content is None:
            raise bad_request(f"messages[{i}] ({m.role!r}) has no 'content'; every message needs text content "
                              "(a string or a list of text parts)", "messages")
        if isinstance(m.content, list) and any(p.type != "text" or p.text is None for p in m.content):
            raise bad_request(f"messages[{i}]: only text content parts ({{\"type\": \"text\", \"text\": ...}}) "
                              "are supported", "messages")


def chat_messages(req: ChatRequest) -> list[dict]:
    """Messages as the tokenizer's chat template expects them (text parts joined)."""
    out = []
    for m in req.messages:
        content = m.content if not isinstance(m.content, list) else "".join(p.text or "" for p in m.content)
        out.append({"role": m.role, "content": content or ""})
    return out


# ---- responses -------------------------------------------------------------------------------------
@dataclass
class Choice:
    """One finished (or streamed-so-far) choice of a response."""

    index: int
    text: str = ""
    finish_reason: str | None = None
    num_prompt_tokens: int = 0
    num_generated_tokens: int = 0
    spec: SpecStats | None = None
    ssd_hits: int = 0                  # SSD: rounds served from the speculation cache
    logprobs: list | None = None       # TokenLogprob per generated token, when asked for
    text_offset: int = 0               # completions: where the generated text starts (after an echo)
    degraded_from: str | None = None   # set when a draft-worker failure had degraded the engine to AR


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def ssd_extension(mode: str, k: int | None, choices: list[Choice]) -> dict:
    """Per-response speculation metrics (the `ssd` object); rates are None where they do not apply.

    `mode` is the served (configured) mode. After a draft-worker failure the engine runs AR: the object
    then says `mode: "ar"` and `degraded_from: "ssd"` (the key is present only then)."""
    spec = SpecStats()
    for c in choices:
        if c.spec is not None:
            spec.merge(c.spec)
    generated = sum(c.num_generated_tokens for c in choices)
    acc, _, by_pos = spec_rates(spec, generated)
    decode_tokens = sum(max(c.num_generated_tokens - 1, 0) for c in choices)
    mal = decode_tokens / spec.rounds if acc is not None and spec.rounds else None
    degraded = next((c.degraded_from for c in choices if c.degraded_from), None)
    now = "ar" if degraded else mode
    out = {"mode": now, "k": k if now != "ar" else None, "acceptance_rate": acc, "mean_accepted_len": mal,
           "acceptance_by_position": by_pos, "cache_hit_rate": cache_hit_rate(mode, choices),
           "target_forwards": spec.rounds, "rounds_by_num_draft": list(spec.rounds_by_num_draft)}
    by_n = spec.rounds_by_num_draft
    # the share of this response's rounds that ran as plain target steps (auto's "AR" choice, speculate=false)
    out["plain_round_share"] = by_n[0] / sum(by_n) if by_n and sum(by_n) else None
    if degraded:
        out["degraded_from"] = degraded
    return out


def cache_hit_rate(mode: str, choices: list[Choice]) -> float | None:
    """SSD: rounds served from the speculation cache / rounds that could have been (every verification
    round but each request's first, which follows prefill and has nothing cached). None outside SSD and
    when no round could hit."""
    if mode != "ssd":
        return None
    hits = asked = 0
    for c in choices:
        rounds = c.spec.rounds if c.spec is not None else 0
        if rounds > 1:
            hits += c.ssd_hits
            asked += rounds - 1
    return hits / asked if asked else None


def logprobs_body(entries: list | None, token_text, chat: bool, text_offset: int = 0) -> dict | None:
    """OpenAI's logprobs object for TokenLogprob entries: chat {"content": [...]}, completions
    {"tokens", "token_logprobs", "top_logprobs", "text_offset"}. token_text(id) -> str."""
    if entries is None:
        return None
    if chat:
        def item(tok, lp):
            t = token_text(tok)
            return {"token": t, "logprob": _finite(lp), "bytes": list(t.encode("utf-8"))}
        return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries]}
    tokens = [token_text(e.token_id) for e in entries]
    offsets, pos = [], text_offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [_finite(e.logprob) for e in entries],
            "top_logprobs": [{token_text(t): _finite(lp) for t, lp in e.top} for e in entries],
            "text_offset": offsets}


def _finite(x: float) -> float:
    """JSON has no -inf: a token the warped distribution excludes is reported at -9999 (as OpenAI does)."""
    return x if x > -9999.0 else -9999.0


def completion_body(rid: str, model: str, choices: list[Choice], prompt_tokens: int, ssd: dict,
                    chat: bool, token_text=None) -> dict:
    if chat:
        items = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                  "logprobs": logprobs_body(c.logprobs, token_text, True), "finish_reason": c.finish_reason}
                 for c in choices]
    else:
        items = [{"index": c.index, "text": c.text,
                  "logprobs": logprobs_body(c.logprobs, token_text, False, c.text_offset),
                  "finish_reason": c.finish_reason} for c in choices]
    return {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": model, "choices": items, "system_fingerprint": None,
            "usage": usage(prompt_tokens, sum(c.num_generated_tokens for c in choices)), "ssd": ssd}


def chunk_body(rid: str, model: str, created: int, chat: bool, index: int | None, text: str | None = None,
               finish_reason: str | None = None, role: bool = False, logprobs: dict | None = None) -> dict:
    """One stream chunk with one choice delta (index None: a chunk without choices, for usage)."""
    choices = []
    if index is not None:
        if chat:
            delta: dict = {"role": "assistant", "content": ""} if role else {}
            if text:
                delta["content"] = text
            choices = [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]
        else:
            choices = [{"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}]
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": choices, "system_fingerprint": None}


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()

