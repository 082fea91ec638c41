"""mode="auto" with a draft worker (`auto_ssd`): which proposer serves the next rounds, the worker
(SSD: the draft runs on its own cores, overlapped with verification) or the in-process draft (AR /
SD with per-sequence K chosen by `chooser.py`, the target using every core) (docs/ARCHITECTURE.md 4.1).

The two regimes cannot be compared by a cost model fitted in one of them (SSD's rate depends on
cache hits, the worker's slack and on the target having fewer cores), so both are measured: a
regime runs for a stint of `dwell` rounds, and a stint's rate (committed tokens / its wall time,
switching costs included: the worker catching up, the first rounds with nothing pre-drafted) updates
that regime's estimate for the batch-size bucket it ran at (once `min_rounds` rounds there, pooled over
stints, have measured it). After a stint the policy switches when
the other regime is estimated `hysteresis` faster, or when its estimate is missing or older than
`probe_every` rounds (exploration), or, before that, when the model now predicts the other
regime (scaled by its calibration, below) clearly faster than the current one measures (`early`:
the requests changed since it was measured; a chat set after a code set at batch 4 ran 100% SSD
rounds at 0.84x AR in the paper placement, the local regime measured on the code set and its next
probe a backed-off interval away). A probe that loses (the policy goes back) doubles the interval
between that regime's probes at that bucket, up to `max_probe_every`; one that wins resets it: a stable
winner pays for fewer and fewer probes, each of which costs a stint in the slower regime and two
switches. The intervals are per regime: a regime left for the other without losing a probe (the other
measured or predicted faster for the requests of the moment) is probed again at its own interval, not at
the one the other regime's lost probes earned (paper placement, batch 1, `mixed`: the local regime had
lost a probe, so the interval was 256 rounds; the worker, left for one chat request, then waited those
256 rounds while SSD k=2 ran about 1.2x the local regime on the code requests that followed).
A local estimate that rests on one stint measured far below the model's prediction (DOUBTFUL_RATIO), or
from 3 rows up (PROVEN_BUCKET) on one stint at all, is re-measured early too, once, unless even the
uncalibrated prediction is clearly slower (`_doubtful`; paper placement, batch 4: one local stint at 0.77
of its prediction kept the worker serving ~240 rounds at 0.81 and 0.91 of AR; on an AVX2 host one at 0.91
kept it ~190 rounds while SSD k=2 ran 0.80-0.91 of AR). From 3 rows up the local regime's first visit is
not pruned either (`_plain_first_visit`): a stint of its mostly plain rounds costs about what AR does.

Measured rates are of the requests that ran then: where the model predicts both regimes for the
requests running now and both have calibrated stints at this bucket (below), a stint end compares the
calibrated predictions instead (`restated` counts these). In the paper placement at batch 1 one worker
stint measured 14.8 tok/s on slow chat requests; the local regime then measured 18-21 on the
following ones and kept every stint for hundreds of rounds while SSD k=2 ran 1.2x it there.

Where the caller can predict the other regime's rate from a model (`pick(..., predict=...)`: auto_ssd
from the fits of the rounds it ran, see SpeculativeStep.predicted_rate), a probe or first visit is
skipped when that prediction is `prune` short of the current regime's measured rate; a skipped probe
backs off like a lost one (`pruned` counts the stint ends at which a visit was skipped). The
prediction is scaled by how the regime's past stints measured against their predictions
(`calibration`, per regime and batch-size bucket): a visit pays switching costs the model does not
see. With
`await_prediction` (the worker on cores of its own: one model predicts both regimes) a first visit
waits for such a prediction while there is none yet, for at most `probe_every` rounds (`deferred`
counts the stint ends it waited at): without that, the first visit ran before the model had measured
enough to skip it. Where the worker regime lost at the nearest smaller batch-size
bucket, its first visit at a larger one waits a probe interval too (SSD's edge shrinks as the batch
grows; `deferred` counts these waits as well): the first visits of each new bucket were most of
what auto lost in a short run at batch 4. Where SSD rounds take cores from the target
(`worker_waits`, the equal placement) the policy starts local and the worker's first visit waits a
probe interval at every bucket: a worker stint there pays the worker's prefill of the contexts and
runs the target on fewer threads (its first stint measured about 0.5x the local regime's rate on an
AVX-512 host, and fixed SSD ran below SD in every equal-placement bench so far), so the regime
that needs no setup serves first and the worker is explored from there. When that visit is due
and the worker has not yet run a round, the caller predicts the worker regime by an upper bound
(every round a cache hit, the target on the threads SSD rounds leave it, slowed as measured at start,
plus the worker's prefill of the contexts it is handed: SpeculativeStep._worker_bound), so a visit that cannot win is pruned like any other. Exactness does not depend on any of
this: every round is verified by the same exact rejection sampling whichever proposer drafted it.
"""
from __future__ import annotations

