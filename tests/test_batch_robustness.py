"""Batch robustness in AR, SD and SSD on tiny random models: a request's tokens must not depend on
its batch mates, its row in the batch, requests arriving or finishing around it mid-run, whether
SSD pre-drafted or drafted just in time, or preemption (free + recompute) under a small KV cache.

Greedy rows are compared with AR run one request at a time; seeded sampled rows (temperature 0.9
with top-k/top-p) with the same request run alone on the same engine. SSD uses backup="neural"
(backup="auto" picks the backup by batch size by design) and a fixed fan-out, with its worker
in-process (tests/ssd_local.py) so its state can be inspected. The draft is a perturbed copy of the
target: rounds accept some draft tokens and reject others, so the residual path and, in SSD, cache
hits and misses all occur."""
from __future__ import annotations

import pytest

from ssd import LLM, SamplingParams

from conftest import perturbed_copy
from ssd_local import local_ssd

K = 3


def greedy(n: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def seeded(seed: int, n: int = 16, temperature: float = 0.9, top_k: int = 20, top_p: float = 0.9) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, max_tokens=n,
                          ignore_eos=True)


def unseeded(n: int, temperature: float = 1.0, **kw) -> SamplingParams:
    return SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, **kw)


# the requests whose tokens are checked ...
R = ("hello world", seeded(4242))                                   # seeded, top-k and top-p
S = ("def f(x):\n    return", seeded(7, n=20, temperature=1.2, top_k=0, top_p=0.95))
G = ("The quick brown fox", greedy(18))
# ... and batch mates of other prompts, lengths and params, some unseeded (different every run)
MATES = [("xyz", unseeded(30)),
         ("abc def ghi jkl mno pqr stu vwx", greedy(5)),                # two 16-token blocks, finishes early
         ("q", seeded(3, n=25, temperature=0.5, top_k=0, top_p=0.8)),
         ("hello world", unseeded(12, temperature=1.3, top_k=5)),       # R's prompt: shares its prefix blocks
         ("zzzz zzzz zzzz zzzz zzzz", unseeded(9, temperature=0.7, top_p=0.5))]


@pytest.fixture(scope="module")
def near_draft(tiny_pair, tmp_path_factory):
    """A draft close to the target (a perturbed copy): partial acceptances, cache hits and misses."""
    return perturbed_copy(tiny_pair[0], tmp_path_factory.mktemp("robust-near-draft"), 0.03, seed=11)


@pytest.fixture(scope="module")
def ar_alone(tiny_pair):
    """Greedy AR tokens of one request run alone (memoized)."""
    llm = LLM(str(tiny_pair[0]), dtype="float32", progress=False)
    memo = {}

    def get(prompt: str, params: SamplingParams) -> list[int]:
        assert params.greedy
        key = (prompt, params.max_tokens)
        if key not in memo:
            memo[key] = llm.generate(prompt, params)[0].token_ids
        return memo[key]

    return get


def build(mode, tiny_pair, draft, monkeypatch, predraft=True, **llm_kw):
    """(llm, in-process SSD client or None) for mode ar | sd | ssd | ssd2 (two SSD draft workers: the
    client is then the list of both)."""
    target = tiny_pair[0]
    if mode in ("ssd", "ssd2"):
        return local_ssd(monkeypatch, target, draft, k=K, llm_kw=llm_kw, predraft=predraft, backup="neural",
                         fanout_budget=3, workers=2 if mode == "ssd2" else 1)
    if mode in ("sd", "auto"):
        return LLM(str(target), draft=str(draft), mode=mode, k=K, dtype="float32", progress=False, **llm_kw), None
    return LLM(str(target), dtype="float32", progress=False, **llm_kw), None


def stand_ins(client) -> list:
    """The in-process SSD worker stand-ins of build()'s second result."""
    return [] if client is None else client if isinstance(client, list) else [client]


def run(llm, reqs):
    return [o.token_ids for o in llm.generate([p for p, _ in reqs], [sp for _, sp in reqs])]


