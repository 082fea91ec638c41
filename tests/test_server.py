"""The OpenAI-compatible server, run for real (uvicorn on a free loopback port) on the tiny models and
driven by the official `openai` client and by raw HTTP."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ssd import LLM, SamplingParams
from ssd.server.app import BackgroundServer, build_app

PROMPTS = ["hello world", "abc", "def f(x):\n    return", "The quick brown fox"]
CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]
NO_EOS = {"ignore_eos": True}


def tiny_llm(tiny_pair, mode: str = "ar") -> LLM:
    target, draft = tiny_pair
    if mode == "sd":
        return LLM(str(target), mode="sd", draft=str(draft), k=3, dtype="float32", progress=False)
    return LLM(str(target), dtype="float32", progress=False)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)


def engine_state(srv: BackgroundServer) -> tuple[bool, int, int]:
    """(has unfinished requests, free target blocks, total target blocks), read on the engine thread."""
    def read(e):
        bm = e.target.block_manager
        return e.has_unfinished(), bm.num_free_blocks, bm.num_blocks
    return srv.app.state.engine.call(read).result(timeout=10)


def wait_idle(srv: BackgroundServer, timeout: float = 20.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    while True:
        busy, free, total = engine_state(srv)
        if not busy and free == total:
            return free, total
        assert time.monotonic() < deadline, f"engine still busy after {timeout}s: {free}/{total} blocks free"
        time.sleep(0.02)


def metric(srv: BackgroundServer, name: str, **labels) -> float:
    """A sample of the server's Prometheus registry (the exposition itself: test_metrics_exposition)."""
    value = srv.app.state.engine.metrics.registry.get_sample_value(name, labels)
    assert value is not None, (name, labels)
    return value


@pytest.fixture(scope="module")
def ref(tiny_pair):
    """A second engine for reference outputs (the served one belongs to the server's thread)."""
    return tiny_llm(tiny_pair)


@pytest.fixture(scope="module")
def server(tiny_pair):
    with BackgroundServer(build_app(tiny_llm(tiny_pair), served_name="tiny")) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    """One raw HTTP client (httpx.post builds a new client, with a new TLS context, every call: slow)."""
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)


# ---- the openai client -----------------------------------------------------------------------------
def test_models_and_health(server, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_completions_greedy_equal_generate(client, ref):
    for prompt in PROMPTS:
        want = ref.generate(prompt, greedy(12))[0]
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=0, extra_body=NO_EOS)
        assert r.choices[0].text == want.text
        assert r.choices[0].finish_reason == "length"
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), 12)
        assert r.model_extra["ssd"]["mode"] == "ar"


def test_batched_prompts_and_token_ids(client, ref):
    want = [o.text for o in ref.generate(PROMPTS[:2], greedy(6))]
    r = client.completions.create(model="tiny", prompt=PROMPTS[:2], max_tokens=6, temperature=0, extra_body=NO_EOS)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
    ids = ref.encode(PROMPTS[0])
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, extra_body=NO_EOS)
    assert r.choices[0].text == want[0] and r.usage.prompt_tokens == len(ids)


def test_chat_greedy_equals_llm_chat(client, ref):
    want = ref.chat(CHAT, greedy(10))[0]
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0, extra_body=NO_EOS)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == want.text
    assert r.usage.prompt_tokens == len(want.prompt_token_ids) and r.usage.completion_tokens == 10


def test_streaming_equals_non_streaming_with_usage(client, ref):
    want = ref.chat(CHAT, greedy(10))[0].text
    chunks = list(client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body=NO_EOS))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].model_extra["ssd"]["mode"] == "ar"

    want = ref.generate(PROMPTS[2], greedy(10))[0].text
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=10, temperature=0,
                                            stream=True, extra_body=NO_EOS))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length" and "ssd" in chunks[-1].model_extra


