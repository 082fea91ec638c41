"""Speculative speculative decoding, engine side: the draft runs in its own process (own cores or
device, or another host) and pre-drafts while the target verifies. Verification is the same exact
rejection sampling as SD; the proposal q is exactly what the worker sampled from.

If the worker dies or stops answering, the engine logs it once and finishes every request with
local autoregressive decoding (exact, slower)."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

import torch

from ssd.engine.engine import prefill_and_sample
from ssd.engine.model_runner import ModelRunner
from ssd.engine.sd import verify_and_commit
from ssd.engine.sequence import Sequence
from ssd.speculation.transport import Channel, Msg, decode_error, free_port, init_group

log = logging.getLogger(__name__)


SPAN_NAMES = {1: "answer", 2: "predraft", 3: "prefill"}


class DraftWorkerError(RuntimeError):
    pass


@dataclass
class SSDStats:
    rounds: int = 0
    hits: int = 0
    misses: int = 0
    fast_backups: int = 0
    partial_hits: int = 0        # misses served by finishing a partially pre-drafted chain
    hits_by_k: list[int] = field(default_factory=list)
    misses_by_k: list[int] = field(default_factory=list)
    tokens_on_hit: int = 0
    tokens_on_miss: int = 0
    wait_s: float = 0.0          # target idle: waiting for the worker's answer
    verify_s: float = 0.0        # target busy verifying
    worker_busy_s: float = 0.0   # reported by the worker (drafting + pre-drafting)
    chains_drafted: int = 0
    started: float = field(default_factory=time.perf_counter)

    def record(self, k: int, hit: bool, committed: int, k_max: int) -> None:
        while len(self.hits_by_k) <= k_max:
            self.hits_by_k.append(0)
            self.misses_by_k.append(0)
        if hit:
            self.hits += 1
            self.hits_by_k[k] += 1
            self.tokens_on_hit += committed
        else:
            self.misses += 1
            self.misses_by_k[k] += 1
            self.tokens_on_miss += committed

    def to_dict(self) -> dict:
        wall = max(time.perf_counter() - self.started, 1e-9)
        asked = self.hits + self.misses
        return {"cache_hit_rate": self.hits / asked if asked else None, "hits": self.hits, "misses": self.misses,
                "fast_backups": self.fast_backups, "partial_hits": self.partial_hits,
                "hit_rate_by_k": [h / (h + m) if h + m else None for h, m in zip(self.hits_by_k, self.misses_by_k)],
                "tokens_per_round_on_hit": self.tokens_on_hit / self.hits if self.hits else None,
                "tokens_per_round_on_miss": self.tokens_on_miss / self.misses if self.misses else None,
                "target_idle_fraction": self.wait_s / wall, "target_verify_fraction": self.verify_s / wall,
                "draft_busy_fraction": min(self.worker_busy_s / wall, 1.0), "chains_drafted": self.chains_drafted}


class DraftClient:
    """Starts (or waits for) a draft worker and speaks the transport protocol with it."""

    def __init__(self, model_path: str, dtype: str, k: int, *, threads: int | None = None,
                 cores: list[int] | None = None, fanout_budget: int | None = None, saguaro_c: float = 1.0,
                 backup: str = "auto", timeout_s: float = 60.0, num_blocks: int = 4096, block_size: int = 16,
                 max_model_len: int = 4096, listen: str | None = None, device: str = "cpu",
                 target_vocab: int | None = None):
        self.proc = None
        self.abandoned = False
        host, port = ("127.0.0.1", free_port()) if listen is None else _split(listen)
        if listen is None:
            cmd = [sys.executable, "-m", "ssd.speculation.draft_worker", "--connect", f"{host}:{port}",
                   "--model", model_path, "--dtype", dtype, "--device", device, "--k", str(k),
                   "--saguaro-c", str(saguaro_c), "--backup", backup, "--timeout", str(timeout_s),
                   "--num-blocks", str(num_blocks), "--block-size", str(block_size),
                   "--max-model-len", str(max_model_len)]
            if threads:
                cmd += ["--threads", str(threads)]
            if fanout_budget:
                cmd += ["--fanout-budget", str(fanout_budget)]
            if cores:
                cmd += ["--cores", ",".join(map(str, cores))]
            self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, env=_child_env())
        self._join(host, port, timeout_s)
        self.chan = Channel(peer=1, store=self._store)
        msg = self.chan.recv()
        if msg.kind == Msg.ERROR:
            self.close()
            raise DraftWorkerError(decode_error(msg.ints))
        self.vocab, self.pid, worker_k = msg.ints.tolist()
        if worker_k != k:
            self.close()
            raise DraftWorkerError(f"the draft worker at {host}:{port} pre-drafts k={worker_k} tokens but the engine "
                                   f"uses k={k}: start the worker with --k {k} (or the engine with k={worker_k})")
        self.chan.send(Msg.CONFIG, [int(target_vocab if target_vocab is not None else self.vocab)])
        log.info("draft worker %d is up (%s)", self.pid, "local process" if self.proc else f"remote, {host}:{port}")

    def _join(self, host: str, port: int, timeout_s: float) -> None:
        """Rendezvous without hanging on a worker that died before joining."""
        err: list[BaseException] = []
        self._store = None

        def join():
            self._store = init_group(host, port, 0, timeout_s)

        t = threading.Thread(target=lambda: _catch(err, join), daemon=True)
        t.start()
        deadline = time.monotonic() + timeout_s
        while t.is_alive():
            t.join(0.1)
            if self.proc is not None and self.proc.poll() is not None:
                tail = self.proc.stderr.read().decode(errors="replace")[-2000:]
                raise DraftWorkerError(f"the draft worker exited during start-up (code {self.proc.returncode}):\n{tail}")
            if time.monotonic() > deadline:
                self.close()
                raise DraftWorkerError(f"no draft worker joined {host}:{port} within {timeout_s:.0f}s")
        if err:
            self.close()
            raise DraftWorkerError(f"could not set up the engine/worker link on {host}:{port}: {err[0]}")

    def add(self, seq: Sequence, tokens: list[int] | None = None) -> None:
        """Start drafting for `seq` from `tokens` (default: all of its tokens)."""
        p = seq.params
        seed = p.seed if p.seed is not None else int(torch.randint(0, 2**62, (1,)))
        toks = seq.all_token_ids if tokens is None else tokens
        self.chan.send(Msg.ADD, [seq.seq_id, seed, p.top_k, len(toks), *toks], [p.temperature, p.top_p])

    def free(self, seq_ids: list[int]) -> None:
        if seq_ids:
            self.chan.send(Msg.FREE, seq_ids)

    def speculate(self, requests: list[tuple[int, int, int, int]], vocab: int, verify_s: float = 0.0):
        """-> (tokens per seq, probs per seq or None, backup code per seq, worker busy seconds, chains)."""
        flat = [len(requests)] + [x for r in requests for x in r]
        self.chan.send(Msg.SPECULATE, flat, [verify_s])
        msg = self.chan.recv()
        if msg.kind != Msg.SPECULATION:
            raise DraftWorkerError(f"unexpected reply {msg.kind.name}")
        ints = msg.ints.tolist()
        n, pos, off = ints[0], 1, 0
        tokens, probs, codes = [], [], []
        for _ in range(n):     # per sequence: backup code, has-probs flag, m, m tokens
            code, has_probs, m = ints[pos:pos + 3]
            tokens.append(ints[pos + 3:pos + 3 + m])
            pos += 3 + m
            codes.append(code)
            probs.append(msg.floats[off:off + m * vocab].view(m, vocab) if has_probs else None)
            off += m * vocab if has_probs else 0
        chains, n_spans = ints[pos], ints[pos + 1]
        spans = [(SPAN_NAMES.get(ints[pos + 2 + 3 * i], "draft"), ints[pos + 3 + 3 * i] / 1e6,
                  ints[pos + 4 + 3 * i] / 1e6) for i in range(n_spans)]
        return tokens, probs, codes, float(msg.floats[-1]), chains, spans

    def abandon(self) -> None:
        """Give up on the worker: kill it if it is our process; no more messages are sent to it."""
        self.abandoned = True
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self) -> None:
        try:
            if torch.distributed.is_initialized():
                if not self.abandoned:
                    try:
                        self.chan.send(Msg.SHUTDOWN)
                    except Exception:
                        pass
                torch.distributed.destroy_process_group()
        except Exception:
            pass
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class SSDStep:
    def __init__(self, target: ModelRunner, client: DraftClient, k: int, on_failure, tracer, counters=None):
        from ssd.speculation.stats import SpecCounters

        self.target, self.client, self.k = target, client, k
        self.on_failure = on_failure
        self.stats = counters if counters is not None else SpecCounters()
        self.vocab = target.model.cfg.vocab_size
        self.tracer = tracer
        self.last_verify_s = 0.0
        self.max_spec_batch: int | None = None   # larger decode batches ask for no draft (one-token rounds)

    def _fail(self, error: BaseException) -> None:
        """The worker died or stopped answering: stop it for good (a hung worker would otherwise make
        every later message wait for the timeout), then let the engine degrade to local AR."""
        self.client.abandon()
        self.on_failure(error)

    def prefill(self, seqs: list[Sequence]) -> None:
        try:
            for s in seqs:
                self.client.add(s)
        except Exception as e:
            self._fail(e)
        with self.tracer.span("target", "prefill"):
            prefill_and_sample(self.target, seqs)
        for s in seqs:
            s.ssd_outcome = (0, s.output_token_ids[-1])
            s.ssd_detached = False      # (re-)added above: e.g. a detached sequence preempted and recomputed
            s.ssd_spec_len = 0

    def decode(self, seqs: list[Sequence]) -> None:
        from ssd.engine.ar import ARStep

        if self.max_spec_batch is not None and len(seqs) > self.max_spec_batch:
            # plain one-token rounds without asking the worker: it drops these sequences now and gets
            # them back (prefix-cached, so only the new tokens are recomputed) when speculation resumes
            self._detach([s for s in seqs if not getattr(s, "ssd_detached", False)])
            ARStep(self.target, self.tracer).decode(seqs)
            return
        k_eff = [max(0, min(self.k, s.remaining_tokens() - 1)) for s in seqs]
        t0 = time.perf_counter()
        try:
            self._reattach([s for s in seqs if getattr(s, "ssd_detached", False)])
            reqs = [(s.seq_id, *s.ssd_outcome, k) for s, k in zip(seqs, k_eff)]
            drafts, qs, codes, busy, chains, spans = self.client.speculate(reqs, self.vocab, self.last_verify_s)
        except Exception as e:
            self._fail(e)
            ARStep(self.target, self.tracer).decode(seqs)
            return
        t1 = time.perf_counter()
        self.tracer.add("target", "wait", t0, t1)
        for name, start, end in spans:
            self.tracer.add("draft", name, start, end)
        for b, s in enumerate(seqs):     # the worker answers with k_eff tokens; trust but verify the length
            if len(drafts[b]) != k_eff[b]:
                drafts[b], qs[b] = drafts[b][:k_eff[b]], None if qs[b] is None else qs[b][:k_eff[b]]
        before = [len(s.output_token_ids) for s in seqs]
        accepted = verify_and_commit(self.target, seqs, drafts, qs)
        t2 = time.perf_counter()
        self.tracer.add("target", "verify", t1, t2)
        self.last_verify_s = t2 - t1
        st = self.stats
        st.rounds += 1
        st.wait_s += t1 - t0
        st.verify_s += t2 - t1
        st.worker_busy_s, st.chains_drafted = busy, chains
        for s, n, code, b0, (_, k_prev, _, _), d in zip(seqs, accepted, codes, before, reqs, drafts):
            # a hit or a miss needs a speculation last round (none after prefill or a one-token round) to
            # have been pre-drafted after, and a speculation asked for now
            if getattr(s, "ssd_spec_len", 0) and d:
                st.record_lookup(k_prev, code == 1, len(s.output_token_ids) - b0)
            s.ssd_spec_len = len(d)
            st.fast_backups += code == 2
            st.partial_hits += code == 3
            s.ssd_outcome = (n, s.output_token_ids[-1])
            s.ssd_hits = getattr(s, "ssd_hits", 0) + (code == 1)

    def _detach(self, seqs: list[Sequence]) -> None:
        if not seqs:
            return
        for s in seqs:
            s.ssd_detached = True
        try:
            self.client.free([s.seq_id for s in seqs])
        except Exception as e:
            self._fail(e)

    def _reattach(self, seqs: list[Sequence]) -> None:
        """Hand detached sequences back to the worker as after a prefill: all tokens but the last, whose
        outcome (0 accepted, bonus = last token) the next request carries."""
        for s in seqs:
            self.client.add(s, s.all_token_ids[:-1])
            s.ssd_detached = False
            s.ssd_outcome = (0, s.all_token_ids[-1])
            s.ssd_spec_len = 0

    def release(self, seq: Sequence) -> None:
        try:
            self.client.free([seq.seq_id])
        except Exception as e:
            self._fail(e)


def _split(hostport: str) -> tuple[str, int]:
    host, port = hostport.rsplit(":", 1)
    return host, int(port)


def _catch(err: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001 - reported to the caller thread
        err.append(e)


def _child_env() -> dict:
    env = dict(os.environ)
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env
