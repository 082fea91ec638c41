"""scripts/regime_replay.py: a regime log replays alike against the policy that wrote it, and a logged
decision the policy would not take is reported (the script is how regime changes are checked offline)."""
from __future__ import annotations

import importlib.util
from pathlib import Path

spec = importlib.util.spec_from_file_location("regime_replay",
                                              Path(__file__).parents[1] / "scripts" / "regime_replay.py")
replay_mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(replay_mod)


def stint(rnd: int, regime: str, tok: int, sec: float, after: str, predict: str, batch: int = 1) -> str:
    """The two lines scripts/auto_regime_log.py writes at a stint end (one bucket)."""
    return (f"[regime] round {rnd} close stint {regime} bucket {max(batch - 1, 0).bit_length()}: {tok} tok / "
            f"{sec:.2f}s = {tok / sec:.1f} tok/s in 16 rounds; rates {{}} calib {{}}\n"
            f"[regime] round {rnd} b={batch} {regime} -> {after} predict {predict} pruned 0 deferred 0 "
            f"probing None\n")


def test_a_log_the_policy_wrote_replays_alike_and_a_different_decision_is_found(tmp_path, capsys):
    # the worker measures 20 tok/s, predicted 20; the local regime predicted 12: its visit is pruned
    lines = [stint(17 + 16 * i, "worker", 40, 2.0, "worker", "{'local': 12.0, 'worker': 20.0}") for i in range(4)]
    log = tmp_path / "regime.log"
    log.write_text("noise before\n" + "".join(lines))
    stints = replay_mod.parse(str(log))
    assert len(stints) == 4 and stints[0]["shares"] == [(0, 40.0, 2.0, 16)]
    n, diff, _ = replay_mod.replay(stints)
    assert n == 4 and diff is None
    # the negative control: a log that says the local regime was visited at the third stint end
    lines[2] = lines[2].replace("worker -> worker", "worker -> local")
    log.write_text("".join(lines))
    n, diff, _ = replay_mod.replay(replay_mod.parse(str(log)))
    assert n == 2 and diff["round"] == 49 and diff["replayed"] == "worker"
    replay_mod.main([str(log)])
    assert "first difference at round 49" in capsys.readouterr().out