def test_stop_string(client, ref):
    text = ref.generate(PROMPTS[0], greedy(24))[0].text
    stop = next(ch for ch in text[3:] if ch.strip())
    r = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=24, temperature=0, stop=[stop],
                                  extra_body=NO_EOS)
    assert r.choices[0].text == text[:text.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_seed_reproducible_and_n(client, ref):
    def sample(**kw):
        return client.completions.create(model="tiny", prompt="hello", max_tokens=8, temperature=1.0,
                                         extra_body=NO_EOS, **kw)

    a, b = sample(seed=7), sample(seed=7)
    assert a.choices[0].text == b.choices[0].text
    want = [ref.generate("hello", SamplingParams(temperature=1.0, seed=s, max_tokens=8, ignore_eos=True))[0].text
            for s in (7, 8)]
    assert a.choices[0].text == want[0]
    both = sample(seed=7, n=2)
    assert [c.text for c in sorted(both.choices, key=lambda c: c.index)] == want
    assert both.usage.completion_tokens == 16 and both.usage.prompt_tokens == 5


def test_echo(client, ref):
    want = ref.generate("abc", greedy(4))[0].text
    r = client.completions.create(model="tiny", prompt="abc", max_tokens=4, temperature=0, echo=True,
                                  extra_body=NO_EOS)
    assert r.choices[0].text == "abc" + want


def test_openai_client_sees_400s(client):
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=10_000)
    with pytest.raises(openai.BadRequestError, match=r"'logprobs' must be in \[0, 20\]"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, logprobs=21)
    with pytest.raises(openai.BadRequestError, match="max_draft must be an integer >= 0"):
        client.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"max_draft": -1})
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="hi", max_tokens=2)


# ---- raw HTTP errors ----------------------------------------------------------------------------------
BAD = [
    (b"not json", 400, "not valid JSON"),
    (b"[1, 2]", 400, "JSON object"),
    (b"[" * 100_000 + b"]" * 100_000, 400, "not valid JSON"),
    (b'{"prompt": "' + b"a" * (2 << 20) + b'"}', 413, "larger than"),
    (json.dumps({"max_tokens": 2}).encode(), 400, "missing required parameter 'prompt'"),
    (json.dumps({"prompt": 5}).encode(), 400, "'prompt' must be"),
    (json.dumps({"prompt": "a", "max_tokens": "2"}).encode(), 400, "'max_tokens'"),
    (json.dumps({"prompt": "a", "max_tokens": 0}).encode(), 400, "max_tokens must be an integer >= 1"),
    (json.dumps({"prompt": "a", "temperature": True}).encode(), 400, "'temperature'"),
    (json.dumps({"prompt": "a", "temperature": -1}).encode(), 400, "temperature must be in"),
    (json.dumps({"prompt": "a", "n": 0}).encode(), 400, "'n' must be between"),
    (json.dumps({"prompt": "a", "seed": -1}).encode(), 400, "'seed'"),
    (json.dumps({"prompt": "a", "stop": [""]}).encode(), 400, "stop must be"),
    (json.dumps({"prompt": "", "max_tokens": 2}).encode(), 400, "prompt is empty"),
    (json.dumps({"prompt": [1, 2, 10_000], "max_tokens": 2}).encode(), 400, "outside the vocabulary"),
    (json.dumps({"prompt": "a" * 300}).encode(), 400, "maximum context length"),
    (json.dumps({"prompt": "a", "top_k": 2**70}).encode(), 400, "'top_k'"),
    (b'{"prompt": "\\ud800", "max_tokens": 2}', 400, "not valid Unicode"),
    (b'{"prompt": ["ok", "\\udc00"], "max_tokens": 2}', 400, "not valid Unicode"),
    (b'{"prompt": "ok", "\\udc00": 1}', 400, "not valid Unicode"),
    (json.dumps({"prompt": "a", "presence_penalty": 1.0}).encode(), 400, "not supported"),
    (json.dumps({"prompt": "a", "stream_options": {"include_usage": True}}).encode(), 400, "stream_options"),
]


@pytest.mark.parametrize("body,status,message", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_bad_completion_requests(http, body, status, message):
    r = http.post("/v1/completions", content=body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]


def test_bad_chat_requests(http):
    def post(body):
        return http.post("/v1/chat/completions", json=body)

    for body, message in [({"messages": "hi"}, "'messages' must be"),
                          ({"messages": []}, "at least one message"),
                          ({"messages": [{"content": "x"}]}, "'messages.0.role'"),
                          ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "only text"),
                          ({"messages": [{"role": "user"}]}, "messages[0] ('user') has no 'content'"),
                          ({"messages": [*CHAT, {"role": "assistant", "content": None}]}, "has no 'content'"),
                          ({"messages": CHAT, "top_logprobs": 2}, "needs \"logprobs\": true"),
                          ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "must be in [0, 20]"),
                          ({"messages": CHAT, "tools": [{"type": "function"}]}, "not supported")]:
        r = post(body)
        assert r.status_code == 400 and message in r.json()["error"]["message"], (body, r.text)
    r = http.post("/v1/chat/completions", content=b'{"messages": [{"role": "user", "content": "\\udc00"}]}')
    assert r.status_code == 400 and "not valid Unicode" in r.json()["error"]["message"]
    r = post({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "max_tokens": 2,
              "unknown_field": {"ignored": True}})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=10)     # lone surrogates included
