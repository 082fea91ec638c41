"""scripts/auto_trace_sim.py: the replay's accounting on hand-made traces, and that auto's real Chooser
runs in it (the script is how chooser changes are checked offline before a bench)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

spec = importlib.util.spec_from_file_location("auto_trace_sim",
                                              Path(__file__).parents[1] / "scripts" / "auto_trace_sim.py")
sim = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sim)

TARGET = {1: 50.0, 2: 60.0, 3: 70.0, 4: 80.0, 5: 90.0}


def test_a_fixed_k_commits_what_the_trace_accepts_at_the_priced_round_times():
    # 13 positions after the first token; the draft matches every token: K=2 commits 3 per round
    trace = [4] * 12
    rate = sim.replay([trace], TARGET, 10.0, 2, 0.0, 0.0, False, 0)
    rounds = 4                       # 3 + 3 + 3 + 3 tokens (the last round is capped at what is left)
    assert rate == pytest.approx(12 / (rounds * (70.0 + 20.0)) * 1e3)
    # a draft that never matches: every round commits the target's token only; the last two rounds are
    # capped by what is left (K=1: 60 + 10 ms, then a plain step: 50 ms)
    never = sim.replay([[0] * 12], TARGET, 10.0, 2, 0.0, 0.0, False, 0)
    assert never == pytest.approx(12 / (10 * 90.0 + 70.0 + 50.0) * 1e3)


def test_auto_drafts_long_where_the_draft_always_matches_and_not_where_it_never_does():
    good = sim.replay([[4] * 63] * 4, TARGET, 5.0, "auto", 0.0, 0.0, False, 0)
    bad = sim.replay([[0] * 63] * 4, TARGET, 5.0, "auto", 0.0, 0.0, False, 0)
    plain = 1e3 / TARGET[1]
    assert good > 2 * plain          # drafting pays (K=4 throughout would be 5 tokens / 110 ms = 2.27x)
    assert bad == pytest.approx(plain, rel=0.1)      # it stops drafting (probes aside)
