"""The low-bit kernel path in the engine on tiny models: a float model quantized to Q8_0 at load,
and a GGUF file with Q8_0/Q5_0/Q4_0/Q4_1 tensors loaded as stored."""
from __future__ import annotations

import pytest
import torch

from ssd import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = ["hello world", "abc abc abc", "x"]


def test_q8_0_load_time_quantization_sd_equals_ar(tiny_pair):
    target, draft = tiny_pair
    ar = LLM(str(target), dtype="q8_0", progress=False)
    assert "Q8_0" in ar.target.dtype_name and "lossy" in ar.target.dtype_name
    ref = [o.token_ids for o in ar.generate(PROMPTS, GREEDY)]
    for d in (target, draft):
        sd = LLM(str(target), mode="sd", draft=str(d), dtype="q8_0", k=3, progress=False)
        assert [o.token_ids for o in sd.generate(PROMPTS, GREEDY)] == ref


def test_q8_0_logits_close_to_float(tiny_pair):
    from ssd.engine.model_runner import ForwardItem

    target, _ = tiny_pair
    outs = []
    for dtype in ("q8_0", "float32"):
        lm = LLM(str(target), dtype=dtype, progress=False)
        ids = lm.encode("hello world, this is a test")
        r = lm.engine.target
        r.block_manager.allocate(99, ids)
        outs.append(r.forward([ForwardItem(99, ids, 0, len(ids))])[0])
    lp, lq = outs[1].log_softmax(-1), outs[0].log_softmax(-1)
    assert (lp.exp() * (lp - lq)).sum(-1).mean() < 1e-2


@pytest.mark.parametrize("qtype", ["Q8_0", "Q5_0", "Q4_0", "Q4_1"])
def test_gguf_low_bit_tensors_load_as_stored(qtype, tmp_path):
    """A tiny Llama GGUF (permuted Q/K, tied embeddings) with quantized linears: the native load
    runs the kernels and gives the same greedy tokens as a float model of the dequantized weights
    up to the activation rounding (checked by logits closeness)."""
    from test_gguf_convert import write_quantized_tiny_gguf

    from conftest import make_tiny_hf
    from ssd.engine.model_runner import ForwardItem

    model = make_tiny_hf("llama", tmp_path / "hf", vocab=128)
    path = tmp_path / "tiny.gguf"
    write_quantized_tiny_gguf(model, path, qtype)
    low = LLM(str(path), progress=False)
    assert qtype in low.target.dtype_name
    ref = LLM(str(path), dtype="float32", progress=False)
    ids = list(range(3, 40))
    got = []
    for lm in (low, ref):
        r = lm.engine.target
        r.block_manager.allocate(7, ids)
        got.append(r.forward([ForwardItem(7, ids, 0, len(ids))])[0])
    lp, lq = got[1].log_softmax(-1), got[0].log_softmax(-1)
    assert (lp.exp() * (lp - lq)).sum(-1).mean() < 2e-2
    assert (got[0].argmax(-1) == got[1].argmax(-1)).float().mean() > 0.8


def test_sd_with_4bit_draft_equals_ar(tiny_pair):
    target, _ = tiny_pair
    ar = LLM(str(target), dtype="q8_0", progress=False)
    ref = [o.token_ids for o in ar.generate(PROMPTS, GREEDY)]
    sd = LLM(str(target), mode="sd", draft=str(target), dtype="q8_0", draft_dtype="q4_1", k=3, progress=False)
    assert "Q4_1" in sd.draft.dtype_name
    assert [o.token_ids for o in sd.generate(PROMPTS, GREEDY)] == ref
    assert sd.last_stats["acceptance_rate"] < 1.0       # the 4-bit draft is an approximation


def test_gguf_draft_defaults_to_4bit_codes():
    from ssd.models.loader import draft_dtype_for

    assert draft_dtype_for("auto", None, "cpu", "smollm2-135m") == "q4_1"
    assert draft_dtype_for("auto", "gguf", "cpu", "smollm2-135m") == "gguf"
    assert draft_dtype_for("float32", None, "cpu", "smollm2-135m") == "float32"


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_seeded_request_ignores_batch_mates_and_arrival_order(tiny_pair, mode):
    """On the batch-invariant kernels a seeded request gives the same tokens alone, behind other
    requests, and next to mates that draft more than it does (its last round drafts fewer tokens).
    SSD with backup='neural' (the 'auto' backup choice depends on the batch size by design)."""
    target, draft = tiny_pair
    kw = dict(dtype="q8_0", progress=False)
    if mode != "ar":
        kw.update(draft=str(draft), mode=mode, k=4)
    if mode == "ssd":
        kw.update(backup="neural")
    me = SamplingParams(temperature=1.0, top_k=40, seed=123, max_tokens=10, ignore_eos=True)
    mate = SamplingParams(temperature=0.9, seed=5, max_tokens=37, ignore_eos=True)
    lm = LLM(str(target), **kw)
    try:
        alone = lm.generate(["hello world"], me)[0].token_ids
        lm.generate(["warm up the arrival counter"], mate)
        crowd = lm.generate(["abc abc abc", "hello world", "x"], [mate, me, mate])[1].token_ids
        later = lm.generate(["x", "hello world"], [mate, me])[1].token_ids
    finally:
        lm.close()
    assert alone == crowd == later


def test_seed_out_of_int64_range_is_refused():
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=2**63)
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=-1)
    SamplingParams(seed=2**63 - 1)