JUNK = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | ANY_TEXT,
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                    max_leaves=8)
# max_tokens is either small and valid or never a valid int, so accepted requests stay short
TOKENS = st.integers(1, 3) | st.text(max_size=4) | st.floats() | st.integers(max_value=0) | st.booleans() | st.lists(
    st.integers(), max_size=2)
FIELDS = ["model", "temperature", "top_p", "top_k", "seed", "stop", "n", "stream", "stream_options", "logprobs",
          "echo", "presence_penalty", "logit_bias", "ignore_eos", "stop_token_ids", "best_of", "user", "suffix",
          "top_logprobs", "response_format", "tools", "speculate", "max_draft"]
SMALL_N = st.integers(1, 4) | JUNK
COMMON = {f: JUNK for f in FIELDS} | {"n": SMALL_N, "max_completion_tokens": TOKENS}
MESSAGE = st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "system", "assistant"]) | JUNK,
                                              "content": ANY_TEXT | JUNK})
COMPLETION = st.fixed_dictionaries({"max_tokens": TOKENS}, optional={
    "prompt": ANY_TEXT | st.lists(st.integers(-3, 200), max_size=4) | JUNK, **COMMON})
CHAT_BODY = st.fixed_dictionaries({"max_tokens": TOKENS}, optional={
    "messages": st.lists(MESSAGE, max_size=3) | JUNK, **COMMON})

# plausible bodies: mostly accepted, so the fuzz also streams and batches real generations
PLAUSIBLE = {"temperature": st.floats(-0.5, 2.5), "top_p": st.floats(0, 1.2), "top_k": st.integers(-2, 200),
             "seed": st.integers(-2, 2**64), "stop": st.text(max_size=2) | st.lists(st.text(max_size=3), max_size=3),
             "n": st.integers(0, 3), "stream": st.booleans(), "echo": st.booleans(), "ignore_eos": st.booleans(),
             "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
             "stop_token_ids": st.lists(st.integers(-1, 300), max_size=3)}
PLAUSIBLE_COMPLETION = st.fixed_dictionaries(
    {"prompt": st.text(max_size=12) | st.lists(st.integers(0, 127), min_size=1, max_size=4),
     "max_tokens": st.integers(1, 3)}, optional=PLAUSIBLE)
PLAUSIBLE_CHAT = st.fixed_dictionaries(
    {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant"]),
                                                 "content": st.text(max_size=12)}), min_size=1, max_size=3),
     "max_tokens": st.integers(1, 3)}, optional=PLAUSIBLE)


@settings(max_examples=100, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
       body=st.one_of(COMPLETION, CHAT_BODY, PLAUSIBLE_COMPLETION, PLAUSIBLE_CHAT,
                      st.binary(max_size=40).map(lambda b: ("raw", b))))
def test_fuzzed_bodies_get_4xx_never_5xx(http, route, body):
    content = body[1] if isinstance(body, tuple) else json.dumps(body).encode()
    r = http.post(route, content=content, headers={"content-type": "application/json"})
    assert r.status_code < 500, (content, r.text)
    if r.status_code >= 400:
        msg = r.json()["error"]["message"]
        assert isinstance(msg, str) and msg
    elif r.headers["content-type"].startswith("text/event-stream"):
        assert r.text.rstrip().endswith("data: [DONE]"), r.text


def test_server_keeps_serving_after_bad_requests(server, client):
    r = client.completions.create(model="tiny", prompt="ok", max_tokens=3, temperature=0, extra_body=NO_EOS)
    assert r.usage.completion_tokens == 3
    wait_idle(server)
    assert metric(server, "ssd_requests_total", status="error") == 0