from collections.abc import Callable

LOCAL, WORKER = "local", "worker"
# bounds of one stint's measured / predicted rate (see RegimePolicy._calibrate)
CALIBRATION_RANGE = (0.5, 1.5)
# a local stint measured below this share of its prediction, alone behind the local regime's estimate at its
# bucket, is measured again soon (see RegimePolicy._doubtful)
DOUBTFUL_RATIO = 0.85
# from this batch-size bucket (3-4 rows) up, the worker's idle-time prefills wait for it to win (worker_unproven_at),
# and the local regime's first visit and one re-measure are not skipped on a prediction (_plain_first_visit,
# _doubtful)
PROVEN_BUCKET = 2


def bucket(batch_size: int) -> int:
    """Batch sizes whose regimes compare alike: 1, 2, 3-4, 5-8, 9-16, ..."""
    return max(batch_size - 1, 0).bit_length()


class RegimePolicy:
    def __init__(self, dwell: int = 16, probe_every: int = 128, hysteresis: float = 0.05, alpha: float = 0.5,
                 start: str = WORKER, max_probe_every: int = 1024, prune: float = 0.1,
                 worker_waits: bool = False, min_rounds: int | None = None):
        if dwell < 1 or probe_every < dwell or max_probe_every < probe_every:
            raise ValueError("dwell >= 1 and dwell <= probe_every <= max_probe_every are required")
        self.dwell, self.probe_every, self.hysteresis, self.alpha = dwell, probe_every, hysteresis, alpha
        self.max_probe_every = max_probe_every
        # (regime, bucket) -> rounds between probes of that regime there (backs off as its probes lose)
        self.interval: dict[tuple[str, int], int] = {}
        self._probing: int | None = None                 # bucket of the probe stint being run, if any
        self.current = start
        self.enabled = True              # False once the worker is gone: local from then on
        self.rounds = 0                  # rounds decided so far
        self._stint = 0                  # rounds in the current stint
        self._acc: dict[int, list[float]] = {}           # bucket -> [tokens, seconds, rounds] of this stint
        # a regime's estimate at a bucket moves only on at least `min_rounds` rounds there: a stint's share
        # of fewer (the 1-3 rounds it ran after the batch changed) is pooled with the regime's next shares
        # there (see _close_stint)
        self.min_rounds = max(1, dwell // 4) if min_rounds is None else max(1, min_rounds)
        self._pending: dict[tuple[str, int], list[float]] = {}  # (regime, bucket) -> pooled [tokens, seconds, rounds]
        self.rate: dict[tuple[str, int], float] = {}     # (regime, bucket) -> tokens/s estimate
        self.seen: dict[tuple[str, int], int] = {}       # (regime, bucket) -> round it was last measured
        self.switches = 0
        self.prune = prune
        self.pruned = 0                  # stint ends at which a visit of the other regime (predicted clearly
                                         # slower) was skipped
        self.deferred = 0                # stint ends at which a first visit waited (for a prediction, or
                                         # because the worker lost at a smaller batch)
        self.await_prediction = True     # a first visit waits for the caller's model (see _await_prediction)
        self.worker_waits = worker_waits  # the worker's first visit at every bucket waits a probe interval
        self.early = 0                   # stint ends at which a measured regime was re-measured early because
                                         # the model predicted it clearly faster than the current one, or
                                         # its one stint there was doubtful (_doubtful)
        self.early_after = 2 * dwell     # rounds since its last measurement before that may happen
        self.restated = 0                # stint ends that compared both regimes' calibrated predictions for the
                                         # requests now running instead of their measured rates (see pick)
        # (regime, bucket) -> measured / predicted rate of its stints there (per bucket: what the model
        # misses differs with the batch size; one dict for all let local visits at batch 1 prune the
        # local regime at batch 4 in the paper placement, where AR was best)
        self.calibration: dict[tuple[str, int], float] = {}
        self.calibrated: dict[tuple[str, int], int] = {}   # (regime, bucket) -> stints behind its calibration
        self._rechecked: set[tuple[str, int]] = set()      # (regime, bucket) whose doubtful stint was re-measured
        self.measured: dict[tuple[str, int], int] = {}     # (regime, bucket) -> stints behind its rate

    def disable(self) -> None:
        """The worker failed: every later round is local."""
        self.enabled = False
        self.current = LOCAL

    def pick(self, batch_size: int, predict: Callable[[str], float | None] | None = None) -> str:
        """The regime of the next round. predict(regime): a model's tokens/s for that regime at this
        batch, or None (then only measurements decide)."""
        self.rounds += 1
        if self.enabled and self._stint >= self.dwell:
            self._calibrate(predict)
            self._close_stint()
            other = LOCAL if self.current == WORKER else WORKER
            b = bucket(batch_size)
            mine, theirs = self.rate.get((self.current, b)), self.rate.get((other, b))
            # the estimates were measured on other requests (the other regime's perhaps many stints ago: a
            # code prompt before a chat one in `mixed`, a slow phase of the VM); where the model predicts
            # both regimes for the requests running now and their stints have calibrated those predictions
            # here, the calibrated predictions stand for them
            guess, own = self._calibrated(predict, other, b), self._calibrated(predict, self.current, b)
            if theirs is not None and mine is not None and guess is not None and own is not None:
                self.restated += 1
                mine, theirs = own, guess
            # SSD's edge shrinks as the batch grows (more verify rows, more drafting per round): where the
            # worker lost at the nearest smaller batch, it is not visited first at this one (a probe later)
            doubt = theirs is None and other == WORKER and (self.worker_waits or self._worker_lost_below(b))
            better = mine is None and not doubt or theirs is not None and theirs > mine * (1 + self.hysteresis)
            if self._probing == b:       # the probe stint just measured: its regime's probes back off if it lost
                key, base = (self.current, b), self.probe_every
                self.interval[key] = min(2 * self.interval.get(key, base), self.max_probe_every) if better else base
            self._probing = None
            missing = theirs is None and not doubt
            if doubt:
                self.seen.setdefault((other, b), self.rounds)
            age = self.rounds - self.seen.get((other, b), -10**9)
            stale = age > self.interval.get((other, b), self.probe_every)
            # the other regime's estimate is old and the model now predicts it clearly faster (the requests
            # changed since: a chat set after a code set): re-measure it now rather than a backed-off
            # interval later. Only a measured regime (its prediction from fits, not a bound) and not
            # sooner than `early_after` rounds after its last measurement
            window = not (better or stale) and theirs is not None and age > self.early_after
            fast = window and self._predicted_faster(predict, other, mine, b)
            doubted = window and not fast and self._doubtful(predict, other, mine, b)
            if doubted:                  # re-measured once per regime and bucket
                self._rechecked.add((other, b))
            promising = fast or doubted
            self.early += promising
            if not better and (missing and self._await_prediction(predict, other) or doubt and not stale):
                self.deferred += 1
            elif not better and (missing or stale) and not self._plain_first_visit(other, b) and \
                    self._predicted_slower(predict, other, mine, b):
                self.pruned += 1
                if theirs is not None or doubt:  # a probe skipped: as if run and lost (next one later)
                    self.seen[(other, b)] = self.rounds
                    self.interval[(other, b)] = min(2 * self.interval.get((other, b), self.probe_every),
                                                    self.max_probe_every)
                    # the calibration of a regime not measured since fades: halfway back to 1 per skipped
                    # probe, so one cold or unlucky stint cannot keep a regime from ever being measured
                    # again (a probe runs again within about five backed-off intervals)
                    if (other, b) in self.calibration:
                        self.calibration[(other, b)] = (1.0 + self.calibration[(other, b)]) / 2
            elif better or missing or stale or promising:
                # a visit is a probe unless it goes to a regime measured faster here; leaving a regime not
                # yet measured at this bucket (its stint ran at other batch sizes) for one not measured
                # here either is a first visit too (paper placement, the first stint at batch 4 after
                # batch 1 went local that way, not as a probe: its chooser then caught the in-process
                # draft up on four whole prompts, 16 rounds at 10.6 tok/s where plain rounds ran 36)
                if not better or theirs is None:
                    self._probing = b
                self.current = other
                self.switches += 1
        return self.current

    def _worker_lost_below(self, b: int) -> bool:
        """Whether the worker regime measured slower than the local one at the nearest smaller batch-size
        bucket where both were measured."""
        for lower in range(b - 1, -1, -1):
            w, loc = self.rate.get((WORKER, lower)), self.rate.get((LOCAL, lower))
            if w is not None and loc is not None:
                return w < loc
        return False

    def _plain_first_visit(self, regime: str, b: int) -> bool:
        """Whether visiting `regime` would be the local regime's first stint at bucket b from 3 rows up
        (PROVEN_BUCKET): such a visit is not pruned. There a local round is a plain round or close to one,
        a stint of them costs about what AR does, and where the worker rounds' fits predict the local
        regime (the paper placement) the prediction ran 10-20% low: those fits price the target's
        forwards as they run beside the worker's drafting, which a plain local round does not (twenty-
        eighth session, AVX2 host, batch 4: predicted 14.5-15.0 tok/s against the worker's measured
        16.9-17.7, the local regime's first visit was pruned and never run; its stints in another run
        measured 0.94-1.32 of that prediction, and AR ran 1.1-1.25x SSD k=2 there)."""
        return regime == LOCAL and b >= PROVEN_BUCKET and (LOCAL, b) not in self.rate

    def _await_prediction(self, predict, other: str) -> bool:
        """A first visit waits (up to `probe_every` rounds) for the model to predict the other regime, so a
        visit that the prediction would have skipped is not run before enough was measured to skip it."""
        return self.await_prediction and predict is not None and self.rounds <= self.probe_every and \
            predict(other) is None

    def _calibrate(self, predict) -> None:
        """At a stint's end: how the regime's measured rate compares with the model's prediction for it
        (CALIBRATION_RANGE bounds one stint's say). The prediction of a regime prices its steady state,
        with a switch's known costs; a visit also pays what the model does not see (equal placement,
        AVX-512 host: a first worker stint measured 8.4 tok/s where the worker rounds' fits then
        predicted 13.3, and later predictions of 16-19 came within the prune margin of the local
        regime's 21)."""
        if predict is None or not self._acc:
            return
        b, (tokens, seconds, _) = max(self._acc.items(), key=lambda kv: kv[1][1])   # where the stint spent most
        guess = predict(self.current)
        if guess is None or guess <= 0 or seconds <= 0:
            return
        lo, hi = CALIBRATION_RANGE
        ratio = min(max(tokens / seconds / guess, lo), hi)
        key = (self.current, b)
        old = self.calibration.get(key)
        self.calibration[key] = ratio if old is None else (1 - self.alpha) * old + self.alpha * ratio
        self.calibrated[key] = self.calibrated.get(key, 0) + 1

    def _doubtful(self, predict, regime: str, mine: float | None, b: int) -> bool:
        """Whether the local regime's estimate at bucket b rests on one stint (its rate and its calibration
        there) that measured far below the model's prediction (DOUBTFUL_RATIO), and the prediction without
        that stint's calibration is not clearly slower (the prune margin) than the current regime: then it
        is measured again (at least `early_after` rounds after that stint, once per bucket: pick records
        it in `_rechecked`), not a probe interval later. The local
        regime's switch costs are priced by the model (the draft's catch-up), so one stint far below it is
        more likely the VM's noise (stint to stint +-20%) than the regime. Paper placement, batch 4
        (twenty-second session's grid): the local regime's first stint there measured 25.0 tok/s against
        32.3 predicted (its later stints 35-41, AR's plain rounds 39); that one stint, as its rate and as
        its calibration (0.77, scaling every later prediction of it), kept the worker serving about 240
        rounds at 0.81 and 0.91 of AR. The worker's first stint is not doubted: what it pays at a visit
        (the hand-over prefills; in the equal placement the target on fewer cores) is partly outside the
        model, and a first stint there at 0.63 of its prediction was the regime, not noise.

        From 3 rows up (PROVEN_BUCKET) one local stint is doubted whatever it measured against the
        prediction: there its rounds are plain rounds or close to them, so a second stint costs about what
        AR does, and the prediction itself runs low where it comes from the worker rounds' fits (see
        _plain_first_visit). AVX2 host, paper placement, batch 4 (twenty-eighth session's grid): the local
        regime's one stint ran 257 ms per 4-row round where AR's took 173-183, 0.91 of a prediction that
        later stints beat by up to 1.32; the worker then served every stint end for ~190 rounds (its next
        local probe pruned) while SSD k=2 ran 0.80-0.91 of AR."""
        key = (regime, b)
        one_stint = self.calibrated.get(key) == 1 and self.measured.get(key) == 1
        below = b >= PROVEN_BUCKET or self.calibration.get(key, 1.0) < DOUBTFUL_RATIO
        if regime != LOCAL or key in self._rechecked or not one_stint or not below or predict is None or \
                mine is None:
            return False
        guess = predict(regime)
        return guess is not None and guess * (1 + self.prune) >= mine

    def _calibrated(self, predict, regime: str, b: int) -> float | None:
        """The model's rate for `regime` now, scaled by how its stints at bucket b measured against the
        model; None without a model, a prediction, or a calibrated stint there."""
        if predict is None or (regime, b) not in self.calibration:
            return None
        guess = predict(regime)
        return None if guess is None or guess <= 0 else guess * self.calibration[(regime, b)]

    def _predicted_faster(self, predict, other: str, mine: float | None, b: int) -> bool:
        """The other regime's calibrated prediction beats the current one's measured rate by more than the
        switching margin and the prune margin together."""
        if predict is None or mine is None:
            return False
        guess = predict(other)
        return guess is not None and \
            guess * self.calibration.get((other, b), 1.0) > mine * (1 + self.hysteresis + self.prune)

    def _predicted_slower(self, predict, other: str, mine: float | None, b: int) -> bool:
        if predict is None or mine is None:
            return False
        guess = predict(other)
        return guess is not None and guess * self.calibration.get((other, b), 1.0) * (1 + self.prune) < mine

    def worker_visit_in(self, batch_size: int) -> int:
        """Rounds until the worker regime may serve again at this batch size, as far as the policy has
        scheduled it: 0 where it serves now or is not measured here yet (a first visit may come at any
        stint end); where it measures faster here, the rounds left in this local stint (a probe it returns
        from); otherwise the rounds until its next probe here (the backed-off interval). A visit the model
        finds early (`promising`) can come sooner: this is the schedule, not a bound."""
        if not self.enabled:
            return 10**9
        if self.current == WORKER:
            return 0
        b = bucket(batch_size)
        seen, worker, local = self.seen.get((WORKER, b)), self.rate.get((WORKER, b)), self.rate.get((LOCAL, b))
        if seen is None or worker is None and not self.worker_waits and not self._worker_lost_below(b):
            return 0
        if worker is not None and (local is None or worker > local):
            return max(self.dwell - self._stint, 0)
        return max(seen + self.interval.get((WORKER, b), self.probe_every) - self.rounds, 0)

    def worker_unproven_at(self, batch_size: int) -> bool:
        """From batches of 3 rows up (PROVEN_BUCKET): whether the worker regime has not measured faster than
        the local one at this batch size (either not measured there, or slower). The step then leaves the
        worker's idle-time prefills out of local stints (SpeculativeStep._worker_back_soon), so the local
        regime is measured, and runs, without them: they run on the worker's core while the target decodes
        on the other and slowed its forwards by 5-8% at batch 8 on a 2-vCPU VM. Gated on a measured loss instead
        (nineteenth session's paper grid, code 9a3de3b), the local stints that were to measure that loss
        ran beside them: at batch 8 they measured 25-31 tok/s where AR ran 38, the worker (33) won, and auto
        ran 100% SSD rounds at 0.85x AR on MT-Bench and `mixed`. Below 3 rows a comparison follows one or
        two requests, and leaving the prefills out there made one noisy loss permanent (the hand-overs then
        prefill whole contexts): False there."""
        b = bucket(batch_size)
        if b < PROVEN_BUCKET:
            return False
        w, loc = self.rate.get((WORKER, b)), self.rate.get((LOCAL, b))
        return w is None or loc is None or w <= loc

    def probe_rounds_left(self) -> int | None:
        """Rounds left in the current stint if it is a probe (it will most likely be left after them),
        else None: a probe should not invest in what pays only later (the local draft's catch-up)."""
        return None if self._probing is None else max(self.dwell - self._stint, 1)

    def observe(self, batch_size: int, tokens: int, seconds: float) -> None:
        """The round just run (in `self.current`) committed `tokens` in `seconds`."""
        acc = self._acc.setdefault(bucket(batch_size), [0.0, 0.0, 0])
        acc[0] += tokens
        acc[1] += seconds
        acc[2] += 1
        self._stint += 1

    def _close_stint(self) -> None:
        """The stint's share at each bucket updates the regime's estimate there, once it (pooled with earlier
        shares too short to count) spans `min_rounds` rounds. A share of one to three rounds, run after the
        batch changed at the end of a stint, includes the hand-over of the new prompts: as a first estimate
        (paper placement, 11 tokens in 0.50 s: 22 tok/s where the worker then ran 34) it stood for the
        regime at that batch size until its next measurement."""
        for b, (tokens, seconds, rounds) in self._acc.items():
            key = (self.current, b)
            pool = self._pending.setdefault(key, [0.0, 0.0, 0])
            pool[0] += tokens
            pool[1] += seconds
            pool[2] += rounds
            if pool[2] < self.min_rounds or pool[1] <= 0:
                continue
            del self._pending[key]
            r = pool[0] / pool[1]
            old = self.rate.get(key)
            self.rate[key] = r if old is None else (1 - self.alpha) * old + self.alpha * r
            self.seen[key] = self.rounds
            self.measured[key] = self.measured.get(key, 0) + 1
        self._acc.clear()
        self._stint = 0
