"""SSD: greedy identity with AR (hits, misses, both backups, batches), the real worker process,
worker failure, and a statistical check at temperature > 0."""
from __future__ import annotations

import os
import signal

import pytest
import torch
from scipy.stats import chisquare

from ssd import LLM, SamplingParams

from conftest import perturbed_copy
from ssd_local import local_ssd

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
PROMPTS = ["hello world", "abc", "def f(x):\n    return", "abab abab abab", "The quick brown fox"]


@pytest.fixture(scope="module")
def ar_ref(tiny_pair):
    llm = LLM(str(tiny_pair[0]), dtype="float32", progress=False)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("draft,predraft,backup", [("self", True, "neural"), ("other", True, "neural"),
                                                   ("self", False, "neural"), ("other", False, "fast"),
                                                   ("self", True, "fast")])
def test_ssd_greedy_equals_ar(monkeypatch, tiny_pair, ar_ref, draft, predraft, backup):
    target, other = tiny_pair
    llm, client = local_ssd(monkeypatch, target, target if draft == "self" else other, predraft=predraft,
                            backup=backup)
    outs = llm.generate(PROMPTS, GREEDY)                 # batch of 5
    assert [o.token_ids for o in outs] == ar_ref
    single = llm.generate(PROMPTS[2], GREEDY)[0]          # batch of 1
    assert single.token_ids == ar_ref[2]
    stats = llm.engine.spec_metrics()
    if predraft and draft == "self":
        assert stats.hits > stats.misses                  # the cache serves most rounds
    if not predraft:
        assert stats.hits == 0                            # every round went through the backup
    if backup == "fast" and not predraft:
        assert stats.fast_backups > 0