def drive(llm, plan, max_steps=3000):
    """Step the engine by hand; plan = [(step, request_id, prompt, params)]: each request is added
    just before engine step number `step`. -> (tokens by id, sequences by id, running-set size after
    every step)."""
    eng = llm.engine
    pending = sorted(plan, key=lambda x: x[0])
    seqs, sizes, step = {}, [], 0
    while pending or eng.has_unfinished():
        while pending and pending[0][0] <= step:
            _, rid, prompt, params = pending.pop(0)
            seqs[rid] = eng.add_request(rid, llm.encode(prompt), params)
        eng.step()
        sizes.append(len(eng.scheduler.running))
        step += 1
        assert step < max_steps, "the engine made no progress"
    assert all(s.finished for s in seqs.values())
    return {rid: list(s.output_token_ids) for rid, s in seqs.items()}, seqs, sizes


def shrank_then_grew(sizes):
    """The running set lost a sequence (one finished) and later gained one (an arrival) mid-run."""
    return any(0 < sizes[j] < sizes[j - 1] and max(sizes[j + 1:], default=0) > sizes[j]
               for j in range(1, len(sizes)))


# ---- 1. batch independence and row-permutation equivariance ----------------------------------------

@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_rows_do_not_depend_on_batch_mates_or_their_row(monkeypatch, tiny_pair, near_draft, ar_alone, mode):
    llm, _ = build(mode, tiny_pair, near_draft, monkeypatch)
    before = llm.engine.spec_metrics()
    alone = {name: run(llm, [req])[0] for name, req in (("R", R), ("S", S), ("G", G))}
    assert alone["G"] == ar_alone(*G)                                  # greedy is the target's greedy
    assert run(llm, [(R[0], seeded(4243))])[0] != alone["R"]          # the seed matters (the test can fail)
    m = MATES
    batches = [
        [m[0], R, m[1], G],
        [G, m[2], m[3], R, S, m[0]],          # R next to an unseeded request of the same prompt
        [R, S, G],
        [S, G, R],                            # a permutation of the previous batch
        [G, R, S],
        [m[4], R, m[3], R, m[1], S],          # the same seeded request twice
    ]
    names = {id(R): "R", id(S): "S", id(G): "G"}
    for reqs in batches:
        out = run(llm, reqs)
        for row, req in enumerate(reqs):
            if id(req) in names:
                name = names[id(req)]
                assert out[row] == alone[name], f"{mode}: {name} at row {row} of a batch of {len(reqs)}"
    assert not llm.engine.has_unfinished() and llm.engine.degraded_from is None
    if mode == "ssd":   # the cache served rounds and the backup the others
        d = llm.engine.spec_metrics().delta(before)
        assert d.hits > 0 and d.misses > 0


# ---- 2. SSD just in time (no pre-drafting) = SSD with the cache -------------------------------------

def test_ssd_just_in_time_equals_cached_across_arrival_orders_and_mates(monkeypatch, tiny_pair, near_draft,
                                                                         ar_alone):
    cached, _ = build("ssd", tiny_pair, near_draft, monkeypatch)
    jit, jit_client = build("ssd", tiny_pair, near_draft, monkeypatch, predraft=False)
    T = ("abab abab abab", seeded(99, n=14, temperature=0.8, top_k=8, top_p=1.0))
    named = {"R": R, "S": S, "T": T}
    c0 = cached.engine.spec_metrics()
    ref = {n: run(cached, [req])[0] for n, req in named.items()}       # each alone, from the cache
    c1 = cached.engine.spec_metrics()
    assert c1.delta(c0).hits > 0
    j0 = jit.engine.spec_metrics()
    for order in (["R", "S", "T"], ["T", "S", "R"], ["S", "R", "T"]):
        reqs = [MATES[0]] + [named[n] for n in order] + [G, MATES[2]]
        out = run(jit, reqs)
        for row, n in enumerate(order, start=1):
            assert out[row] == ref[n], f"just in time, {n} at row {row} of {len(reqs)}"
        assert out[len(order) + 1] == ar_alone(*G)
    # arrival mid-run: the seeded requests join a batch that is already decoding, in both engines
    plan = [(0, "m0", *MATES[0]), (0, "m4", *MATES[4]), (0, "G", *G), (2, "R", *R), (3, "T", *T), (5, "S", *S),
            (6, "m2", *MATES[2])]
    for llm in (jit, cached):
        got, _, sizes = drive(llm, plan)
        assert {n: got[n] for n in named} == ref and got["G"] == ar_alone(*G)
        assert max(sizes) >= 5
    d = jit.engine.spec_metrics().delta(j0)
    assert d.rounds > 0 and d.hits == 0 and d.misses > 0              # every round drafted just in time
    assert cached.engine.spec_metrics().delta(c1).hits > 0
    assert not jit_client.worker.seqs


