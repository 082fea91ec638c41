"""End-to-end engine behaviour on tiny random models with a real (char-level) tokenizer."""
from __future__ import annotations

import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.engine.engine import PromptTooLongError

from conftest import make_char_tokenizer, make_tiny_hf

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
PROMPTS = ["hello world", "abc", "def f(x):\n    return", "z" * 37, "The quick brown fox"]


@pytest.fixture(scope="module")
def ar(tiny_pair):
    return LLM(str(tiny_pair[0]), dtype="float32", progress=False)


@pytest.fixture(scope="module")
def ar_outputs(ar):
    return [o.token_ids for o in ar.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_greedy_equals_transformers_generate(kind, tmp_path):
    hf = make_tiny_hf(kind, tmp_path)
    make_char_tokenizer(tmp_path)
    llm = LLM(str(tmp_path), dtype="float32", progress=False)
    for prompt in PROMPTS[:3]:
        ids = llm.encode(prompt)
        ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                          max_new_tokens=24, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(ids):].tolist()
        assert llm.generate(ids, GREEDY)[0].token_ids == ref


def test_batched_mixed_lengths_equal_one_at_a_time(ar, ar_outputs):
    singles = [ar.generate(p, GREEDY)[0].token_ids for p in PROMPTS]
    assert singles == ar_outputs


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("draft", ["other", "self"])
def test_sd_greedy_equals_ar(tiny_pair, ar_outputs, k, draft):
    target, other = tiny_pair
    sd = LLM(str(target), mode="sd", draft=str(other if draft == "other" else target), k=k, dtype="float32",
             progress=False)
    outs = sd.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ar_outputs
    rate = sd.last_stats["acceptance_rate"]
    assert (rate == 1.0) if draft == "self" else (rate < 0.5)


def test_sd_with_int8_draft_equals_ar(tiny_pair, ar_outputs):
    """The draft's numerics (int8 here) change acceptance, never the tokens."""
    target, _ = tiny_pair
    sd = LLM(str(target), mode="sd", draft=str(target), k=3, dtype="float32", draft_dtype="int8", progress=False)
    assert sd.draft_dtype == "int8"
    assert [o.token_ids for o in sd.generate(PROMPTS, GREEDY)] == ar_outputs
    assert 0.5 < sd.last_stats["acceptance_rate"] <= 1.0


def test_sd_spec_max_batch_decodes_big_batches_autoregressively(tiny_pair, ar_outputs):
    target, _ = tiny_pair
    sd = LLM(str(target), mode="sd", draft=str(target), k=3, dtype="float32", spec_max_batch=2, progress=False)
    outs = sd.generate(PROMPTS, GREEDY)                        # 5 sequences > 2: plain decode rounds
    assert [o.token_ids for o in outs] == ar_outputs
    assert all(o.metrics.target_forwards == GREEDY.max_tokens - 1 for o in outs)   # one token per forward
    one = sd.generate(PROMPTS[:2], GREEDY)                     # 2 <= 2: speculates (self-draft: all accepted)
    assert [o.token_ids for o in one] == ar_outputs[:2]
    assert all(o.metrics.target_forwards < GREEDY.max_tokens // 2 for o in one)
    with pytest.raises(ValueError, match="modes 'sd' and 'ssd'"):
        LLM(str(target), spec_max_batch=2, dtype="float32", progress=False)


def test_prefill_threads_apply_to_prefill_only(tiny_pair, monkeypatch):
    before = torch.get_num_threads()
    llm = LLM(str(tiny_pair[0]), dtype="float32", threads=1, prefill_threads=2, progress=False)
    seen = []
    for step in (llm.engine.step_impl.prefill, llm.engine.step_impl.decode):
        def spy(seqs, _step=step, _name=step.__name__):
            seen.append((_name, torch.get_num_threads()))
            return _step(seqs)
        monkeypatch.setattr(llm.engine.step_impl, step.__name__, spy)
    try:
        llm.generate("hello", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
        assert ("prefill", 2) in seen and ("decode", 1) in seen and ("decode", 2) not in seen
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_seed_reproducible_regardless_of_batch_mates(ar):
    p = SamplingParams(temperature=1.0, seed=1234, max_tokens=16, ignore_eos=True)
    alone = ar.generate("hello", p)[0].token_ids
    mates = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True) for s in (1, 2)]
    batched = ar.generate(["xyz", "hello", "abcdef"], [mates[0], p, mates[1]])
    assert batched[1].token_ids == alone
    other = ar.generate("hello", SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True))
    assert other[0].token_ids != alone


def test_seed_reproducible_in_sd(tiny_pair):
    target, draft = tiny_pair
    sd = LLM(str(target), mode="sd", draft=str(draft), k=3, dtype="float32", progress=False)
    p = SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True)
    a = sd.generate(["hello", "abc"], p)
    b = sd.generate(["abc", "hello"], p)
    assert a[0].token_ids == b[1].token_ids and a[1].token_ids == b[0].token_ids


