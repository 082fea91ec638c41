"""Token logprobs and per-request speculation control: identical logprobs in AR, SD and SSD for the
same greedy request; sampled logprobs equal the target's warped distribution (teacher-forced through
transformers); truncation at stops; speculate=false / max_draft for one request while its batch mates
speculate; the OpenAI routes through the official client."""
from __future__ import annotations

import math

import openai
import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.server.app import BackgroundServer, build_app

from ssd_local import local_ssd

PROMPTS = ["hello world", "def f(x):\n    return", "abc"]


def greedy(n=12, **kw):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def ar(tiny_pair):
    return LLM(str(tiny_pair[0]), dtype="float32", progress=False)


def _close(a, b, tol=1e-4):
    """Same tokens, logprobs within tol, and the same top alternatives' values (ids may swap on ties)."""
    assert [x.token_id for x in a] == [x.token_id for x in b]
    for x, y in zip(a, b):
        assert abs(x.logprob - y.logprob) < tol and len(x.top) == len(y.top)
        assert all(abs(u - v) < tol for (_, u), (_, v) in zip(x.top, y.top))


def test_greedy_logprobs_are_the_same_in_every_mode(monkeypatch, tiny_pair, ar):
    p = greedy(logprobs=3)
    ref = ar.generate(PROMPTS, p)
    for o in ref:
        assert len(o.logprobs) == len(o.token_ids) == 12
        for e, t in zip(o.logprobs, o.token_ids):
            assert e.token_id == t and e.top[0][0] == t and e.top[0][1] == pytest.approx(e.logprob)  # argmax
            assert len(e.top) == 3 and e.top[0][1] >= e.top[1][1] >= e.top[2][1]
            assert e.logprob < 0
    sd = LLM(str(tiny_pair[0]), draft=str(tiny_pair[1]), mode="sd", k=3, dtype="float32", progress=False)
    ssd, _ = local_ssd(monkeypatch, tiny_pair[0], tiny_pair[0], k=3)
    for llm in (sd, ssd):
        outs = llm.generate(PROMPTS, p)
        assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
        for o, r in zip(outs, ref):
            _close(o.logprobs, r.logprobs)
    assert ssd.engine.spec_metrics().hits > 0          # hits, misses and AR rows all gave the same values
    chunks = list(sd.stream(PROMPTS[0], p))            # streamed: per chunk, adding up to the whole
    _close([e for c in chunks for e in c.logprobs], ref[0].logprobs)
    assert ar.generate(PROMPTS[0], greedy())[0].logprobs is None      # not asked: none


def test_sampled_logprobs_are_the_warped_target_distribution(tiny_pair):
    """SD at temperature 0.8 with top-k: each committed token's logprob is log p_warped(token | prefix),
    checked by scoring the same tokens with transformers; filtered tokens never appear among the top."""
    from transformers import AutoModelForCausalLM

    from ssd.layers.sampler import logits_to_probs

    sd = LLM(str(tiny_pair[0]), draft=str(tiny_pair[1]), mode="sd", k=3, dtype="float32", progress=False)
    p = SamplingParams(temperature=0.8, top_k=5, top_p=0.9, seed=7, max_tokens=16, ignore_eos=True, logprobs=6)
    out = sd.generate(PROMPTS[0], p)[0]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_pair[0]), dtype=torch.float32).eval()
    ids = out.prompt_token_ids + out.token_ids
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, len(out.prompt_token_ids) - 1:-1]
    n = logits.shape[0]
    want = torch.log(logits_to_probs(logits, torch.full((n,), 0.8), torch.full((n,), 5), torch.full((n,), 0.9)))
    for j, e in enumerate(out.logprobs):
        assert e.logprob == pytest.approx(float(want[j, e.token_id]), abs=1e-4)
        finite = [lp for _, lp in e.top if lp > -math.inf]
        assert 1 <= len(finite) <= 5                  # top-k 5 (and top-p): the rest are -inf
        assert sum(math.exp(lp) for lp in finite) == pytest.approx(1.0, abs=1e-4)


def test_logprobs_stop_with_the_tokens(ar):
    full = ar.generate(PROMPTS[0], greedy(12))[0]
    stop = full.text[3:5]
    out = ar.generate(PROMPTS[0], greedy(12, logprobs=0, stop=[stop]))[0]
    assert out.finish_reason == "stop" and len(out.logprobs) == len(out.token_ids) < 12
    assert all(e.top == () for e in out.logprobs)      # logprobs=0: the chosen token only


def test_speculation_off_or_capped_for_one_request_while_its_mates_speculate(tiny_pair, ar):
    sd = LLM(str(tiny_pair[0]), draft=str(tiny_pair[0]), mode="sd", k=4, dtype="float32", progress=False)
    params = [greedy(16, speculate=False), greedy(16, max_draft=1), greedy(16)]
    outs = sd.generate(PROMPTS, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ar.generate(PROMPTS, greedy(16))]
    off, capped, full = (o.spec for o in outs)
    assert off.draft_tokens == 0 and off.rounds == 15 and off.rounds_by_num_draft == [15]
    assert len(capped.rounds_by_num_draft) == 2 and capped.rounds_by_num_draft[1] > 0     # never more than 1
    assert len(full.rounds_by_num_draft) == 5 and full.accepted_tokens > 0                # self-draft: K = 4
    with pytest.raises(ValueError, match="max_draft"):
        SamplingParams(max_draft=-1)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)


def test_openai_routes_return_the_engines_logprobs(tiny_pair, ar):
    want = ar.generate(PROMPTS[0], greedy(8, logprobs=2))[0]
    sd = LLM(str(tiny_pair[0]), draft=str(tiny_pair[1]), mode="sd", k=3, dtype="float32", progress=False)
    with BackgroundServer(build_app(sd)) as srv:
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=60)
        name = client.models.list().data[0].id
        r = client.completions.create(model=name, prompt=PROMPTS[0], max_tokens=8, temperature=0, logprobs=2,
                                      extra_body={"ignore_eos": True})
        lp = r.choices[0].logprobs
        assert [t for t in lp.tokens] == [sd.tokenizer.decode([e.token_id]) for e in want.logprobs]
        assert lp.token_logprobs == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
        assert all(len(d) == 2 for d in lp.top_logprobs) and lp.text_offset[0] == 0
        assert "".join(lp.tokens) == r.choices[0].text
        c = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=6,
                                           temperature=0, logprobs=True, top_logprobs=3,
                                           extra_body={"ignore_eos": True})
        content = c.choices[0].logprobs.content
        assert len(content) == c.usage.completion_tokens == 6
        assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].logprob >= e.logprob - 1e-6 for e in content)
        stream = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                                                stream=True, extra_body={"ignore_eos": True})
        streamed = [e for ch in stream for e in ((ch.choices[0].logprobs.content or []) if ch.choices and
                                                 ch.choices[0].logprobs else [])]
        assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-5)
        r = client.completions.create(model=name, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                      extra_body={"ignore_eos": True, "speculate": False})
        assert r.model_extra["ssd"]["rounds_by_num_draft"] == [5]      # every round a plain target step
