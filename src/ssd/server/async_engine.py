"""AsyncEngine: the (not thread-safe) LLMEngine driven by one background thread, fed by asyncio.

The engine thread loops: drain a queue of commands (add, abort, call), step the engine while it
has work (wait on an event when idle), and hand each step's token deltas to the asyncio side with
`loop.call_soon_threadsafe`. Nothing but that thread ever touches the LLMEngine, so the HTTP side
never blocks on a forward pass and concurrent requests share the engine's continuous batching.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from ssd.engine.sequence import Sequence, SpecStats
from ssd.outputs import RequestMetrics
from ssd.sampling_params import SamplingParams
from ssd.server.metrics import ServerMetrics

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine failed while running a request (not the request's fault)."""


@dataclass
class EngineRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None = None


@dataclass
class Delta:
    """What one engine step committed for one request of a group."""

    index: int                      # position of the request in its group
    text: str                       # new text (UTF-8 safe: incomplete characters are held back)
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_generated_tokens: int
    spec: SpecStats | None = None           # on the final delta: the request's speculation counters
    metrics: RequestMetrics | None = None   # on the final delta
    ssd_hits: int = 0                       # on the final delta: rounds served from the SSD speculation cache
    degraded_from: str | None = None        # on the final delta: set once a draft-worker failure degraded SSD
    logprobs: list | None = None            # TokenLogprob per token of this delta, when asked for


class RequestGroup:
    """The engine requests of one API call (prompts x n choices). Their deltas arrive, interleaved,
    on one asyncio queue; `close()` aborts whatever has not finished (call it in a finally)."""

    def __init__(self, engine: AsyncEngine, request_ids: list[str]):
        self.engine = engine
        self.request_ids = request_ids
        self.queue: asyncio.Queue[Delta | BaseException] = asyncio.Queue()
        self._unfinished = set(range(len(request_ids)))

    @property
    def finished(self) -> bool:
        return not self._unfinished

    async def deltas(self) -> AsyncIterator[Delta]:
        while self._unfinished:
            item = await self.queue.get()
            if isinstance(item, BaseException):
                self._unfinished.clear()
                raise item
            if item.finished:
                self._unfinished.discard(item.index)
            yield item

    def close(self) -> None:
        if self._unfinished:
            self.engine.abort([self.request_ids[i] for i in sorted(self._unfinished)])
            self._unfinished.clear()


@dataclass
class _Track:
    group: RequestGroup
    index: int
    seq: Sequence
    loop: asyncio.AbstractEventLoop
    arrival: float
    last_token_time: float | None = None
    spec: SpecStats = field(default_factory=SpecStats)