# ---- concurrency, disconnects, metrics ---------------------------------------------------------------
def test_load_32_concurrent_streaming_clients(server, ref):
    prompts = [f"request {i}: {'xyz'[i % 3] * (i % 7)}" for i in range(32)]
    want = [o.text for o in ref.generate(prompts, greedy(5))]
    before = metric(server, "ssd_requests_total", status="success")

    async def one(aclient, prompt):
        stream = await aclient.completions.create(model="tiny", prompt=prompt, max_tokens=5, temperature=0,
                                                  stream=True, extra_body=NO_EOS)
        text, reason = "", None
        async for chunk in stream:
            text += chunk.choices[0].text
            reason = chunk.choices[0].finish_reason or reason
        return text, reason

    async def main():
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0,
                                      timeout=120) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in prompts))

    results = asyncio.run(main())
    assert [t for t, _ in results] == want
    assert all(reason == "length" for _, reason in results)
    free, total = wait_idle(server)
    assert free == total
    assert metric(server, "ssd_requests_total", status="success") == before + 32
    assert metric(server, "ssd_kv_blocks_free", model="target") == total
    assert metric(server, "ssd_requests_running") == 0 and metric(server, "ssd_requests_waiting") == 0


def test_disconnect_mid_stream_aborts_and_frees_blocks(server):
    wait_idle(server)
    aborted = metric(server, "ssd_engine_requests_finished_total", reason="abort")
    body = {"prompt": "a long answer", "max_tokens": 240, "temperature": 0, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=30) as c, c.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    # the connection is closed before the 240 tokens are done: the request must be aborted
    wait_idle(server)
    assert metric(server, "ssd_engine_requests_finished_total", reason="abort") == aborted + 1
    assert metric(server, "ssd_requests_total", status="aborted") >= 1


def test_disconnect_while_waiting_for_non_streaming_response(server):
    wait_idle(server)
    aborted = metric(server, "ssd_engine_requests_finished_total", reason="abort")
    body = {"prompt": "x", "max_tokens": 250, "temperature": 0, "ignore_eos": True, "n": 4}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.05))
    wait_idle(server)
    assert metric(server, "ssd_engine_requests_finished_total", reason="abort") == aborted + 4


def test_metrics_exposition(server, http):
    # a request of its own: the counters below must not depend on other tests having run first
    assert http.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}).status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in ["ssd_requests_total", "ssd_generation_tokens_total", "ssd_prompt_tokens_total",
                 "ssd_time_to_first_token_seconds_bucket", "ssd_inter_token_latency_seconds_bucket",
                 "ssd_requests_running", "ssd_requests_waiting", "ssd_kv_blocks_used", "ssd_kv_blocks_free",
                 "ssd_spec_drafts_total", "ssd_spec_draft_tokens_total", "ssd_spec_accepted_tokens_total",
                 "ssd_spec_cache_hits_total", "ssd_draft_worker_up", 'ssd_engine_info{k="",mode="ar"']:
        assert name in text, name
    assert metric(server, "ssd_generation_tokens_total") > 0
    assert metric(server, "ssd_time_to_first_token_seconds_count") > 0


# ---- speculative decoding through the server ----------------------------------------------------------
def test_sd_server_greedy_equals_generate(tiny_pair, ref):
    with BackgroundServer(build_app(tiny_llm(tiny_pair, "sd"))) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        name = client.models.list().data[0].id
        for prompt in PROMPTS[:3]:
            want = ref.generate(prompt, greedy(12))[0].text      # greedy SD == AR (exactness)
            r = client.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body=NO_EOS)
            assert r.choices[0].text == want
            ext = r.model_extra["ssd"]
            assert ext["mode"] == "sd" and ext["k"] == 3 and 0 <= ext["acceptance_rate"] <= 1
            assert ext["mean_accepted_len"] >= 1 and ext["cache_hit_rate"] is None
        want = ref.chat(CHAT, greedy(12))[0].text
        chunks = list(client.chat.completions.create(model=name, messages=CHAT, max_tokens=12, temperature=0,
                                                     stream=True, extra_body=NO_EOS))
        assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
        wait_idle(srv)
        assert metric(srv, "ssd_spec_draft_tokens_total") > 0
        assert metric(srv, "ssd_spec_drafts_total") > 0
        assert metric(srv, "ssd_spec_draft_tokens_by_position_total", position="0") > 0
        assert metric(srv, "ssd_kv_blocks_free", model="draft") == metric(srv, "ssd_kv_blocks_total", model="draft")