def test_stop_conditions(ar, ar_outputs):
    full = ar.generate(PROMPTS[0], GREEDY)[0]
    # stop token id: the 5th generated token
    stop_id = full.token_ids[4]
    first = full.token_ids.index(stop_id)
    out = ar.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_id]))[0]
    assert out.finish_reason == "stop" and out.token_ids == full.token_ids[:first + 1]
    # stop string: cut the text before it
    stop = full.text[6:8]
    out = ar.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=24, stop=[stop], ignore_eos=True))[0]
    assert out.finish_reason == "stop" and stop not in out.text and full.text.startswith(out.text)
    assert len(out.text) == full.text.find(stop)
    out = ar.generate(PROMPTS[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert out.finish_reason == "length" and out.token_ids == full.token_ids[:3]


def test_stream_yields_deltas_that_add_up(ar):
    full = ar.generate(PROMPTS[2], GREEDY)[0]
    chunks = list(ar.stream(PROMPTS[2], GREEDY))
    assert "".join(c.text for c in chunks) == full.text
    assert [t for c in chunks for t in c.token_ids] == full.token_ids
    assert chunks[-1].finished and chunks[-1].output.token_ids == full.token_ids


def test_stream_close_frees_blocks(ar):
    bm = ar.engine.target.block_manager
    free = bm.num_free_blocks
    it = ar.stream("hello there", SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    next(it)
    next(it)
    it.close()
    assert bm.num_free_blocks == free and not ar.engine.has_unfinished()


def test_prefix_cache_reuses_blocks_and_keeps_output(ar):
    prompt = "a long shared system prompt that spans several blocks of sixteen tokens: "
    p = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    first = ar.generate(prompt + "one", p)[0]
    bm = ar.engine.target.block_manager
    hits = bm.stats()
    again = ar.generate(prompt + "one", p)[0]
    assert again.token_ids == first.token_ids
    assert bm.stats() != hits  # the second prefill found cached blocks


def test_preemption_keeps_outputs_exact(tiny_pair, ar_outputs):
    # a KV cache so small that the five requests cannot all run at once
    small = LLM(str(tiny_pair[0]), dtype="float32", progress=False, kv_cache_gb=96 * 2 * 2 * 2 * 16 * 4 / 2**30,
                block_size=4)
    outs = small.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ar_outputs
    assert small.engine.scheduler.num_preemptions > 0
    bm = small.engine.target.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_kv_cache_sized_in_tokens(tiny_pair, ar_outputs):
    """kv_cache_tokens (llama.cpp's context size) sets the target's KV slots, in whole blocks; a
    request that cannot fit names both settings; bad values are refused."""
    lm = LLM(str(tiny_pair[0]), dtype="float32", progress=False, kv_cache_tokens=100)
    assert lm.engine.target.block_manager.num_blocks == 7                  # ceil(100 / 16)
    assert [o.token_ids for o in lm.generate(PROMPTS, GREEDY)] == ar_outputs
    with pytest.raises(PromptTooLongError, match="kv_cache_tokens"):
        lm.generate("x" * 100, GREEDY)
    for bad in (0, -5, 1.5, True):
        with pytest.raises(ValueError, match="kv_cache_tokens must be"):
            LLM(str(tiny_pair[0]), dtype="float32", progress=False, kv_cache_tokens=bad)


def test_chat_template(ar):
    out = ar.chat([{"role": "user", "content": "hi"}], GREEDY)[0]
    assert ar.encode_chat([{"role": "user", "content": "hi"}]) == ar.encode("u:hi\na:")
    assert len(out.token_ids) == 24


def test_bad_inputs_have_clear_errors(ar, tiny_pair, tmp_path):
    with pytest.raises(PromptTooLongError, match="max_model_len"):
        ar.generate("x" * 5000, GREEDY)
    with pytest.raises(ValueError, match="temperature must be in"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p must be in"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="max_tokens must be an integer >= 1"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError, match="needs a draft model"):
        LLM(str(tiny_pair[0]), mode="sd", progress=False)
    with pytest.raises(ValueError, match="unknown mode"):
        LLM(str(tiny_pair[0]), mode="fast", progress=False)
    with pytest.raises(ValueError, match="empty"):
        ar.generate([[]], GREEDY)
    assert not ar.engine.has_unfinished()


def test_vocab_mismatch_is_refused(tiny_pair, tmp_path):
    from transformers import AutoTokenizer

    from ssd.speculation.compat import VocabMismatchError

    make_tiny_hf("qwen2", tmp_path, seed=3)
    tok = make_char_tokenizer(tmp_path)
    tok.add_tokens(["<extra>"])
    tok.save_pretrained(str(tmp_path))
    assert len(AutoTokenizer.from_pretrained(str(tmp_path))) > len(AutoTokenizer.from_pretrained(str(tiny_pair[0])))
    with pytest.raises(VocabMismatchError, match="tokenizers differ"):
        LLM(str(tiny_pair[0]), mode="sd", draft=str(tmp_path), progress=False)


def test_sd_spec_max_batch_catches_up_when_the_batch_shrinks(tiny_pair):
    """3 sequences > spec_max_batch=2 decode one token per round (the draft is not fed); once the
    short one finishes the other two speculate again: the draft first feeds the tokens it missed.
    (Before the fix: RuntimeError 'no KV room reserved' on the first speculative round.)"""
    target, draft = tiny_pair
    prompts = ["hello world", "abc abc", "x y z"]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 30, 30)]
    ref = [o.token_ids for o in LLM(str(target), dtype="float32", progress=False).generate(prompts, params)]
    sd = LLM(str(target), mode="sd", draft=str(draft), k=3, dtype="float32", spec_max_batch=2, progress=False)
    outs = sd.generate(prompts, params)
    assert [o.token_ids for o in outs] == ref
    assert outs[1].metrics.target_forwards < 29           # it speculated after the batch shrank
    bm = sd.engine.draft.block_manager
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("eager", [True, False, "stale"])
def test_auto_prefills_its_draft_when_a_batch_this_size_would_speculate(tiny_pair, ar_outputs, monkeypatch, eager):
    """auto asks the chooser at prefill time: a batch that would draft gets its in-process draft
    prefilled with the prompt (as in SD: nothing to catch up in decode), one that would not stays lazy
    (the prompt is caught up the first time it drafts); where the chooser has not drafted for long
    (stale), one request of the batch, the one with the shortest prompt, gets its draft prefilled, for
    the stale probe to measure with. Same tokens as AR every way."""
    from ssd.speculation.chooser import STALE_ROUNDS, Chooser

    llm = LLM(str(tiny_pair[0]), draft=str(tiny_pair[0]), mode="auto", k=3, dtype="float32", progress=False)
    asked, behind = [], []
    monkeypatch.setattr(Chooser, "would_speculate", lambda self, rows: asked.append(rows) or eager is True)
    sizes = []       # the requests' sizes the prefill gate is given (prefill_pays is tested in test_chooser)
    monkeypatch.setattr(Chooser, "paid_prefills",
                        lambda self, rows, feed, remaining: sizes.append((feed, remaining)) or len(feed))
    if eager == "stale":
        llm.engine.step_impl.chooser.rounds = STALE_ROUNDS + 1
    real_plan = Chooser.plan

    def plan(self, seq_ids, caps, behind_now=None, remaining=None):
        behind.append(list(behind_now))
        return real_plan(self, seq_ids, caps, behind_now, remaining)
    monkeypatch.setattr(Chooser, "plan", plan)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ar_outputs
    assert asked and asked[0] == len(PROMPTS)          # the whole batch the prefill joins
    prompt_lens = [len(llm.encode(p)) for p in PROMPTS]
    assert sizes == []      # no worker apart: the prefill gate is not applied (only auto_ssd, >= 3 rows)
    if eager == "stale":
        shortest = prompt_lens.index(min(prompt_lens))
        assert behind[0] == [0 if b == shortest else n for b, n in enumerate(prompt_lens)]
        assert llm.engine.spec_metrics().eager_draft_prefills == 1
    else:
        assert behind[0] == ([0] * len(PROMPTS) if eager else prompt_lens)
        assert llm.engine.spec_metrics().eager_draft_prefills == (len(PROMPTS) if eager else 0)
    dbm = llm.engine.draft.block_manager
    assert dbm.num_free_blocks == dbm.num_blocks


def test_auto_switches_between_plain_and_draft_rounds_without_leaking_draft_kv(tiny_pair, ar_outputs, monkeypatch):
    """mode="auto" with a chooser that runs 6 plain rounds, then drafts, then plain again: the draft
    (never prefilled in auto) catches up on the prompt and the plain rounds' tokens the first time it
    drafts, output equals AR, and plain rounds give back the draft slots the scheduler reserved."""
    from ssd.speculation.chooser import Chooser

    llm = LLM(str(tiny_pair[0]), draft=str(tiny_pair[0]), mode="auto", k=3, dtype="float32", progress=False)
    dbm = llm.engine.draft.block_manager
    seen = []

    def plan(self, seq_ids, caps, behind=None, remaining=None):
        self.rounds += 1
        seen.append((self.rounds, list(behind)))
        for s in llm.engine.scheduler.running:       # reserved: at most the K + 1 lookahead beyond the sequence
            assert dbm.num_tokens(s.seq_id) <= len(s) + 4
        draft = 6 < self.rounds % 12 <= 9
        self.predicted_tokens, self.predicted_s = 1.0, 1.0
        return list(caps) if draft else [0] * len(caps)

    monkeypatch.setattr(Chooser, "plan", plan)
    monkeypatch.setattr(Chooser, "would_speculate", lambda self, rows: False)     # no eager draft prefill
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ar_outputs
    assert seen[0][1] == [len(llm.encode(p)) for p in PROMPTS]       # lazy: the whole prompt is behind
    # caught up after drafting once (1 left only after a full accept: its last draft token is fed next round)
    assert all(max(b, default=0) <= 1 for r, b in seen if r % 12 == 8)
    rows = llm.engine.spec_metrics().rows_by_num_draft
    assert rows[0] > 0 and rows[3] > 0
    assert dbm.num_free_blocks == dbm.num_blocks
