"""Run `ssd bench` with auto_ssd's regime decisions logged to stderr (a diagnostic, not part of the engine).

Usage: .venv/bin/python scripts/auto_regime_log.py <ssd bench arguments> 2> regime.log

Every stint end prints the stint's measured rate per batch-size bucket, the policy's estimates and
calibrations, the predicted rate of each regime and the choice; every worker prediction prints the
worker rounds' fits (target line, cache-hit rates, miss wait, retake price) it came from. It wraps
RegimePolicy.pick / _close_stint and SpeculativeStep.predicted_rate, so it follows their signatures.
"""
import sys

from ssd.speculation import regime as R
from ssd.speculation import step as S
orig_close = R.RegimePolicy._close_stint
def close(self):
    for b, (tok, sec, *n) in self._acc.items():
        print(f"[regime] round {self.rounds} close stint {self.current} bucket {b}: {tok:.0f} tok / {sec:.2f}s = {tok/max(sec,1e-9):.1f} tok/s in {n[0] if n else '?'} rounds; rates {dict((k, round(v,1)) for k,v in self.rate.items())} calib {dict((k, round(v,2)) for k,v in self.calibration.items())}", file=sys.stderr, flush=True)
    return orig_close(self)
R.RegimePolicy._close_stint = close
orig_pick = R.RegimePolicy.pick
def pick(self, batch_size, predict=None):
    cur = self.current; at_end = self.enabled and self._stint >= self.dwell
    preds = None
    if at_end and predict is not None:
        preds = {}
        for r in (R.LOCAL, R.WORKER):
            v = predict(r)
            preds[r] = None if v is None else round(v, 1)
    out = orig_pick(self, batch_size, predict)
    if at_end:
        print(f"[regime] round {self.rounds} b={batch_size} {cur} -> {out} predict {preds} pruned {self.pruned} deferred {self.deferred} probing {self._probing}", file=sys.stderr, flush=True)
    return out
R.RegimePolicy.pick = pick
orig_pr = S.SpeculativeStep.predicted_rate
def pr(self, seqs, regime, retake=True):
    out = orig_pr(self, seqs, regime, retake)
    if regime == R.WORKER and self.worker_chooser is not None and retake:     # (not _worker_loses_anyway's)
        c = self.worker_chooser.cost; w = c.worker
        acc = self.worker_chooser.acceptance([s.seq_id for s in seqs])
        print(f"[pred] worker n={len(seqs)} -> {out} unit {c.unit} line {[round(x,3) for x in c.target.w.tolist()]} hfull {w.h_full.value:.2f} hpart {w.h_part.value:.2f} hit_s {w.hit_s.value:.3f} per_tok {w.per_token_s.value:.3f} retake {w.retake_s.value:.4f} prefill/token {(self.worker.prefill_s_per_token() or 0) / (c.unit or 1):.4f} rounds {w.rounds} acc {[round(a,2) for a in acc]}", file=sys.stderr, flush=True)
    return out
S.SpeculativeStep.predicted_rate = pr
from ssd.cli import main
sys.argv = ["ssd"] + sys.argv[1:]
main()