def test_ssd_server_greedy_equals_generate_and_reports_the_cache(tiny_pair, ref):
    import os
    import signal

    target, draft = tiny_pair
    llm = LLM(str(target), draft=str(draft), mode="ssd", k=3, dtype="float32", progress=False, kv_cache_gb=0.05,
              worker_timeout_s=20)
    try:
        with BackgroundServer(build_app(llm)) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
            name = client.models.list().data[0].id
            assert metric(srv, "ssd_draft_worker_up") == 1
            assert metric(srv, "ssd_draft_worker_failures_total") == 0
            for prompt in PROMPTS[:3]:
                want = ref.generate(prompt, greedy(16))[0].text      # greedy SSD == AR (exactness)
                r = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0,
                                              extra_body=NO_EOS)
                assert r.choices[0].text == want
                ext = r.model_extra["ssd"]
                assert ext["mode"] == "ssd" and ext["k"] == 3 and "degraded_from" not in ext
                assert isinstance(ext["cache_hit_rate"], float) and 0 <= ext["cache_hit_rate"] <= 1
                assert ext["target_forwards"] > 1
            want = ref.chat(CHAT, greedy(12))[0].text
            chunks = list(client.chat.completions.create(model=name, messages=CHAT, max_tokens=12, temperature=0,
                                                         stream=True, extra_body=NO_EOS))
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
            assert chunks[-1].model_extra["ssd"]["mode"] == "ssd"
            wait_idle(srv)
            text = httpx.get(srv.url + "/metrics").text
            assert "ssd_draft_worker_up 1.0" in text and 'ssd_engine_info{k="3",mode="ssd"' in text
            assert metric(srv, "ssd_draft_workers_up") == 1
            stats = llm.engine.spec_metrics()
            k_labels = range(len(stats.hits_by_k))
            assert sum(metric(srv, "ssd_spec_cache_hits_total", k=str(j)) for j in k_labels) == stats.hits
            assert sum(metric(srv, "ssd_spec_cache_misses_total", k=str(j)) for j in k_labels) == stats.misses
            assert stats.hits + stats.misses > 0

            os.kill(llm._client.pid, signal.SIGKILL)          # the draft worker dies: the engine goes on in AR
            want = ref.generate(PROMPTS[0], greedy(8))[0].text
            r = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                          extra_body=NO_EOS)
            assert r.choices[0].text == want
            ext = r.model_extra["ssd"]
            assert ext["mode"] == "ar" and ext["degraded_from"] == "ssd"
            wait_idle(srv)
            assert llm.engine.degraded_from == "ssd"
            assert metric(srv, "ssd_draft_worker_up") == 0 and metric(srv, "ssd_draft_workers_up") == 0
            assert metric(srv, "ssd_draft_worker_failures_total") == 1
            assert metric(srv, "ssd_spec_seqs_moved_total", to="local") == 1     # the request in flight
            assert metric(srv, "ssd_spec_seqs_moved_total", to="worker") == 0
    finally:
        llm.close()