def test_ssd_spec_max_batch_runs_one_token_rounds_then_catches_up(monkeypatch, tiny_pair, ar_ref):
    target, _ = tiny_pair
    llm, client = local_ssd(monkeypatch, target, target, llm_kw=dict(spec_max_batch=2))
    asked = []
    send = client.post_speculate
    monkeypatch.setattr(client, "post_speculate", lambda reqs, *a: asked.append(len(reqs)) or send(reqs, *a))
    outs = llm.generate(PROMPTS, GREEDY)                       # 5 sequences > 2: one token per round
    assert [o.token_ids for o in outs] == ar_ref
    assert all(o.metrics.target_forwards == GREEDY.max_tokens - 1 for o in outs)
    stats = llm.engine.spec_metrics()
    assert stats.hits == stats.misses == 0 and not asked       # the worker was never asked
    assert not client.worker.seqs                              # and holds nothing
    # 3 sequences, one short: one-token rounds until it ends, then the worker catches up on the
    # other two and speculation resumes (self-draft: all accepted, mostly from the cache)
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    mixed = llm.generate(PROMPTS[:3], [short, GREEDY, GREEDY])
    assert mixed[0].token_ids == ar_ref[0][:6]
    assert [o.token_ids for o in mixed[1:]] == ar_ref[1:3]
    assert all(o.metrics.target_forwards < 5 + (GREEDY.max_tokens - 6) // 2 for o in mixed[1:])
    assert llm.engine.spec_metrics().hits > 0 and set(asked) == {2}


def test_real_worker_process_and_kill_falls_back_to_ar(tiny_pair, ar_ref):
    target, draft = tiny_pair
    llm = LLM(str(target), draft=str(draft), mode="ssd", k=3, dtype="float32", progress=False,
              kv_cache_gb=0.05, worker_timeout_s=20)
    try:
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == ar_ref
        stream = llm.stream(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        got = next(stream).token_ids + next(stream).token_ids
        os.kill(llm._client.pid, signal.SIGKILL)         # the worker dies mid-generation
        for chunk in stream:
            got += chunk.token_ids
        assert got == ar_ref[0]
        assert llm.engine.degraded_from == "ssd" and llm.engine.mode == "ar"
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_ref   # later requests too
    finally:
        llm.close()


def test_hung_worker_times_out_and_every_request_finishes_exactly(tiny_pair, ar_ref):
    """A worker that stops answering (SIGSTOP: alive, silent) is given up on after worker_timeout_s;
    the in-flight requests finish with local AR, identical to AR, and closing does not hang."""
    import time

    target, draft = tiny_pair
    llm = LLM(str(target), draft=str(draft), mode="ssd", k=3, dtype="float32", progress=False,
              kv_cache_gb=0.05, worker_timeout_s=8)
    pid = llm._client.pid
    try:
        stream = llm.stream(PROMPTS[1], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        got = next(stream).token_ids + next(stream).token_ids
        os.kill(pid, signal.SIGSTOP)
        t0 = time.monotonic()
        for chunk in stream:
            got += chunk.token_ids
        assert got == ar_ref[1]
        assert time.monotonic() - t0 < 30
        assert llm.engine.degraded_from == "ssd"
    finally:
        t0 = time.monotonic()
        llm.close()
        assert time.monotonic() - t0 < 3     # the hung worker was killed, not asked to shut down
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def test_the_engine_prefills_without_waiting_for_the_worker_to_take_the_prompts(tiny_pair, ar_ref):
    """Prompts are posted to the worker, which prefills each before it takes the next message; the
    engine prefills its own copies meanwhile. Here the worker is stopped during the prefill step:
    the step still produces every first token, and once the worker runs again it takes the prompts
    and speculation goes on, identical to AR. Before, each hand-over waited until the worker took
    it (a busy worker held the target's prefill back by its own: TTFT 20% above AR's at batch 4 on
    1+1 cores); a stopped one made the prefill time out and the engine fall back to AR."""
    target, draft = tiny_pair
    llm = LLM(str(target), draft=str(draft), mode="ssd", k=3, dtype="float32", progress=False,
              kv_cache_gb=0.05, worker_timeout_s=5, threads=1, prefill_threads=1)
    eng, pid = llm.engine, llm._client.pid
    eng.step_impl.prefill_on_worker_cores = False       # (as on a host with a core for each)
    try:
        os.kill(pid, signal.SIGSTOP)
        try:
            seqs = [eng.add_request(f"r{i}", llm.encode(p), GREEDY) for i, p in enumerate(PROMPTS)]
            eng.step()
            assert [len(s.output_token_ids) for s in seqs] == [1] * len(PROMPTS)
        finally:
            os.kill(pid, signal.SIGCONT)
        while eng.has_unfinished():
            eng.step()
        assert [s.output_token_ids for s in seqs] == ar_ref
        m = eng.spec_metrics()
        assert eng.degraded_from is None and m.hits + m.misses > 0
    finally:
        llm.close()


@pytest.mark.parametrize("cores, threads, prefill, workers, want", [
    ({0, 1}, 1, 2, 1, True),        # the equal placement: the prefill runs on the worker's core too
    ({0, 1}, 1, 1, 1, False),       # 1 + 1 cores
    ({0, 1, 2, 3}, 2, 3, 1, False),
    ({0, 1, 2, 3}, 2, 3, 2, True),
])
def test_which_prefills_share_the_workers_cores(monkeypatch, cores, threads, prefill, workers, want):
    from ssd.config import EngineConfig

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(cores))
    cfg = EngineConfig(model="t", draft="d", mode="ssd", threads=threads, num_draft_workers=workers)
    assert LLM._prefill_on_worker_cores(cfg, prefill) is want
    remote = EngineConfig(model="t", draft="d", mode="ssd", threads=threads, draft_host="10.0.0.2:1")
    assert LLM._prefill_on_worker_cores(remote, prefill) is False


@pytest.mark.parametrize("shared", [True, False])
def test_a_prefill_on_the_workers_cores_hands_prompts_over_at_the_first_round(monkeypatch, tiny_pair, ar_ref,
                                                                               shared):
    """Where the target prefills on the worker's cores too, the worker gets each prompt at its first
    round (after the prefill), not during it; with cores of its own during it (the control). Tokens
    equal AR's either way."""
    from ssd.speculation.worker.client import DraftClient

    target, draft = tiny_pair
    llm = LLM(str(target), draft=str(draft), mode="ssd", k=3, dtype="float32", progress=False,
              kv_cache_gb=0.05, worker_timeout_s=20, threads=1, prefill_threads=2 if shared else 1)
    adds = []
    real = DraftClient.add
    monkeypatch.setattr(DraftClient, "add", lambda self, msg: (adds.append(len(msg.tokens)), real(self, msg)))
    eng = llm.engine
    prefill = 2 if shared else 1
    assert eng.step_impl.prefill_on_worker_cores is (prefill + 1 > len(os.sched_getaffinity(0)))
    eng.step_impl.prefill_on_worker_cores = shared      # (whatever this host's core count)
    try:
        seqs = [eng.add_request(f"r{i}", llm.encode(p), GREEDY) for i, p in enumerate(PROMPTS)]
        eng.step()                                       # the prefill
        assert len(adds) == (0 if shared else len(PROMPTS))
        while eng.has_unfinished():
            eng.step()
        assert len(adds) == len(PROMPTS)                 # each prompt handed over once
        assert [s.output_token_ids for s in seqs] == ar_ref
        assert eng.degraded_from is None
    finally:
        llm.close()


def test_worker_start_failure_is_a_clear_error(tiny_pair, tmp_path):
    import shutil

    from ssd.speculation.worker.client import DraftWorkerError

    broken = tmp_path / "broken"
    shutil.copytree(tiny_pair[1], broken)
    for f in broken.glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    with pytest.raises(DraftWorkerError, match="could not load"):
        LLM(str(tiny_pair[0]), draft=str(broken), mode="ssd", dtype="float32", progress=False,
            worker_timeout_s=30)


@pytest.mark.parametrize("k,override,mode", [(3, False, "ssd"), (2, True, "ssd"), (3, False, None)])
def test_remote_worker_started_by_hand(tiny_pair, ar_ref, k, override, mode):
    """`ssd draft-worker --connect HOST:PORT` on 'another host' (a separate process here) and the engine's
    draft_host: same tokens as AR. The worker takes K, the model and the rest from the engine (the same
    command serves k=3 and k=2); --model loads the draft from another path on the worker's host. In
    the default mode (auto) draft_host turns auto_ssd on: auto's SSD rounds use the remote worker."""
    import shutil
    import subprocess
    import sys

    from ssd.speculation.worker.client import _child_env
    from ssd.speculation.worker.transport import free_port

    target, draft = tiny_pair
    port = free_port()
    cmd = [sys.executable, "-m", "ssd.cli", "draft-worker", "--connect", f"127.0.0.1:{port}", "--timeout", "30"]
    engine_draft = str(draft)
    if override:      # the engine names a path that exists only on its host; the worker has its own copy
        engine_draft = str(draft) + "-engine-side"
        shutil.copytree(draft, engine_draft, dirs_exist_ok=True)
        cmd += ["--model", str(draft)]
    proc = subprocess.Popen(cmd, env=_child_env(), stderr=subprocess.DEVNULL)
    try:
        kw = dict(draft=engine_draft, mode=mode, k=k, dtype="float32", progress=False, kv_cache_gb=0.05,
                  worker_timeout_s=30, draft_host=f"127.0.0.1:{port}")
        llm = LLM(str(target), **kw)
        try:
            assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_ref
            assert llm.engine.spec_metrics().rounds > 0 and llm.engine.degraded_from is None
            if mode is None:
                assert llm.config.mode == "auto" and llm.config.auto_ssd
                assert llm.engine.spec_metrics().worker_rounds > 0
        finally:
            llm.close()
        assert proc.wait(30) == 0                          # the engine's shutdown ends the worker
    finally:
        if proc.poll() is None:
            proc.kill()


TOP_K = 3   # few cells -> a powerful chi-square; top-k applies to p and q alike


def exact_second_token_dist(target_dir, prompt_ids, temperature):
    """(likeliest first token t, exact P(second token | t)) under the target with temperature and top-k."""
    from transformers import AutoModelForCausalLM

    from ssd.layers.sampler import logits_to_probs

    def probs(logits):
        n = logits.shape[0]
        return logits_to_probs(logits, torch.full((n,), temperature), torch.full((n,), TOP_K),
                               torch.ones(n)).double()

    hf = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = probs(hf(torch.tensor([prompt_ids])).logits[:, -1])[0]
        V = p1.shape[0]
        batch = torch.tensor([prompt_ids + [t] for t in range(V)])
        p2 = probs(hf(batch).logits[:, -1])
    first = int(p1.argmax())
    return first, p2[first]          # condition on the likeliest first token: no mixing dilutes a bias


def second_token_pvalue(llm, prompt, expected, n=3000, temperature=1.0):
    # max_tokens=3: the second token comes from a speculation round (k_eff = 1), not from prefill
    params = [SamplingParams(temperature=temperature, top_k=TOP_K, seed=s, max_tokens=3, ignore_eos=True)
              for s in range(n)]
    first, expected = expected
    outs = [o for o in llm.generate([prompt] * n, params) if o.token_ids[0] == first]
    n = len(outs)
    assert n > 300
    counts = torch.bincount(torch.tensor([o.token_ids[1] for o in outs]), minlength=len(expected)).double()
    exp = expected * n
    big = exp >= 5                                        # pool sparse cells for the chi-square
    if exp[~big].sum() < 1e-9:                            # impossible tokens must never appear
        if counts[~big].sum() > 0:
            return 0.0
        obs, ex = counts[big], exp[big]
    else:
        obs = torch.cat([counts[big], counts[~big].sum().view(1)])
        ex = torch.cat([exp[big], exp[~big].sum().view(1)])
    return chisquare(obs.numpy(), ex.numpy() * obs.sum().item() / ex.sum().item()).pvalue


@pytest.fixture(scope="module")
def near_draft(tiny_pair, tmp_path_factory):
    """A draft close to the target (perturbed copy): many partial acceptances, where a wrong residual shows."""
    return perturbed_copy(tiny_pair[0], tmp_path_factory.mktemp("near-draft"), 0.5, seed=5)


@pytest.fixture(scope="module")
def stat_setup(tiny_pair):
    target, _ = tiny_pair
    llm = LLM(str(target), dtype="float32", progress=False)
    prompt = "hello"
    exp = exact_second_token_dist(target, llm.encode(prompt), 1.0)
    return prompt, exp


def test_sd_matches_target_distribution_and_broken_residual_is_caught(monkeypatch, tiny_pair, near_draft,
                                                                       stat_setup):
    from ssd.speculation import verify as V

    prompt, exp = stat_setup
    target, draft = tiny_pair[0], near_draft
    llm = LLM(str(target), draft=str(draft), mode="sd", k=2, dtype="float32", progress=False, max_num_seqs=256)
    assert second_token_pvalue(llm, prompt, exp) > 1e-3
    monkeypatch.setattr(V, "residual", lambda p, q: p)    # the classic bug: resample from p on rejection
    assert second_token_pvalue(llm, prompt, exp) < 1e-5


def test_ssd_saguaro_matches_target_and_q_instead_of_qprime_is_caught(monkeypatch, tiny_pair, near_draft,
                                                                       stat_setup):
    prompt, exp = stat_setup
    target, draft = tiny_pair[0], near_draft
    llm, client = local_ssd(monkeypatch, target, draft, k=2, saguaro_c=0.0, fanout_budget=3)
    llm.engine.scheduler.max_num_seqs = 256
    assert second_token_pvalue(llm, prompt, exp) > 1e-3

    def ship_plain_q(worker, reply):   # sampled from q' but tell the verifier q
        if reply.probs is not None:
            s = worker.seqs[reply.seq_id]
            q = torch.stack([s.dists[j] for j in range(len(reply.tokens))])
            top = q.topk(TOP_K, dim=-1)
            plain = torch.zeros_like(q).scatter_(-1, top.indices, top.values)
            reply.probs = plain / plain.sum(-1, keepdim=True)
        return reply

    client.tamper = ship_plain_q
    assert second_token_pvalue(llm, prompt, exp) < 1e-5


def test_worker_calibrates_its_draft_step_at_start(tiny_pair):
    from ssd_local import LocalDraftClient

    w = LocalDraftClient(tiny_pair[1], k=3).worker
    assert w.budget.step_s > 0 and 0 <= w.budget.row_cost <= 1     # the policy's cost model, measured
    fixed = LocalDraftClient(tiny_pair[1], k=3, fanout_budget=2).worker
    assert fixed.budget.step_s == 0 and fixed.budget.budget(1, cap=64) == 2     # a fixed budget needs no timing


def test_trace_has_target_and_draft_spans(monkeypatch, tiny_pair, tmp_path):
    import json

    from ssd import LLM as _LLM

    traced = _LLM(str(tiny_pair[0]), draft=str(tiny_pair[1]), mode="sd", dtype="float32", progress=False, trace=True)
    assert _LLM(str(tiny_pair[0]), dtype="float32", progress=False).engine.tracer.spans == []   # off by default
    traced.generate(PROMPTS[:2], GREEDY)
    traced.write_trace(tmp_path / "sd.json")
    events = json.loads((tmp_path / "sd.json").read_text())["traceEvents"]
    names = {(e.get("cat"), e["name"]) for e in events if e["ph"] == "X"}
    assert {("target", "verify"), ("draft", "draft"), ("target", "prefill")} <= names
    llm, _ = local_ssd(monkeypatch, tiny_pair[0], tiny_pair[0], llm_kw={"trace": True})
    llm.generate(PROMPTS[:2], GREEDY)
    llm.write_trace(tmp_path / "ssd.json")
    events = json.loads((tmp_path / "ssd.json").read_text())["traceEvents"]
    names = {(e.get("cat"), e["name"]) for e in events if e["ph"] == "X"}
    assert {("target", "verify"), ("target", "wait"), ("draft", "answer"), ("draft", "predraft")} <= names


def test_partial_chains_are_resumed_exactly(monkeypatch, tiny_pair, ar_ref):
    """Pre-drafting cut short after 2 of 3 steps: the miss path finishes the partial chain."""
    llm, client = local_ssd(monkeypatch, tiny_pair[0], tiny_pair[0], stop_after_steps=2, backup="neural")
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_ref
    snap = llm.engine.spec_metrics()
    # hits only where a request's last round asks for at most the 2 tokens pre-drafted
    assert snap.partial_hits > 0 and snap.hits <= len(PROMPTS)


@pytest.mark.parametrize("how", [dict(predraft=False), dict(stop_after_steps=1), dict(stop_after_steps=2)])
def test_seeded_ssd_output_does_not_depend_on_predraft_timing(monkeypatch, tiny_pair, how):
    """Chains are seeded by (seed, round, k, t): full hits, partial chains and just-in-time drafting give
    the same tokens at temperature > 0."""
    p = [SamplingParams(temperature=1.0, seed=s, max_tokens=16, ignore_eos=True) for s in range(4)]
    full, _ = local_ssd(monkeypatch, tiny_pair[0], tiny_pair[0], backup="neural", saguaro_c=0.5, fanout_budget=3)
    ref = [o.token_ids for o in full.generate(PROMPTS[:4], p)]
    assert full.engine.spec_metrics().hits > 0
    other, _ = local_ssd(monkeypatch, tiny_pair[0], tiny_pair[0], backup="neural", saguaro_c=0.5, fanout_budget=3,
                         **how)
    assert [o.token_ids for o in other.generate(PROMPTS[:4], p)] == ref


def test_ssd_cpu_split_default_threads(monkeypatch):
    from ssd.config import EngineConfig

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    cfg = EngineConfig(model="t", draft="d", mode="ssd")
    LLM._ssd_cpu_split(cfg)
    assert (cfg.threads, cfg.prefill_threads) == (3, 4)      # worker on 1 core; prefill on all 4
    cfg = EngineConfig(model="t", draft="d", mode="ssd", draft_cores=[2, 3], threads=None)
    LLM._ssd_cpu_split(cfg)
    assert cfg.threads == 2
    for kw in (dict(threads=4), dict(draft_host="10.0.0.2:29500")):   # given or remote: untouched
        cfg = EngineConfig(model="t", draft="d", mode="ssd", **kw)
        LLM._ssd_cpu_split(cfg)
        assert cfg.threads == kw.get("threads") and cfg.prefill_threads is None
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    cfg = EngineConfig(model="t", draft="d", mode="ssd")
    LLM._ssd_cpu_split(cfg)                                   # one core: nothing to split
    assert cfg.threads is None


def test_worker_out_of_kv_room_is_a_per_sequence_miss_not_a_dead_worker(monkeypatch, tiny_pair, ar_ref):
    """A worker whose KV pool cannot hold every sequence drops the ones it has no room for and says
    NO_ROOM: those decode without a draft that round and are handed back later; the engine stays in
    SSD, exact, and says so in its metrics (before the fix the worker raised and SSD turned itself off)."""
    target, _ = tiny_pair
    llm, client = local_ssd(monkeypatch, target, target, num_blocks=6, backup="neural")
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ar_ref
    snap = llm.engine.spec_metrics()
    assert llm.engine.degraded_from is None and llm.engine.mode == "ssd"
    assert snap.no_room > 0 and client.worker.stats["no_room"] > 0
    assert snap.hits > 0                       # the sequences it does hold still speculate
    assert not client.worker.seqs              # every sequence released at the end
    bm = client.worker.bm
    assert bm.num_free_blocks == bm.num_blocks - len(bm.block_table(-1))     # only the chain pool is pinned


def test_chain_pool_is_sized_for_the_whole_batch(tiny_pair):
    """80 sequences with a budget of 2 chains each: every sequence gets its chains pre-drafted (a fixed
    pool of 64 regions left most of a big batch without any)."""
    from ssd_local import LocalDraftClient

    from ssd.speculation.worker import messages as m

    n, k = 80, 3
    w = LocalDraftClient(tiny_pair[1], k=k, max_num_seqs=n, fanout_budget=2, num_blocks=4 * n).worker
    assert w.cache.num_regions >= 2 * n
    for i in range(n):
        w.add(m.Add(i, i, 0.0, 0, 1.0, [1 + i % 50, 2, 3, 4, 5]))
    replies = w.speculate([m.Request(i, 0, 7, k) for i in range(n)])       # first round: drafted just in time
    assert all(len(r.tokens) == k and r.source == m.Source.NEURAL for r in replies)
    w.predraft()
    rounds = {i: w.seqs[i].round for i in range(n)}
    assert all(len(w.cache.outcomes(i, rounds[i])) == 2 for i in range(n))
    hit = w.speculate([m.Request(i, k, w.cache.outcomes(i, rounds[i])[-1][1], k) for i in range(n)])
    assert all(r.hit for r in hit)     # the all-accepted outcome with the top bonus was cached for everyone


def test_an_idle_engine_keeps_its_worker(tiny_pair, ar_ref):
    """An engine silent for longer than worker_timeout_s (a server waiting for requests) still has its
    worker afterwards: the worker waits for messages without a time limit, only the engine's waits for
    answers are bounded."""
    import time

    target, draft = tiny_pair
    llm = LLM(str(target), draft=str(draft), mode="ssd", k=3, dtype="float32", progress=False, kv_cache_gb=0.05,
              worker_timeout_s=3)
    try:
        assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == ar_ref[0]
        time.sleep(5)
        assert llm.generate(PROMPTS[1], GREEDY)[0].token_ids == ar_ref[1]
        assert llm.engine.degraded_from is None and llm._client.proc.poll() is None
    finally:
        llm.close()


def test_two_ssd_engines_live_in_one_process(tiny_pair, ar_ref):
    """Each engine/worker link is its own process group (not torch's global one): two SSD engines in
    one process, each with its own worker process, interleave requests and close independently."""
    target, draft = tiny_pair
    kw = dict(draft=str(draft), mode="ssd", k=3, dtype="float32", progress=False, kv_cache_gb=0.05,
              worker_timeout_s=30)
    a = LLM(str(target), **kw)
    b = LLM(str(target), **kw)
    try:
        assert a._client.pid != b._client.pid
        assert [o.token_ids for o in a.generate(PROMPTS[:2], GREEDY)] == ar_ref[:2]
        assert [o.token_ids for o in b.generate(PROMPTS[2:4], GREEDY)] == ar_ref[2:4]
        a.close()
        assert [o.token_ids for o in b.generate(PROMPTS[:1], GREEDY)] == ar_ref[:1]
        assert b.engine.degraded_from is None and b.engine.spec_metrics().rounds > 0
    finally:
        a.close()
        b.close()


def test_worker_start_up_is_not_bounded_by_the_message_timeout(tiny_pair, ar_ref):
    """Starting the worker (a new Python process importing torch, then loading the draft) takes
    seconds; the per-message timeout may be shorter: start-up has its own, longer bound."""
    target, draft = tiny_pair
    llm = LLM(str(target), draft=str(draft), mode="ssd", k=3, dtype="float32", progress=False, kv_cache_gb=0.05,
              worker_timeout_s=1.5)
    try:
        assert llm.generate(PROMPTS[0], GREEDY)[0].token_ids == ar_ref[0]
    finally:
        llm.close()


def test_worker_serves_other_draft_lengths_than_k(tiny_pair):
    """auto asks the worker for a per-sequence draft length <= K: a chain pre-drafted at length n
    serves a shorter ask from its first tokens (a hit, same tokens as the longer answer would start
    with), a longer ask by finishing the chain, and the worker pre-drafts at the length last asked."""
    from ssd_local import LocalDraftClient

    from ssd.speculation.worker import messages as m

    k = 4
    w = LocalDraftClient(tiny_pair[1], k=k, fanout_budget=2).worker
    w.add(m.Add(0, 0, 0.0, 0, 1.0, [5, 6, 7, 8, 9]))
    first = w.speculate([m.Request(0, 0, 7, 3)])[0]          # just in time, 3 of K=4
    assert first.source == m.Source.NEURAL and len(first.tokens) == 3
    w.predraft()
    rnd = w.seqs[0].round
    outcomes = w.cache.outcomes(0, rnd)
    assert outcomes and all(len(w.cache.get(0, rnd, a, b).tokens) == 3 for a, b in outcomes)   # at length 3
    a, b = outcomes[-1]
    chain = list(w.cache.get(0, rnd, a, b).tokens)
    short = w.speculate([m.Request(0, a, b, 2)])[0]
    assert short.source == m.Source.CACHE and short.tokens == chain[:2]
    assert len(w.seqs[0].spec) == 2 and sorted(w.seqs[0].dists) == [0, 1]
    w.predraft()
    rnd = w.seqs[0].round
    a, b = w.cache.outcomes(0, rnd)[-1]
    chain = list(w.cache.get(0, rnd, a, b).tokens)
    assert len(chain) == 2
    longer = w.speculate([m.Request(0, a, b, 4)])[0]         # more than pre-drafted: the chain is finished
    assert longer.source == m.Source.PARTIAL and longer.tokens[:2] == chain and len(longer.tokens) == 4


@pytest.mark.parametrize("control", [False, True])
def test_a_program_that_never_closes_its_ssd_engine_exits_cleanly(tiny_pair, ar_ref, control):
    """A script that generates with SSD and ends without LLM.close(): the worker and its link are
    stopped at interpreter exit, before torch is torn down. The control removes that exit hook: the
    process then aborts (SIGABRT) on a torch internal assert about a tensor still in use."""
    import subprocess
    import sys
    import textwrap

    from ssd.speculation.worker.client import _child_env

    target, draft = tiny_pair
    code = textwrap.dedent(f"""
        import ssd.speculation.worker.client as client
        if {control}:
            client._close_at_exit = lambda ref: (lambda: None)
        from ssd import LLM, SamplingParams
        llm = LLM({str(target)!r}, draft={str(draft)!r}, mode="ssd", k=3, dtype="float32", progress=False,
                  kv_cache_gb=0.05)
        print(llm.generate({PROMPTS[0]!r}, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0].token_ids)
    """)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=_child_env())
    assert p.stdout.strip() == str(ar_ref[0])
    assert (p.returncode == 0 and "INTERNAL ASSERT" not in p.stderr) != control, p.stderr[-2000:]
