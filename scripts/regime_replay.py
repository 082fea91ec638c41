"""Replay a regime log (from scripts/auto_regime_log.py) against the current RegimePolicy (a diagnostic).

Usage: .venv/bin/python scripts/regime_replay.py <log> [--equal]

The log holds, at every stint end, what the stint measured per batch-size bucket (tokens, seconds,
rounds) and the predictions the model made then. Fed those, the policy in the working tree decides each
stint end again; the replay reports the first stint end where it decides differently from the log (the
observations after it would be of another regime, so it stops there), or that every decision matched.
A policy change that should have changed a logged decision can be checked this way without a bench run;
what the changed decision would then have measured is not known. Limits: the predictions are logged to
0.1 tok/s, so a near-tie can replay differently from the log even with the policy that wrote it; the
predictions are replayed as logged, so a change to the model behind them (SpeculativeStep.predicted_rate)
is not replayed; a worker that failed mid-run is not in the log.
"""
from __future__ import annotations

import argparse
import ast
import re
import sys

from ssd.speculation.regime import LOCAL, WORKER, RegimePolicy

CLOSE = re.compile(r"\[regime\] round (\d+) close stint (\w+) bucket (\d+): (\d+) tok / ([\d.]+)s = .* in (\d+) rounds")
DECIDE = re.compile(r"\[regime\] round (\d+) b=(\d+) (\w+) -> (\w+) predict (\{.*?\}|None) ")


def parse(path: str) -> list[dict]:
    """Stint ends in order: {'round', 'batch', 'from', 'to', 'predict', 'shares': [(bucket, tok, sec, n)]}."""
    stints, shares = [], []
    with open(path, errors="replace") as f:
        for line in f:
            if m := CLOSE.search(line):
                shares.append((int(m[3]), float(m[4]), float(m[5]), int(m[6])))
            elif m := DECIDE.search(line):
                pred = ast.literal_eval(m[5])
                stints.append({"round": int(m[1]), "batch": int(m[2]), "from": m[3], "to": m[4],
                               "predict": pred, "shares": shares})
                shares = []
    return stints


def replay(stints: list[dict], equal: bool = False) -> tuple[int, dict | None, RegimePolicy]:
    """(stint ends matched, the first that did not or None, the policy)."""
    p = RegimePolicy(start=LOCAL if equal else WORKER, worker_waits=equal)
    p.await_prediction = not equal
    p.pick(1)
    for i, st in enumerate(stints):
        rounds = [(b, tok / n, sec / n) for b, tok, sec, n in st["shares"] for _ in range(n)]
        pred = st["predict"]
        predict = None if pred is None else (lambda r, pred=pred: pred.get(r))
        for j, (b, tok, sec) in enumerate(rounds):
            p.observe(1 << b if b else 1, tok, sec)
            if j < len(rounds) - 1:
                p.pick(1 << b if b else 1)
        got = p.pick(st["batch"], predict)
        if got != st["to"]:
            return i, {**st, "replayed": got}, p
    return len(stints), None, p


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--equal", action="store_true", help="the log is of the equal placement (worker_waits)")
    args = ap.parse_args(argv)
    stints = parse(args.log)
    n, diff, p = replay(stints, args.equal)
    print(f"{len(stints)} stint ends in the log; {n} replayed alike")
    if diff is not None:
        print(f"first difference at round {diff['round']} (batch {diff['batch']}): log {diff['from']} -> "
              f"{diff['to']}, replayed -> {diff['replayed']}; predict {diff['predict']}")
        print(f"rates {p.rate}\ncalibration {p.calibration}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