# ---- API key ------------------------------------------------------------------------------------------
def test_api_key(tiny_pair):
    with BackgroundServer(build_app(tiny_llm(tiny_pair), served_name="tiny", api_key="s3cret")) as srv:
        assert httpx.get(srv.url + "/health").status_code == 200           # health needs no key
        http = httpx.Client(base_url=srv.url, timeout=30)
        for headers in [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}]:
            for method, path in [("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/metrics")]:
                r = http.request(method, path, headers=headers, json={"prompt": "a"})
                assert r.status_code == 401, (headers, path)
                assert r.json()["error"]["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=srv.url + "/v1", api_key="s3cret", max_retries=0, timeout=60)
        r = good.completions.create(model="tiny", prompt="a", max_tokens=2, extra_body=NO_EOS)
        assert r.usage.completion_tokens == 2
        http.close()


# ---- UTF-8: multi-byte characters split across byte tokens -------------------------------------------
def make_byte_tokenizer(path):
    """A byte-level tokenizer (one token per byte, ids 3..258): characters span several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(alphabet)}}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.save_pretrained(str(path))
    cfg_file = path / "tokenizer_config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["tokenizer_class"] = "TokenizersBackend"
    cfg_file.write_text(json.dumps(cfg))


def test_streaming_utf8_split_across_tokens(tmp_path):
    from conftest import make_tiny_hf

    make_tiny_hf("qwen2", tmp_path, seed=3, vocab=260)
    make_byte_tokenizer(tmp_path)
    ref_llm = LLM(str(tmp_path), dtype="float32", progress=False)
    prompt = "héllo wörld ✓"
    assert len(ref_llm.encode(prompt)) > len(prompt)          # multi-byte characters span tokens
    want = [ref_llm.generate(prompt, SamplingParams(temperature=1.5, seed=11 + i, max_tokens=32, ignore_eos=True))[0]
            for i in range(6)]
    assert any(ord(c) > 127 and c != "\ufffd" for w in want for c in w.text)   # the case under test occurs
    with BackgroundServer(build_app(LLM(str(tmp_path), dtype="float32", progress=False), served_name="b")) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        texts = [""] * 6
        for chunk in client.completions.create(model="b", prompt=prompt, max_tokens=32, temperature=1.5, seed=11,
                                               n=6, stream=True, extra_body=NO_EOS):
            texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [w.text for w in want]


def test_a_failed_step_fails_only_the_requests_it_ran(tiny_pair):
    """A request that arrives while a step fails is served normally afterwards."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    llm = tiny_llm(tiny_pair)
    real = llm.engine.step
    armed, entered, release = [False], threading.Event(), threading.Event()

    def step():
        if armed[0] and llm.engine.scheduler.running:     # fail a step that runs request a
            armed[0] = False
            entered.set()
            release.wait(10)
            raise RuntimeError("injected failure")
        return real()

    llm.engine.step = step
    with BackgroundServer(build_app(llm, served_name="tiny")) as srv, \
            httpx.Client(base_url=srv.url, timeout=30) as c, ThreadPoolExecutor(2) as ex:
        armed[0] = True
        fa = ex.submit(c.post, "/v1/completions", json={"prompt": "hello", "max_tokens": 20, **NO_EOS})
        assert entered.wait(10)
        fb = ex.submit(c.post, "/v1/completions", json={"prompt": "abc", "max_tokens": 4, "temperature": 0})
        time.sleep(0.5)                 # b's request is queued behind the failing step
        release.set()
        ra, rb = fa.result(30), fb.result(30)
        assert ra.status_code >= 500 and "injected failure" in ra.text
        assert rb.status_code == 200, rb.text
        assert rb.json()["usage"]["completion_tokens"] == 4


def test_ssd_server_under_a_small_kv_cache_stays_ssd(tiny_pair, ref):
    """Concurrent requests through the official client with a target KV cache so small that the scheduler
    preempts: every answer equals AR, every response was served in SSD, and the draft worker (a real
    process) never reports itself dead: `ssd_draft_worker_up` stays 1."""
    from concurrent.futures import ThreadPoolExecutor

    target, draft = tiny_pair
    prompts = ["hello world " * 3, "abc abc abc", "x y z w", "the quick brown fox"]
    llm = LLM(str(target), draft=str(draft), mode="ssd", k=3, dtype="float32", progress=False, kv_cache_gb=0.0001,
              worker_timeout_s=20)
    try:
        assert llm.engine.target.block_manager.num_blocks < 16
        with BackgroundServer(build_app(llm)) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=120)
            name = client.models.list().data[0].id

            def ask(prompt):
                return client.completions.create(model=name, prompt=prompt, max_tokens=40, temperature=0,
                                                 extra_body=NO_EOS)

            with ThreadPoolExecutor(len(prompts)) as pool:
                answers = list(pool.map(ask, prompts))
            for prompt, r in zip(prompts, answers):
                assert r.choices[0].text == ref.generate(prompt, greedy(40))[0].text
                assert r.model_extra["ssd"]["mode"] == "ssd" and "degraded_from" not in r.model_extra["ssd"]
            wait_idle(srv)
            assert metric(srv, "ssd_preemptions_total") > 0
            assert metric(srv, "ssd_draft_worker_up") == 1 and llm.engine.degraded_from is None
            assert sum(metric(srv, "ssd_spec_cache_hits_total", k=str(j)) for j in range(4)) + \
                sum(metric(srv, "ssd_spec_cache_misses_total", k=str(j)) for j in range(4)) > 0
    finally:
        llm.close()