class AsyncEngine:
    """Owns `llm.engine` from `start()` to `shutdown()`; use `submit` from a running event loop."""

    def __init__(self, llm, metrics: ServerMetrics | None = None):
        self.llm = llm
        self.engine = llm.engine
        self.metrics = metrics or ServerMetrics(llm.config.mode, str(llm.config.model), llm.config.k)
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._stopping = False
        self._tracks: dict[str, _Track] = {}
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]
        self._preemptions = 0
        self._managers = {"target": self.engine.target.block_manager}
        if self.engine.draft is not None:
            self._managers["draft"] = self.engine.draft.block_manager
        self._ssd = self.engine.mode == "ssd"
        self._auto = self.engine.mode == "auto"
        self._spec_seen = self.engine.spec_metrics()      # speculation counters already exported
        self._thread = threading.Thread(target=self._run, name="ssd-engine", daemon=True)

    # ---- control --------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # ---- asyncio side ---------------------------------------------------------------------------
    async def submit(self, requests: list[EngineRequest]) -> RequestGroup:
        """Add all requests to the engine (all or none). Raises the engine's ValueError for a bad
        request (e.g. a prompt longer than the context)."""
        if not self.alive:
            raise EngineError("the engine is not running")
        base = f"{self._prefix}-{next(self._ids)}"
        group = RequestGroup(self, [f"{base}-{i}" for i in range(len(requests))])
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("add", group, requests, asyncio.get_running_loop(), time.perf_counter(), fut))
        try:
            await asyncio.wrap_future(fut)
        except asyncio.CancelledError:
            group.close()
            raise
        return group

    def abort(self, request_ids: list[str]) -> None:
        self._put(("abort", request_ids))

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(llm_engine) on the engine thread (thread-safe inspection, e.g. block counts)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._put(("call", fn, fut))
        return fut

    def _put(self, cmd: tuple) -> None:
        self._cmds.put(cmd)
        self._wake.set()

    # ---- engine thread --------------------------------------------------------------------------
    def _run(self) -> None:
        log.info("engine thread started (mode %s)", self.llm.config.mode)
        try:
            while not self._stopping:
                self._drain()
                if self.engine.has_unfinished():
                    if not self._step():
                        self._wake.wait(0.001)      # nothing schedulable this round: do not spin hot
                        self._wake.clear()
                else:
                    self._publish_state()
                    self._wake.wait(1.0)
                    self._wake.clear()
        finally:
            self._fail_all(EngineError("the server is shutting down"))
            log.info("engine thread stopped")

    def _drain(self) -> None:
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            kind = cmd[0]
            if kind == "add":
                self._add(*cmd[1:])
            elif kind == "abort":
                for rid in cmd[1]:
                    self._abort(rid)
            elif kind == "call":
                _, fn, fut = cmd
                try:
                    fut.set_result(fn(self.engine))
                except Exception as e:  # noqa: BLE001 - handed to the caller
                    fut.set_exception(e)
            self._publish_state()

    def _add(self, group: RequestGroup, requests: list[EngineRequest], loop, arrival: float, fut) -> None:
        if self._stopping:
            fut.set_exception(EngineError("the server is shutting down"))
            return
        added = []
        try:
            for i, (rid, req) in enumerate(zip(group.request_ids, requests)):
                seq = self.engine.add_request(rid, req.prompt_token_ids, req.params, req.prompt)
                added.append(rid)
                self._tracks[rid] = _Track(group, i, seq, loop, arrival)
        except Exception as e:  # noqa: BLE001 - the request's error goes back to its caller
            for rid in added:
                self._tracks.pop(rid, None)
                self.engine.abort(rid)
            fut.set_exception(e)
            return
        self.metrics.prompt_tokens.inc(sum(len(r.prompt_token_ids) for r in requests))
        fut.set_result(None)

    def _abort(self, rid: str) -> None:
        track = self._tracks.pop(rid, None)
        self.engine.abort(rid)
        if track is not None:
            self.metrics.finished.labels(reason="abort").inc()
            self.metrics.spec_delta(track.spec, track.seq.spec)

    def _step(self) -> bool:
        try:
            outs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed: failing the requests it was running")
            self._fail_running(EngineError(f"engine step failed: {type(e).__name__}: {e}"))
            return True
        now = time.perf_counter()
        batch: dict[asyncio.AbstractEventLoop, list[tuple[RequestGroup, Delta]]] = {}
        m = self.metrics
        for out in outs:
            seq = out.seq
            track = self._tracks.get(seq.request_id)
            if track is None:
                continue
            n = len(out.new_token_ids)
            m.tokens(n, now, track.arrival, track.last_token_time)
            if n:
                track.last_token_time = now
            m.spec_delta(track.spec, seq.spec)
            track.spec = copy.deepcopy(seq.spec)
            delta = Delta(track.index, out.new_text, list(out.new_token_ids), seq.finished, seq.finish_reason,
                          len(seq.prompt_token_ids), len(seq.output_token_ids),
                          logprobs=None if out.new_logprobs is None else list(out.new_logprobs))
            if seq.finished:
                del self._tracks[seq.request_id]
                delta.spec = copy.deepcopy(seq.spec)
                delta.metrics = RequestMetrics.of(seq)
                delta.ssd_hits = seq.spec_state.cache_hits
                delta.degraded_from = self.engine.degraded_from
                m.finished.labels(reason=seq.finish_reason or "unknown").inc()
                m.e2e.observe(now - track.arrival)
            batch.setdefault(track.loop, []).append((track.group, delta))
        for loop, items in batch.items():
            _deliver(loop, items)
        self._publish_state()
        return bool(outs)

    def _fail_running(self, err: BaseException) -> None:
        """After a failed step: fail the requests that were in it (running or admitted); requests still
        waiting for admission and commands still queued go on as usual."""
        running = set(map(id, self.engine.scheduler.running))
        batch: dict = {}
        for rid, track in list(self._tracks.items()):
            if id(track.seq) not in running:
                continue
            self.engine.abort(rid)
            del self._tracks[rid]
            batch.setdefault(track.loop, []).append((track.group, err))
        for loop, items in batch.items():
            _deliver(loop, items)

    def _fail_all(self, err: BaseException) -> None:
        batch: dict = {}
        for rid, track in list(self._tracks.items()):
            self.engine.abort(rid)
            batch.setdefault(track.loop, []).append((track.group, err))
        self._tracks.clear()
        for loop, items in batch.items():
            _deliver(loop, items)
        while True:     # adds still queued get the same answer
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] in ("add", "call"):
                cmd[-1].set_exception(err)

    def _publish_state(self) -> None:
        sched = self.engine.scheduler
        if sched.num_preemptions > self._preemptions:
            self.metrics.preemptions.inc(sched.num_preemptions - self._preemptions)
            self._preemptions = sched.num_preemptions
        self.metrics.engine_state(sched, self._managers)
        if self._ssd:
            now = self.engine.spec_metrics()
            up = self.engine.mode == "ssd" and self.engine.degraded_from is None
            self.metrics.ssd_state(now.delta(self._spec_seen), up)
            self._spec_seen = now
        elif self._auto:
            now = self.engine.spec_metrics()
            self.metrics.auto_state(now.delta(self._spec_seen), now)
            self._spec_seen = now


def _deliver(loop: asyncio.AbstractEventLoop, items: list) -> None:
    def put_all() -> None:
        for group, item in items:
            group.queue.put_nowait(item)
    try:
        loop.call_soon_threadsafe(put_all)
    except RuntimeError:        # the event loop is closed: nobody is listening any more
        pass