# ---- 3. batches that grow and shrink within one run -------------------------------------------------

# up to 4 running (max_num_seqs=4, more wait), very different max_tokens: requests finish at
# different times while others arrive
PLAN_PROMPTS = ["hello world", "abc", "def f(x):\n    return", "z" * 37, "The quick brown fox", "x y z w"]
PLAN_STEPS = [0, 0, 2, 3, 6, 14]
PLAN_LENS = [40, 4, 22, 8, 30, 12]
CONFIGS = [("ar", None), ("sd", None), ("sd", 2), ("ssd", None), ("ssd", 2), ("ssd2", None), ("auto", None)]
CONFIG_IDS = [f"{m}-specmax{s}" for m, s in CONFIGS]


def make_plan(params):
    return [(st, f"r{i}", p, sp) for i, (st, p, sp) in enumerate(zip(PLAN_STEPS, PLAN_PROMPTS, params))]


def check_speculation(llm, mode, spec_max_batch, seqs):
    if mode == "ar":
        return
    if mode == "auto":          # its choices depend on measured timings: only that it decided every round
        m = llm.engine.spec_metrics()
        assert sum(m.rows_by_num_draft) > 0
        return
    if mode in ("ssd", "ssd2"):
        assert llm.engine.spec_metrics().hits > 0
    drafted = {r: (s.spec.proposed_by_pos or [0])[0] for r, s in seqs.items()}   # rounds that drafted
    one_token = {r: s.spec.rounds - drafted[r] for r, s in seqs.items()}      # one-token rounds
    assert drafted["r0"] > 0
    if spec_max_batch is not None:   # some rounds were one-token (batch > 2), then speculation resumed
        assert any(one_token[r] >= 2 and drafted[r] >= 1 for r in seqs)


@pytest.mark.parametrize("mode,spec_max_batch", CONFIGS, ids=CONFIG_IDS)
def test_growing_and_shrinking_batch_greedy_equals_ar_one_at_a_time(monkeypatch, tiny_pair, near_draft,
                                                                     ar_alone, mode, spec_max_batch):
    kw = {"max_num_seqs": 4} | ({"spec_max_batch": spec_max_batch} if spec_max_batch else {})
    llm, client = build(mode, tiny_pair, near_draft, monkeypatch, **kw)
    params = [greedy(n) for n in PLAN_LENS]
    got, seqs, sizes = drive(llm, make_plan(params))
    assert max(sizes) == 4 and shrank_then_grew(sizes)
    for i, (p, sp) in enumerate(zip(PLAN_PROMPTS, params)):
        assert got[f"r{i}"] == ar_alone(p, sp), f"{mode}: request r{i}"
    check_speculation(llm, mode, spec_max_batch, seqs)
    assert llm.engine.degraded_from is None
    bm = llm.engine.target.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    for c in stand_ins(client):
        assert not c.worker.seqs


@pytest.mark.parametrize("mode,spec_max_batch", [c for c in CONFIGS if c[1] is None and c[0] != "auto"],
                         ids=[i for c, i in zip(CONFIGS, CONFIG_IDS) if c[1] is None and c[0] != "auto"])