def test_auto_server_explains_its_choices(tiny_pair, ref):
    """mode auto: greedy answers equal AR, the `ssd` object has the plain-round share, and the
    Prometheus auto metrics agree with the engine's counters (rows by chosen draft length, plain
    rounds, predicted vs measured tokens/s)."""
    target, draft = tiny_pair
    llm = LLM(str(target), draft=str(draft), mode="auto", k=3, dtype="float32", progress=False, kv_cache_gb=0.05)
    with BackgroundServer(build_app(llm)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        name = client.models.list().data[0].id
        for prompt in PROMPTS[:3]:
            r = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0, extra_body=NO_EOS)
            assert r.choices[0].text == ref.generate(prompt, greedy(16))[0].text
            ext = r.model_extra["ssd"]
            by_n = ext["rounds_by_num_draft"]
            assert ext["mode"] == "auto" and sum(by_n) == ext["target_forwards"]
            assert ext["plain_round_share"] == pytest.approx(by_n[0] / sum(by_n))
        wait_idle(srv)
        stats = llm.engine.spec_metrics()
        d = stats.to_dict()
        assert metric(srv, "ssd_auto_plain_rounds_total") == stats.plain_rounds
        chooser = llm.engine.step_impl.chooser
        assert metric(srv, "ssd_auto_probes_total") == stats.probes == chooser.probes
        assert metric(srv, "ssd_auto_probes_skipped_total") == stats.probes_skipped == chooser.probes_skipped
        assert d["auto_probes"] == stats.probes and d["auto_probes_skipped"] == stats.probes_skipped
        assert sum(metric(srv, "ssd_auto_rows_total", num_draft=str(j)) for j in range(4)) == sum(stats.rows_by_num_draft)
        assert metric(srv, "ssd_auto_predicted_tokens_per_second") == pytest.approx(d["auto_predicted_tokens_per_s"])
        assert metric(srv, "ssd_auto_measured_tokens_per_second") == pytest.approx(d["auto_measured_tokens_per_s"])
        for name in ("ssd_auto_worker_rounds_total", "ssd_auto_regime_switches_total", "ssd_draft_worker_lost_total"):
            assert metric(srv, name) == 0                     # no draft worker without auto_ssd


def test_auto_ssd_server_counts_worker_rounds_switches_and_a_lost_worker(monkeypatch, tiny_pair, ref):
    """auto_ssd (regimes chosen at random): the Prometheus counters of SSD rounds, regime switches
    and lost workers agree with the engine's, before and after the worker is killed."""
    import os
    import signal

    from ssd_local import random_regime

    random_regime(monkeypatch)
    target, draft = tiny_pair
    llm = LLM(str(target), draft=str(draft), mode="auto", auto_ssd=True, k=3, dtype="float32", progress=False,
              kv_cache_gb=0.05, worker_timeout_s=10)
    names = {"ssd_auto_worker_rounds_total": "worker_rounds", "ssd_auto_regime_switches_total": "regime_switches",
             "ssd_draft_worker_lost_total": "worker_lost", "ssd_auto_regime_probes_pruned_total": "regime_probes_pruned",
             "ssd_auto_regime_visits_deferred_total": "regime_visits_deferred",
             "ssd_auto_regime_early_probes_total": "regime_early_probes", "ssd_auto_thread_slowdown": "thread_slowdown",
             "ssd_auto_regime_restated_total": "regime_restated",
             "ssd_auto_worker_kept_in_step_tokens_total": "worker_kept_in_step",
             "ssd_auto_worker_idle_prefills_skipped_total": "worker_idle_prefills_skipped"}
    try:
        with BackgroundServer(build_app(llm)) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
            name = client.models.list().data[0].id

            def ask(prompt):
                r = client.completions.create(model=name, prompt=prompt, max_tokens=16, temperature=0,
                                              extra_body=NO_EOS)
                assert r.choices[0].text == ref.generate(prompt, greedy(16))[0].text
            for prompt in PROMPTS[:2]:
                ask(prompt)
            wait_idle(srv)
            m = llm.engine.spec_metrics()
            assert m.worker_rounds > 0 and m.regime_switches > 0 and m.worker_lost == 0
            assert {k: metric(srv, k) for k in names} == {k: getattr(m, v) or 0 for k, v in names.items()}
            os.kill(llm._client.pid, signal.SIGKILL)
            ask(PROMPTS[2])
            wait_idle(srv)
            m = llm.engine.spec_metrics()
            assert m.worker_lost == 1
            assert {k: metric(srv, k) for k in names} == {k: getattr(m, v) or 0 for k, v in names.items()}
    finally:
        llm.close()
