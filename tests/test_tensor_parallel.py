"""Tensor-parallel target (ssd/distributed): split math, shard-wise loading, TP=N logits and greedy
tokens equal TP=1 in every mode, GGUF low-bit shards, and bounded failures (a rank killed, a rank
that never joins) with no orphan processes."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from ssd import LLM, SamplingParams
from ssd.distributed.devices import remote_rank_device, spawned_rank_devices
from ssd.distributed.group import TensorParallelError, decode_batch, encode_batch
from ssd.distributed.sharding import ShardingError, head_split, plan, split_even, split_units, vocab_split
from ssd.distributed.target import rank_cores

from conftest import all_logits, make_char_tokenizer, make_tiny_hf

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = ["hello world", "def f(x):\n    return", "z" * 21]
IDS = list(range(3, 40))


# ---- split math (pure) ---------------------------------------------------------------------------

def test_split_even_is_contiguous_and_balanced():
    assert split_even(112, 3) == [(0, 38), (38, 75), (75, 112)]
    assert split_even(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for n in range(0, 30):
        for parts in range(1, 7):
            r = split_even(n, parts)
            assert r[0][0] == 0 and r[-1][1] == n and all(a[1] == b[0] for a, b in zip(r, r[1:]))
            sizes = [b - a for a, b in r]
            assert max(sizes) - min(sizes) <= 1


def test_split_units_falls_on_blocks_or_names_the_problem():
    assert split_units(8960, 256, 3) == [(0, 3072), (3072, 6144), (6144, 8960)]
    assert split_units(4864, 256, 2) == [(0, 2560), (2560, 4864)]
    with pytest.raises(ShardingError, match="not a multiple of its quant block 256"):
        split_units(112, 256, 2, "down_proj")
    with pytest.raises(ShardingError, match="too few for 3 ranks"):
        split_units(512, 256, 3, "down_proj")


@pytest.mark.parametrize("heads,kv,world", [(4, 2, 1), (4, 2, 2), (4, 2, 3), (4, 2, 4), (8, 2, 3), (12, 2, 5),
                                            (6, 3, 2), (16, 8, 3), (4, 4, 3), (14, 2, 4)])
def test_head_split_covers_every_head_once_with_the_kv_heads_it_needs(heads, kv, world):
    shards = head_split(heads, kv, world)
    assert len(shards) == world
    assert [h for s in shards for h in range(*s.q)] == list(range(heads))
    g = heads // kv
    for s in shards:
        assert s.num_q >= 1 and s.num_kv >= 1
        assert {h // g for h in range(*s.q)} == set(range(*s.kv))        # exactly the KV heads it reads
        assert s.num_q % s.num_kv == 0 and all((h - s.q[0]) // (s.num_q // s.num_kv) + s.kv[0] == h // g
                                               for h in range(*s.q))     # local GQA grouping is the global one


def test_head_split_replicates_kv_heads_beyond_their_count():
    assert [(s.q, s.kv) for s in head_split(4, 2, 3)] == [((0, 1), (0, 1)), ((1, 2), (0, 1)), ((2, 4), (1, 2))]
    with pytest.raises(ShardingError, match=r"tensor_parallel_size must be in \[1, 4\]"):
        head_split(4, 2, 5)
    with pytest.raises(ShardingError, match="rank 3 is outside"):
        plan(4, 2, 112, 3, 3)


@pytest.mark.parametrize("vocab,world", [(128, 3), (151936, 3), (151665, 3), (7, 3), (3, 3), (10, 4), (5, 1)])
def test_vocab_split_covers_every_row_once_evenly(vocab, world):
    r = vocab_split(vocab, world)
    assert len(r) == world and r[0][0] == 0 and r[-1][1] == vocab
    assert all(a[1] == b[0] for a, b in zip(r, r[1:]))
    sizes = [b - a for a, b in r]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_vocab_split_uneven_and_in_the_plan():
    assert vocab_split(128, 3) == [(0, 43), (43, 86), (86, 128)]
    assert vocab_split(151665, 3) == [(0, 50555), (50555, 101110), (101110, 151665)]
    assert [plan(4, 2, 112, 3, r, vocab_size=128).vocab for r in range(3)] == vocab_split(128, 3)
    with pytest.raises(ShardingError, match="vocabulary of 2 tokens cannot be split over 3 ranks"):
        vocab_split(2, 3)


def test_rank_cores_and_batch_encoding():
    assert rank_cores([5, 1, 2, 3], 2) == [[1, 2], [3, 5]]
    assert rank_cores([0], 2) is None
    assert rank_cores([0, 1, 2, 3], 2, threads=1) == [[0], [1]]        # --threads: that many cores per rank
    assert rank_cores([0, 1], 2, threads=2) is None                   # 4 threads on 2 cores: not pinned
    slots = [torch.tensor([4, 5, 6]), torch.tensor([9])]
    t, p, q, c, rows = decode_batch(encode_batch([7, 8, 9], [1, 2, 0], [2, 1], slots, [1, 2]))
    assert (t, p, q, rows) == ([7, 8, 9], [1, 2, 0], [2, 1], [1, 2]) and [x.tolist() for x in c] == [[4, 5, 6], [9]]
    assert decode_batch(encode_batch([7], [0], [1], [torch.tensor([3])]))[4] == []


def test_rank_devices_one_gpu_per_rank_or_a_clear_error():
    assert spawned_rank_devices("cpu", 3, 0) == ["cpu"] * 3
    assert spawned_rank_devices("cuda", 2, 2) == ["cuda:0", "cuda:1"]
    assert spawned_rank_devices("cuda:1", 3, 4) == ["cuda:1", "cuda:2", "cuda:3"]
    with pytest.raises(ValueError, match=r"needs GPUs cuda:1..cuda:3 .* this host has 3"):
        spawned_rank_devices("cuda:1", 3, 3)
    with pytest.raises(ValueError, match="needs GPUs cuda:0..cuda:1"):
        spawned_rank_devices("cuda", 2, 1)                     # NCCL refuses two ranks on one GPU
    assert remote_rank_device("cpu", 5, 0) == "cpu"
    assert [remote_rank_device("cuda:3", r, 2) for r in (1, 2, 3)] == ["cuda:1", "cuda:0", "cuda:1"]
    with pytest.raises(ValueError, match="this host has no CUDA GPU"):
        remote_rank_device("cuda", 1, 0)
    with pytest.raises(ValueError, match="'cpu' or 'cuda"):
        spawned_rank_devices("mps", 2, 0)


def test_tensor_parallel_on_cuda_is_checked_against_the_gpu_count(monkeypatch):
    """EngineConfig accepts TP on CUDA with one GPU per rank and names the GPUs it lacks before
    anything starts; ranks on other hosts (tp_host) bring their own. This machine has no GPU: the
    device check and the GPU count are faked (the only mocks here)."""
    import ssd.config
    from ssd import EngineConfig

    monkeypatch.setattr(ssd.config, "check_device", lambda name, device: None)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match=r"needs GPUs cuda:0..cuda:1 .* this host has 1"):
        EngineConfig(model="t", device="cuda", tensor_parallel_size=2)
    EngineConfig(model="t", device="cuda", tensor_parallel_size=2, tp_host="0.0.0.0:29600")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    EngineConfig(model="t", device="cuda:0", tensor_parallel_size=2)


# ---- models and engines --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    out = {}
    for kind in ("llama", "qwen2", "qwen3"):
        p = tmp_path_factory.mktemp(f"tp-{kind}")
        make_tiny_hf(kind, p)
        make_char_tokenizer(p)
        out[kind] = p
    return out


@pytest.fixture(scope="module")
def engines(folders):
    made: dict = {}

    def get(kind: str, tp: int, **kw) -> LLM:
        key = (kind, tp, tuple(sorted(kw.items())))
        if key not in made:
            made[key] = LLM(str(folders[kind]), dtype="float32", progress=False, kv_cache_gb=0.01,
                            tensor_parallel_size=tp, **kw)
        return made[key]
    yield get
    for lm in made.values():
        lm.close()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
@pytest.mark.parametrize("tp", [2, 3])
def test_tp_logits_equal_tp1(engines, kind, tp):
    """TP=3 splits 4 heads 1/1/2 over 2 KV heads (one replicated), intermediate 112 as 38/37/37 and
    the vocabulary 128 as 43/43/42 (embedding and LM head; llama ties them, qwen2/qwen3 do not)."""
    ref = all_logits(engines(kind, 1), IDS)
    lm = engines(kind, tp)
    got = all_logits(lm, IDS)
    assert got.shape == ref.shape
    assert lm.target.model.vocab_rows == vocab_split(128, tp)[0]     # rank 0 holds its vocab rows only
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.parametrize("tp", [2, 3])
def test_tp_greedy_generation_equals_tp1_ar(engines, tp):
    ref = [o.token_ids for o in engines("qwen2", 1).generate(PROMPTS, GREEDY)]
    assert [o.token_ids for o in engines("qwen2", tp).generate(PROMPTS, GREEDY)] == ref


def test_tp_over_gloo_equals_tp_over_shared_memory(engines):
    """Ranks on one host use shared memory by default; tp_transport="gloo" forces TCP: same tokens,
    same logits (both sum the ranks' partials in the same order), and the stats say which ran."""
    shm_lm, gloo_lm = engines("qwen2", 2), engines("qwen2", 2, tp_transport="gloo")
    assert shm_lm.tensor_parallel_stats()["transport"] == "shm"
    assert gloo_lm.tensor_parallel_stats()["transport"] == "gloo"
    assert [o.token_ids for o in gloo_lm.generate(PROMPTS, GREEDY)] == \
        [o.token_ids for o in shm_lm.generate(PROMPTS, GREEDY)]
    torch.testing.assert_close(all_logits(gloo_lm, IDS), all_logits(shm_lm, IDS), rtol=0, atol=0)
    assert all(r["wait_s"] is None for r in gloo_lm.tensor_parallel_stats()["ranks"])
    assert all(r["wait_s"] >= 0 for r in shm_lm.tensor_parallel_stats()["ranks"])


def test_tp_stats_split_compute_and_collectives_per_rank(engines):
    from ssd.bench.runner import tp_run_stats

    lm = engines("qwen2", 2)
    before = lm.tensor_parallel_stats()
    lm.generate(["y" * 25], GREEDY)     # 25 new prompt tokens (none prefix-cached): not a decode-sized forward
    run = tp_run_stats(before, lm.tensor_parallel_stats())
    assert run["size"] == 2 and run["steps"] >= GREEDY.max_tokens
    layers = lm.target.config.num_layers
    for r in run["ranks"]:
        assert r["allreduces"] == (2 * layers + 1) * run["steps"]   # embedding; o_proj and down, every layer
        assert r["gathers"] == run["steps"]                          # the logits columns, every step
        assert 0 < r["allreduce_s"] <= r["busy_s"] and r["compute_s"] == r["busy_s"] - r["allreduce_s"]
        assert r["allreduce_ms_per_step"] > 0
        assert 0 <= r["wait_s"] <= r["allreduce_s"]
        # decode steps alone: every step but the prefill; their collectives are a share of their time
        assert 0 < r["decode_allreduce_ms_per_step"] and 0 < r["decode_allreduce_share"] < 1
        assert 0 <= r["decode_wait_ms_per_step"] <= r["decode_allreduce_ms_per_step"]
    assert run["transport"] == "shm"
    assert run["decode_steps"] == run["steps"] - 1 == GREEDY.max_tokens - 1   # one prompt: one prefill forward
    from ssd.bench.report import tensor_parallel_table

    table = tensor_parallel_table({"runs": [{"dataset": "d", "batch_size": 1, "mode": "ar", "tensor_parallel": run}]})
    assert table.count("| d | 1 | ar | shm |") == 2 and "%" in table
    assert tensor_parallel_table({"runs": [{"dataset": "d", "mode": "ar"}]}) == ""
    assert engines("qwen2", 1).tensor_parallel_stats() is None


def test_tp_shards_hold_only_their_kv_heads(engines):
    lm = engines("qwen2", 3)
    k, _ = lm.engine.target.kv_caches[0]
    assert k.shape[1] == 1 and lm._tp.world == 3        # rank 0 serves query head 0: KV head 0 only


@pytest.mark.parametrize("mode", ["sd", "auto", "ssd"])
def test_tp_speculative_greedy_equals_tp1_ar(folders, engines, tmp_path_factory, mode):
    draft = tmp_path_factory.mktemp(f"tp-draft-{mode}")
    make_tiny_hf("qwen2", draft, seed=1)
    make_char_tokenizer(draft)
    ref = [o.token_ids for o in engines("qwen2", 1).generate(PROMPTS, GREEDY)]
    lm = LLM(str(folders["qwen2"]), draft=str(draft), mode=mode, k=3, dtype="float32", progress=False,
             kv_cache_gb=0.01, tensor_parallel_size=2)
    try:
        assert [o.token_ids for o in lm.generate(PROMPTS, GREEDY)] == ref
        assert lm.draft is None or lm.draft.model.shard is None          # the draft stays whole
    finally:
        lm.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_tp_float_backends_are_as_close_to_fp32_as_tp1(folders, engines, dtype):
    """bf16 (torch GEMMs, fp32 on the wire) and fp16 FBGEMM (fp16 KV cache, C++ attention): TP's
    partial sums round differently from one GEMM, so TP=2 is held to TP=1's own distance from fp32."""
    from ssd.layers.linear import fbgemm_fp16_available

    if dtype == "float16" and not fbgemm_fp16_available():
        pytest.skip("no FBGEMM")
    exact = all_logits(engines("qwen2", 1), IDS)
    one = LLM(str(folders["qwen2"]), dtype=dtype, progress=False, kv_cache_gb=0.01)
    err1 = (all_logits(one, IDS) - exact).abs().max().item()
    lm = LLM(str(folders["qwen2"]), dtype=dtype, progress=False, kv_cache_gb=0.01, tensor_parallel_size=2)
    try:
        got = all_logits(lm, IDS)
        assert (got - exact).abs().max().item() <= 2 * err1 + 1e-6
        assert (got.argmax(-1) == exact.argmax(-1)).float().mean() > 0.9
    finally:
        lm.close()


# ---- shard-wise loading ----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_shards_are_slices_of_the_whole_model_and_read_only_their_bytes(folders, kind):
    """Every rank, rank 0 included, reads only its vocab rows of the embedding and the LM head (one
    read when they are tied, as in the llama config)."""
    from ssd.models.loader import load_model

    whole = load_model(folders[kind], "float32", progress=False)
    w1 = whole.model.layers[1]
    for rank in range(3):
        part = load_model(folders[kind], "float32", progress=False, shard=(rank, 3))
        s, lay = part.model.shard, part.model.layers[1]
        d = whole.config.head_dim
        q0, q1 = s.heads.q[0] * d, s.heads.q[1] * d
        k0, k1 = s.heads.kv[0] * d, s.heads.kv[1] * d
        qkv = w1.qkv.weight
        hq, hkv = whole.config.num_heads * d, whole.config.num_kv_heads * d
        want = torch.cat([qkv[q0:q1], qkv[hq + k0:hq + k1], qkv[hq + hkv + k0:hq + hkv + k1]])
        assert torch.equal(lay.qkv.weight, want)
        if whole.config.attention_bias:
            assert torch.equal(lay.qkv.bias, torch.cat([w1.qkv.bias[q0:q1], w1.qkv.bias[hq + k0:hq + k1],
                                                        w1.qkv.bias[hq + hkv + k0:hq + hkv + k1]]))
        assert torch.equal(lay.o_proj.weight, w1.o_proj.weight[:, q0:q1])
        f0, f1, F = *s.ffn, whole.config.intermediate_size
        assert torch.equal(lay.gate_up.weight, torch.cat([w1.gate_up.weight[f0:f1], w1.gate_up.weight[F + f0:F + f1]]))
        assert torch.equal(lay.down.weight, w1.down.weight[:, f0:f1])
        v0, v1 = s.vocab
        assert s.vocab == vocab_split(whole.config.vocab_size, 3)[rank]
        assert torch.equal(part.model.embed, whole.model.embed[v0:v1])
        assert torch.equal(part.model.lm_head.weight, whole.model.lm_head.weight[v0:v1])
        # bytes read: the replicated norms, this rank's linear rows/columns and vocab rows (embedding, head)
        cfg = whole.config
        b = 1 if cfg.attention_bias else 0
        lin = (s.heads.num_q * d * (cfg.hidden_size + b) + 2 * s.heads.num_kv * d * (cfg.hidden_size + b)
               + s.heads.num_q * d * cfg.hidden_size + 3 * (f1 - f0) * cfg.hidden_size)
        norms = 2 * cfg.hidden_size
        vocab = (1 if cfg.tie_word_embeddings else 2) * (v1 - v0) * cfg.hidden_size
        expect = 4 * (cfg.num_layers * (lin + norms) + vocab + cfg.hidden_size)
        assert part.bytes_read == expect
        assert part.bytes_read < whole.bytes_read


# ---- GGUF low-bit ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    from test_gguf_convert import write_quantized_tiny_gguf

    d = tmp_path_factory.mktemp("tp-gguf")
    return write_quantized_tiny_gguf(make_tiny_hf("llama", d / "hf", vocab=128), d / "tiny.gguf", "Q8_0")


def test_gguf_low_bit_tp2_equals_tp1(tiny_gguf):
    """Q8_0 linears (o_proj split on its 32-value blocks), permuted Llama Q/K rows read per head."""
    ref_lm = LLM(str(tiny_gguf), dtype="gguf", progress=False, kv_cache_gb=0.01)
    assert "Q8_0" in ref_lm.target.dtype_name
    ref = all_logits(ref_lm, IDS)
    ref_tokens = ref_lm.generate(IDS[:5], GREEDY)[0].token_ids
    lm = LLM(str(tiny_gguf), dtype="gguf", progress=False, kv_cache_gb=0.01, tensor_parallel_size=2)
    try:
        assert "Q8_0" in lm.target.dtype_name
        assert type(lm.target.model.layers[0].o_proj).__name__ == "QuantLinear"
        model = lm.target.model             # rank 0: vocab rows [0, 64) of the tied Q8_0 embedding/head only
        assert model.vocab_rows == (0, 64) and type(model.embed).__name__ == "QuantEmbedding"
        assert model.embed.num_embeddings == 64
        got = all_logits(lm, IDS)
        torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
        assert lm.generate(IDS[:5], GREEDY)[0].token_ids == ref_tokens
    finally:
        lm.close()


def test_gguf_row_split_off_the_quant_blocks_is_refused(tiny_gguf):
    """TP=3 gives rank 0 one head (16 columns of o_proj), inside a Q8_0 block of 32: a clear error,
    in bounded time, and the ranks already started are stopped."""
    before = _live_children()
    t0 = time.monotonic()
    with pytest.raises(ShardingError, match=r"o_proj: this rank's input columns \[0, 16\) do not fall on the "
                                            r"weight's quant blocks of 32; .*pick a tensor_parallel_size"):
        LLM(str(tiny_gguf), dtype="gguf", progress=False, kv_cache_gb=0.01, tensor_parallel_size=3)
    assert time.monotonic() - t0 < 30
    assert not _live_children() - before


def test_gguf_partial_reads_equal_slices(tiny_gguf):
    from ssd.kernels.gguf_pack import dequantize
    from ssd.models.gguf_weights import GGUFWeights

    w = GGUFWeights(tiny_gguf)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"):
        full = dequantize(w(name))
        assert np.array_equal(dequantize(w.part(name, (16, 48))), full[16:48])       # rows after un-permuting
    full = dequantize(w("model.layers.1.self_attn.o_proj.weight"))
    assert np.array_equal(dequantize(w.part("model.layers.1.self_attn.o_proj.weight", None, (32, 64))), full[:, 32:])
    with pytest.raises(ValueError, match="do not fall on its blocks of 32"):
        w.part("model.layers.1.self_attn.o_proj.weight", None, (16, 64))


# ---- configuration and failures ----------------------------------------------------------------

def test_tensor_parallel_size_is_validated(folders):
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        LLM(str(folders["qwen2"]), dtype="float32", progress=False, tensor_parallel_size=0)
    with pytest.raises(ShardingError, match=r"must be in \[1, 4\] \(the number of attention heads\), got 5"):
        LLM(str(folders["qwen2"]), dtype="float32", progress=False, tensor_parallel_size=5)
    with pytest.raises(ValueError, match="tp_host waits for tensor-parallel ranks"):
        LLM(str(folders["qwen2"]), dtype="float32", progress=False, tp_host="127.0.0.1:1")


def _live_children() -> set[int]:
    """Pids of this process's children that are not zombies (from /proc)."""
    out = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == os.getpid() and fields[0] != "Z":
                out.add(int(d))
    return out


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:            # a zombie not yet reaped is gone too
        return f.read().split(")")[-1].split()[0] == "Z"


def test_killed_rank_fails_the_engine_in_bounded_time_and_close_leaves_no_process(folders):
    lm = LLM(str(folders["qwen2"]), dtype="float32", progress=False, kv_cache_gb=0.01, tensor_parallel_size=3,
             tp_timeout_s=20)
    procs = dict(lm._tp.procs)
    stream = lm.stream("hello world", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    next(stream)
    procs[2].kill()
    procs[2].wait()
    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank 2 \(pid \d+, exit code -9\) exited.*start a new LLM"):
        for _ in stream:
            pass
    assert time.monotonic() - t0 < 30
    with pytest.raises(TensorParallelError, match="cannot continue"):        # every later call fails too
        lm.generate("abc", GREEDY)
    t0 = time.monotonic()
    lm.close()
    assert time.monotonic() - t0 < 15
    assert all(p.poll() is not None for p in procs.values())


def test_hung_rank_times_out_with_a_clear_error(folders):
    """A rank alive but silent (SIGSTOP): the step's all-reduce gives up after tp_timeout_s."""
    import signal

    lm = LLM(str(folders["qwen2"]), dtype="float32", progress=False, kv_cache_gb=0.01, tensor_parallel_size=2,
             tp_timeout_s=8)   # start-up (import torch: ~3 s here) fits
    rank = lm._tp.procs[1]
    try:
        lm.generate("abc", GREEDY)
        os.kill(rank.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(TensorParallelError, match="a collective failed or timed out"):
            lm.generate("abc", GREEDY)
        assert time.monotonic() - t0 < 20
    finally:
        lm.close()
    assert rank.poll() is not None


def test_rank_that_never_joins_is_reported_in_bounded_time(folders):
    from ssd.speculation.worker.transport import free_port

    t0 = time.monotonic()
    with pytest.raises(TensorParallelError, match=r"rank\(s\) \[1\] did not join .* within 3s: start them "
                                                  r"\(`ssd tp-rank --connect"):
        LLM(str(folders["qwen2"]), dtype="float32", progress=False, kv_cache_gb=0.01, tensor_parallel_size=2,
            tp_host=f"127.0.0.1:{free_port()}", tp_timeout_s=3)
    assert time.monotonic() - t0 < 30


def test_ranks_started_by_hand_join_through_tp_rank(folders, engines):
    from ssd.speculation.worker.client import _child_env
    from ssd.speculation.worker.transport import free_port

    port = free_port()
    rank = subprocess.Popen([sys.executable, "-m", "ssd.cli", "tp-rank", "--connect", f"127.0.0.1:{port}",
                             "--rank", "1", "--world-size", "2", "--threads", "1"], env=_child_env(),
                            stderr=subprocess.PIPE)
    try:
        lm = LLM(str(folders["qwen2"]), dtype="float32", progress=False, kv_cache_gb=0.01, tensor_parallel_size=2,
                 tp_host=f"127.0.0.1:{port}", tp_timeout_s=60)
        ref = [o.token_ids for o in engines("qwen2", 1).generate(PROMPTS[:1], GREEDY)]
        assert [o.token_ids for o in lm.generate(PROMPTS[:1], GREEDY)] == ref
        lm.close()
        assert rank.wait(15) == 0
    finally:
        if rank.poll() is None:
            rank.kill()


def test_ranks_exit_with_the_engine_process(folders, tmp_path):
    """No orphans when the engine's interpreter exits without close(), nor when it is killed."""
    from ssd.speculation.worker.client import _child_env

    script = textwrap.dedent(f"""
        import os, sys, time
        from ssd import LLM
        lm = LLM({str(folders['qwen2'])!r}, dtype="float32", progress=False, kv_cache_gb=0.01,
                 tensor_parallel_size=2)
        print(" ".join(str(p.pid) for p in lm._tp.procs.values()), flush=True)
        if sys.argv[1] == "kill":
            time.sleep(60)
        """)
    for how in ("exit", "kill"):
        p = subprocess.Popen([sys.executable, "-c", script, how], stdout=subprocess.PIPE, env=_child_env(),
                             cwd=tmp_path)
        pids = [int(x) for x in p.stdout.readline().split()]
        assert pids
        if how == "kill":
            p.kill()
        p.wait(60)
        deadline = time.monotonic() + 20
        while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_gone(pid) for pid in pids), (how, pids)


def test_rank0_command_send_is_bounded_when_a_rank_is_not_listening():
    """A gloo send completes only once the peer posts its receive: a rank stopped before it got back
    to waiting for a command (a race the SIGSTOP test above can hit or miss) must not keep rank 0 in
    the command broadcast for the idle timeout. Here rank 1 joins and never listens."""
    import subprocess
    import sys

    from ssd.distributed.group import STATS, TPGroup, make_store
    from ssd.speculation.worker.client import _child_env
    from ssd.speculation.worker.transport import free_port

    port = free_port()
    code = ("import time; from ssd.distributed.group import TPGroup, make_store; "
            f"g = TPGroup(make_store('127.0.0.1', {port}, 1, 2, 30), 1, 2, 2.0); time.sleep(60)")
    peer = subprocess.Popen([sys.executable, "-c", code], env=_child_env())
    try:
        group = TPGroup(make_store("127.0.0.1", port, 0, 2, 30), 0, 2, 2.0)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError):
            group.send_command(STATS)
        assert time.monotonic() - t0 < 10
    finally:
        peer.kill()
        peer.wait()
