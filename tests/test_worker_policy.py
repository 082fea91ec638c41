"""The draft worker's pure parts, without a model: pre-draft budget and backup policies with injected
timings, the typed messages' wire round trip, and the speculation cache's keying and regions."""
from __future__ import annotations

import pytest
import torch

from ssd.speculation.fanout import budget_from_timings
from ssd.speculation.worker import messages as m
from ssd.speculation.worker.cache import Chain, SpeculationCache
from ssd.speculation.worker.policy import BackupPolicy, BudgetPolicy


def test_backup_choice_flips_at_the_critical_batch_size():
    b = BackupPolicy("auto", k=4)
    b.hit_rate.value, b.verify_s, b.jit_s.value = 0.6, 0.10, 0.04   # b* = 4 for these numbers
    b.tokens_per_round["cache"].value = b.tokens_per_round["neural"].value = 3.5
    b.tokens_per_round["fast"].value = 1.3
    b_star = b.critical_batch()
    assert b_star == 4
    assert b.choose(1) == "neural" and b.choose(b_star) == "fast"
    b.jit_s.value = 0.30                                     # slower just-in-time drafting: flips earlier
    assert b.critical_batch() < b_star
    assert BackupPolicy("neural", 4).choose(10_000) == "neural"      # a fixed choice wins
    with pytest.raises(ValueError, match="backup"):
        BackupPolicy("fastest", 4)


def test_predraft_budget_sizes_itself_to_the_verify_time():
    p = BudgetPolicy(k=3, step_s=0.010, row_cost=0.25)
    p.verify_s = 0.100
    # K=3 steps over R rows after one catch-up step: 0.01 + 3 * 0.01 * (1 + 0.25 (R - 1)) <= 0.09
    # -> R <= 7.67: 7 chains for one sequence, 3 each for two
    assert p.budget(1, cap=64) == 7 == budget_from_timings(0.1, 0.01, 3, 1, row_cost=0.25, overhead_s=0.01)
    assert p.budget(2, cap=32) == 3
    assert p.budget(1, cap=4) == 4                           # capped by the chain pool's share
    p.verify_s = 0.02                                        # not even one chain fits: still try one
    assert p.budget(1, cap=64) == 1
    p.verify_s = 0.1
    p.observe_predraft(1, 7, completed=True, took_s=2 * (0.01 + 3 * 0.01 * 2.5))   # twice the model
    assert p.slowdown.value == pytest.approx(1.2)            # EMA, alpha 0.2
    assert p.budget(1, cap=64) == 5                          # 0.012 + 3*0.012*(1+0.25(R-1)) <= 0.09
    before = p.slowdown.value
    p.observe_predraft(1, 5, completed=False, took_s=0.01)   # cut short: slower than allowed, not faster
    assert p.slowdown.value > before
    assert BudgetPolicy(k=3).budget(1, cap=64) == 1          # no timings yet: one chain
    assert BudgetPolicy(k=3, fixed=2).budget(1, cap=64) == 2


def test_predraft_budget_counts_the_steps_of_the_chains_asked_for():
    """auto asks a worker started with K = 4 for shorter drafts; its chains are then that long, so the
    budget and the slowdown must count their steps, not K's (with K's, auto's worker pre-drafted 1.5-1.7
    chains per round where fixed SSD at K = 2 pre-drafted 1.9-2.1)."""
    short = BudgetPolicy(k=4, step_s=0.010, row_cost=0.25)
    two = BudgetPolicy(k=2, step_s=0.010, row_cost=0.25)
    short.verify_s = two.verify_s = 0.100
    assert short.budget(1, cap=64, steps=2) == two.budget(1, cap=64) > short.budget(1, cap=64)
    took = 0.01 + 2 * 0.01 * (1 + 0.25 * (two.budget(1, cap=64) - 1))     # exactly as modelled
    short.observe_predraft(1, two.budget(1, cap=64), completed=True, took_s=took, steps=2)
    assert short.slowdown.value == pytest.approx(1.0)
    short.observe_predraft(1, two.budget(1, cap=64), completed=True, took_s=took)   # priced as 4 steps
    assert short.slowdown.value < 0.95