def test_growing_and_shrinking_batch_seeded_equals_alone(monkeypatch, tiny_pair, near_draft, mode, spec_max_batch):
    """README: the same request + seed gives the same tokens alone or in any batch (AR, SD, SSD with
    backup="neural"). Not with spec_max_batch or in auto mode (documented exceptions): a round without a speculation
    draws one uniform from the request's generator, a speculative round the draft's samples and
    num_draft + 1 verify uniforms, so which rounds speculate (i.e. the batch size) changes the tokens."""
    kw = {"max_num_seqs": 4} | ({"spec_max_batch": spec_max_batch} if spec_max_batch else {})
    llm, _ = build(mode, tiny_pair, near_draft, monkeypatch, **kw)
    params = [seeded(100 + i, n=n, temperature=(0.9, 1.1, 0.7)[i % 3], top_k=(20, 0, 6)[i % 3],
                     top_p=(0.9, 0.95, 1.0)[i % 3]) for i, n in enumerate(PLAN_LENS)]
    params[1] = unseeded(PLAN_LENS[1])                      # an unseeded mate
    alone = {f"r{i}": llm.generate(p, sp)[0].token_ids for i, (p, sp) in enumerate(zip(PLAN_PROMPTS, params))
             if sp.seed is not None}
    got, seqs, sizes = drive(llm, make_plan(params))
    assert max(sizes) >= 3 and shrank_then_grew(sizes)     # (the unseeded mate's length in rounds varies)
    assert {r: got[r] for r in alone} == alone
    check_speculation(llm, mode, spec_max_batch, seqs)


# ---- 4. preemption in SD and SSD --------------------------------------------------------------------

# float32 KV of the tiny model: 2 layers x (K, V) x 2 heads x 16 dims x 4 bytes = 512 bytes a token;
# 24 blocks of 4 tokens hold 96 tokens, far fewer than the requests below need together
SMALL_KV = dict(kv_cache_gb=96 * 512 / 2**30, block_size=4)


@pytest.mark.parametrize("mode,spec_max_batch", [("sd", None), ("sd", 2), ("ssd", None), ("ssd", 2), ("ssd2", None),
                                                 ("auto", None)],
                         ids=["sd", "sd-specmax2", "ssd", "ssd-specmax2", "ssd2", "auto"])
def test_preemption_greedy_equals_ar_and_frees_everything(monkeypatch, tiny_pair, near_draft, ar_alone, mode,
                                                          spec_max_batch):
    kw = SMALL_KV | ({"spec_max_batch": spec_max_batch} if spec_max_batch else {})
    llm, client = build(mode, tiny_pair, near_draft, monkeypatch, **kw)
    tbm = llm.engine.target.block_manager
    assert tbm.num_blocks == 24
    prompts = ["hello world", "abc", "def f(x):\n    return", "z" * 37, "The quick brown fox", "x y z w"]
    lens = [24, 24, 10, 24, 16, 24]
    plan = [(st, f"r{i}", p, greedy(n)) for i, (st, p, n) in enumerate(zip([0, 0, 0, 1, 4, 9], prompts, lens))]
    got, _, _ = drive(llm, plan)
    assert llm.engine.scheduler.num_preemptions > 0                   # preemption really happened
    for i, (p, n) in enumerate(zip(prompts, lens)):
        assert got[f"r{i}"] == ar_alone(p, greedy(n)), f"{mode}: request r{i}"
    assert llm.engine.degraded_from is None and llm.engine.mode == mode.rstrip("2")
    managers = [tbm] + ([llm.engine.draft.block_manager] if mode in ("sd", "auto") else [])
    for bm in managers:
        bm.check_invariants()
        assert bm.num_free_blocks == bm.num_blocks
    for c in stand_ins(client):
        w = c.worker
        assert not w.seqs                                             # the worker holds no sequence
        assert w.bm.num_free_blocks == w.bm.num_blocks - len(w.bm.block_table(-1))   # only the chain pool
        assert w.cache.free_regions == w.cache.num_regions and len(w.cache) == 0     # no region leaked