def test_fused_layer_glue_matches_the_torch_layer(tiny_hf):
    """The C++ glue (RMSNorm, q/k/v split + q/k norm + rope, SiLU*up) against the PyTorch layer code,
    for Llama-3 (rope scaling), Qwen2 (q/k/v bias), Qwen3 (q/k norm). (Whole forwards are not
    compared: a 1e-7 difference can flip one int8 activation code, which then moves the output by a
    quantization step.)"""
    from conftest import make_char_tokenizer
    from ssd.models.loader import load_model

    kind, path, _ = tiny_hf
    make_char_tokenizer(path)
    model = load_model(path, "q8_0", progress=False).model
    layer = model.layers[1]
    ops, isa = layer.fused
    T, g = 7, torch.Generator().manual_seed(0)
    x = torch.randn(T, model.cfg.hidden_size, generator=g) * 3
    torch.testing.assert_close(ops.rms_norm(x, layer.input_norm.weight, layer.input_norm.eps), layer.input_norm(x),
                               rtol=1e-6, atol=1e-6)
    pos = torch.tensor([0, 1, 2, 30, 31, 100, 200])
    qkv = torch.randn(T, (layer.h + 2 * layer.hkv) * layer.d, generator=g)
    e = torch.empty(0)
    qn = layer.q_norm.weight if layer.q_norm is not None else e
    kn = layer.k_norm.weight if layer.k_norm is not None else e
    q, k, v = ops.qkv_rope(qkv, pos, model.rope.cos, model.rope.sin, layer.h, layer.hkv, layer.d, qn, kn,
                           model.cfg.rms_norm_eps)
    rq, rk, rv = qkv.split([layer.h * layer.d, layer.hkv * layer.d, layer.hkv * layer.d], dim=-1)
    rq, rk, rv = rq.reshape(T, layer.h, layer.d), rk.reshape(T, layer.hkv, layer.d), rv.reshape(T, layer.hkv, layer.d)
    if layer.q_norm is not None:
        rq, rk = layer.q_norm(rq), layer.k_norm(rk)
    rq, rk = model.rope(pos, rq, rk)
    torch.testing.assert_close(q, rq, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(k, rk, rtol=1e-5, atol=1e-5)
    assert torch.equal(v, rv)
    gu = torch.randn(T, 2 * layer.ffn, generator=g) * 4
    gate, up = gu.split([layer.ffn, layer.ffn], dim=-1)
    for i in (isa, 2, 1, 0):        # best, AVX-512, AVX2, portable (a path the CPU lacks falls back)
        torch.testing.assert_close(ops.silu_mul(gu, i), torch.nn.functional.silu(gate) * up, rtol=1e-5, atol=1e-5)
    assert torch.equal(ops.silu_mul(gu, 1), ops.silu_mul(gu, 0))      # the same operations in every path


@pytest.mark.parametrize("draft_vocab", [136, 112])
@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_draft_with_another_vocabulary_width(tiny_pair, tmp_path, mode, draft_vocab):
    """Real pairs differ in embedding rows (Qwen2.5-7B 152064, 0.5B 151936). The draft's proposals
    are aligned to the target's width (extra ids dropped, missing ones never sampled) in SD and in
    the SSD worker: greedy equals AR, sampling runs, SSD stays SSD."""
    from conftest import make_char_tokenizer, make_tiny_hf

    target, _ = tiny_pair
    d = tmp_path / "draft"
    make_tiny_hf("qwen2", d, seed=3, vocab=draft_vocab)
    make_char_tokenizer(d)
    ar = LLM(str(target), dtype="float32", progress=False)
    ref = [o.token_ids for o in ar.generate(PROMPTS, GREEDY)]
    lm = LLM(str(target), draft=str(d), mode=mode, k=3, dtype="float32", progress=False)
    try:
        assert [o.token_ids for o in lm.generate(PROMPTS, GREEDY)] == ref
        hot = SamplingParams(temperature=1.0, seed=1, max_tokens=20, ignore_eos=True)
        assert all(len(o.token_ids) == 20 for o in lm.generate(PROMPTS, hot))
        assert lm.engine.degraded_from is None
    finally:
        lm.close()


def test_ssd_stays_ssd_under_a_full_kv_cache(tiny_pair):
    """The worker's KV pool is the target's plus its pre-draft scratch space: a target cache so small
    that requests are preempted must not make the worker run out of room and degrade to AR."""
    target, draft = tiny_pair
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    prompts = ["hello world " * 3, "abc abc abc", "x y z w", "the quick brown fox"]
    ref = [o.token_ids for o in LLM(str(target), dtype="float32", progress=False).generate(prompts, params)]
    lm = LLM(str(target), draft=str(draft), mode="ssd", k=3, dtype="float32", progress=False, kv_cache_gb=0.0001)
    try:
        assert lm.engine.target.block_manager.num_blocks < 16
        assert [o.token_ids for o in lm.generate(prompts, params)] == ref
        assert lm.engine.degraded_from is None
        assert lm.engine.scheduler.num_preemptions > 0
    finally:
        lm.close()


def test_auto_takes_the_low_bit_path_only_where_it_is_fast():
    from ssd.models.loader import fast_low_bit_cpu

    assert fast_low_bit_cpu(2) and fast_low_bit_cpu(1) and not fast_low_bit_cpu(0)