def _roundtrip(msg, vocab=None):
    kind, ints, floats = m.encode(msg)
    return m.decode(int(kind), ints, floats, vocab)


def test_messages_round_trip():
    cfg = m.WorkerConfig("qwen2.5-coder-0.5b", "q4_1", 4, 151936, 1000, 16, 4096, 16, None, 0.5, "fast")
    assert _roundtrip(cfg) == cfg
    assert _roundtrip(m.Hello(128, 4242)) == m.Hello(128, 4242)
    assert _roundtrip(m.Error("no such file: é")) == m.Error("no such file: é")
    add = m.Add(7, 2**63 - 1, 0.8, 3, 0.9, [1, 2, 3])
    back = _roundtrip(add)
    assert (back.seq_id, back.seed, back.top_k, back.tokens) == (7, 2**63 - 1, 3, [1, 2, 3])
    assert back.temperature == pytest.approx(0.8) and back.top_p == pytest.approx(0.9)
    assert _roundtrip(m.Free([1, 5])) == m.Free([1, 5])
    spec = m.Speculate([m.Request(1, 2, 33, 4), m.Request(5, 0, 7, 0)], 0.125)
    assert _roundtrip(spec) == spec
    q = torch.softmax(torch.randn(2, 6), -1)
    ans = m.Speculation([m.Reply(1, m.Source.CACHE, [3, 4], q), m.Reply(5, m.Source.NO_ROOM, []),
                         m.Reply(9, m.Source.FAST, [1])], 12, 0.5, [(m.SpanKind.PREDRAFT, 1.0, 1.25)], 300, 0.75)
    back = _roundtrip(ans, vocab=6)
    assert [(r.seq_id, r.source, r.tokens) for r in back.replies] == [(1, m.Source.CACHE, [3, 4]),
                                                                       (5, m.Source.NO_ROOM, []), (9, m.Source.FAST, [1])]
    assert torch.equal(back.replies[0].probs, q) and back.replies[2].probs is None and back.replies[0].hit
    assert (back.chains_drafted, back.busy_s, back.spans) == (12, 0.5, [(m.SpanKind.PREDRAFT, 1.0, 1.25)])
    assert (back.prefill_tokens, back.prefill_s) == (300, 0.75)
    with pytest.raises(ValueError, match="fanout_budget"):
        m.WorkerConfig("d", "auto", 4, 10, 10, 16, 64, 1, fanout_budget=0)     # 0 is not "auto"


def _chain(acc, bonus, n=3, tokens=(1, 2, 3)):
    return Chain(acc, bonus, n, torch.Generator(), list(tokens))


def test_cache_serves_a_chain_only_for_its_round_and_outcome_and_frees_regions():
    cache = SpeculationCache(num_regions=4, k=3, slots=torch.arange(12))
    c = _chain(1, 7)
    c.region = cache.take_region()
    cache.put(0, 10, c)
    assert cache.get(0, 10, 1, 7) is c and cache.hits == 1
    assert cache.get(0, 11, 1, 7) is None             # another round: never served
    assert cache.get(0, 10, 2, 7) is None and cache.get(1, 10, 1, 7) is None
    partial = _chain(0, 5, tokens=(4,))
    cache.put(0, 10, partial)
    assert cache.get(0, 10, 0, 5) is partial and cache.hits == 1     # found, but a partial chain is no hit
    with pytest.raises(KeyError):
        cache.put(0, 10, _chain(1, 7))
    assert cache.outcomes(0, 10) == [(0, 5), (1, 7)] and cache.has_round(0, 10)
    assert cache.free_regions == 3
    cache.put(0, 11, _chain(2, 2))                     # a newer round replaces the old one's chains
    assert cache.free_regions == 4 and cache.outcomes(0, 11) == [(2, 2)] and not cache.has_round(0, 10)
    assert cache.drop(0) == 1 and len(cache) == 0
    assert torch.equal(cache.region_slots(2), torch.tensor([6, 7, 8]))
