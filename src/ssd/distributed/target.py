"""Rank 0's side of a tensor-parallel target: start (or wait for) ranks 1..N-1, load rank 0's shard,
form the group, and a ModelRunner that mirrors every forward and KV copy to the ranks.

The scheduler, sampler, verifier and block manager stay on rank 0 and talk to `TPModelRunner`
exactly as to a `ModelRunner`; every rank computes the logits of its vocab rows, gathered on rank 0
(logits exist on rank 0 only).
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import subprocess
import sys
import threading
import time
import weakref
from datetime import timedelta

import torch

from ssd.distributed.group import (COPY, FORWARD, SHUTDOWN, STATS, TensorParallelError, TPGroup, encode_batch,
                                   is_decode, make_store, negotiate_shm, stat_row)
from ssd.distributed.rank import CONFIG_KEY, KV_KEY, Reducer, bye_key, error_key, ready_key
from ssd.distributed.sharding import split_even
from ssd.engine.childlog import LoggedChild
from ssd.engine.model_runner import ModelRunner, StepBatch

log = logging.getLogger(__name__)


def rank_cores(available: list[int], world: int, threads: int | None = None) -> list[list[int]] | None:
    """Contiguous core groups, one per rank (rank 0 first): `threads` cores each, or (None) all the
    cores split as evenly as possible; None when they do not fit (then nothing is pinned)."""
    cores = sorted(available)
    if threads is not None:
        return [cores[r * threads:(r + 1) * threads] for r in range(world)] if world * threads <= len(cores) else None
    if len(cores) < world:
        return None
    return [cores[a:b] for a, b in split_even(len(cores), world)]


class TPTarget:
    def __init__(self, spec, dtype: str, device: str, max_positions: int, world: int, *, progress: bool = True,
                 timeout_s: float = 60.0, listen: str | None = None, cores: list[int] | None = None,
                 threads: int | None = None, transport: str = "auto"):
        """listen: "HOST:PORT" to wait for ranks started by hand (`ssd tp-rank`) instead of spawning
        them; cores: the CPU cores the ranks share (default: this process's, when on CPU); transport:
        "auto" (shared memory when every rank can map rank 0's segment, i.e. is on this host; else
        gloo) or "gloo"."""
        from ssd.models.loader import load_model

        if transport not in ("auto", "gloo"):
            raise ValueError(f"tensor-parallel transport must be 'auto' or 'gloo', got {transport!r}")
        from ssd.distributed.devices import spawned_rank_devices

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        # ranks started here take the GPUs after rank 0's; by hand (listen), each picks its own
        self.devices = spawned_rank_devices(device, 1 if listen else world, gpus)
        device = self.devices[0]
        self.world, self.timeout_s, self.transport = world, timeout_s, transport
        self.procs: dict[int, LoggedChild] = {}
        self.group: TPGroup | None = None
        self.broken: str | None = None
        self._closed = False
        self.busy_s = 0.0           # rank 0's time in mirrored forwards/copies (TPModelRunner)
        self.forwards = 0
        self.decode_busy_s = 0.0    # of which in decode-step forwards (group.is_decode), and their count
        self.decode_forwards = 0
        from ssd.speculation.worker.transport import free_port

        host, port = ("127.0.0.1", free_port()) if listen is None else _split(listen)
        self.address = f"{host}:{port}"
        self.store = make_store(host if listen is None else "0.0.0.0", port, 0, world, timeout_s)
        self.store.set(CONFIG_KEY, json.dumps(dict(model=str(spec), dtype=dtype, device=str(device),
                                                   max_positions=max_positions, world=world, timeout_s=timeout_s)))
        groups = None
        available = cores or sorted(os.sched_getaffinity(0))
        if torch.device(device).type == "cpu":
            groups = rank_cores(available, world, threads)
            if groups is None:
                log.warning("tensor_parallel_size=%d x %s threads on %d CPU cores: ranks are not pinned and share "
                            "cores", world, threads or 1, len(available))
        # ranks busy-wait in shared-memory collectives only when each has cores of its own
        self._spin = bool(groups)
        atexit.register(_close_ref(self))
        try:
            _build_kernels_first(dtype, device)
            if listen is None:
                for r in range(1, world):
                    self.procs[r] = self._spawn(r, host, port, groups[r] if groups else None, threads,
                                                self.devices[r])
            else:
                log.info("tensor parallel: waiting for ranks 1..%d: start each with `ssd tp-rank --connect "
                         "HOST:%d --rank R --world-size %d`", world - 1, port, world)
            if groups:
                torch.set_num_threads(len(groups[0]))     # rank 0 is this process: threads, no pinning
            elif threads:
                torch.set_num_threads(threads)
            self._reducer = Reducer()
            self.loaded = load_model(spec, dtype, device, max_positions, progress, shard=(0, world),
                                     reduce=self._reducer, gather=self._reducer.gather)
        except BaseException:
            self.close()
            raise

    def _spawn(self, rank: int, host: str, port: int, cores: list[int] | None, threads: int | None, device: str):
        cmd = [sys.executable, "-m", "ssd.distributed.rank", "--connect", f"{host}:{port}", "--rank", str(rank),
               "--world-size", str(self.world), "--timeout", str(self.timeout_s), "--parent-pid", str(os.getpid()),
               "--device", device]
        if cores:
            cmd += ["--cores", ",".join(map(str, cores))]
        if threads or cores:
            cmd += ["--threads", str(threads or len(cores))]
        from ssd.speculation.worker.client import _child_env

        return LoggedChild(cmd, f"ssd.child.tp_rank{rank}", env=_child_env())

    # ---- start-up ----------------------------------------------------------------------------------
    def runner(self, num_blocks: int, block_size: int, device) -> "TPModelRunner":
        """Tell the ranks the KV cache size, wait for them (bounded), form the group."""
        try:
            self.store.set(KV_KEY, json.dumps(dict(num_blocks=num_blocks, block_size=block_size)))
            self._wait_ready()
            self._form_group()
        except BaseException:
            self.close()
            raise
        return TPModelRunner(self, self.loaded.model, num_blocks, block_size, torch.device(device))

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        waiting = set(range(1, self.world))
        while waiting:
            for r in sorted(waiting):
                if self.store.check([error_key(r)]):
                    raise TensorParallelError(f"tensor-parallel rank {r} failed to start: "
                                              f"{self.store.get(error_key(r)).decode()}")
                if self.store.check([ready_key(r)]):
                    waiting.discard(r)
            self._check_procs("during start-up")
            if waiting and time.monotonic() > deadline:
                raise TensorParallelError(
                    f"tensor-parallel rank(s) {sorted(waiting)} did not join {self.address} within "
                    f"{self.timeout_s:.0f}s: start them (`ssd tp-rank --connect {self.address} --rank R --world-size "
                    f"{self.world}`) or raise tp_timeout_s")
            time.sleep(0.02)

    def _form_group(self) -> None:
        err: list[BaseException] = []

        def join():
            try:
                self.group = TPGroup(self.store, 0, self.world, self.timeout_s, self.address.rsplit(":", 1)[0],
                                     device=self.devices[0])
                negotiate_shm(self.group, want=self.transport == "auto", spin=self._spin)
                if self.group.shm is not None:
                    self.group.shm.peer_check = self._raise_if_a_rank_exited
            except BaseException as e:  # noqa: BLE001 - reported below
                err.append(e)
        t = threading.Thread(target=join, daemon=True)
        t.start()
        deadline = time.monotonic() + self.timeout_s
        while t.is_alive():
            t.join(0.05)
            self._check_procs("while forming the group")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"the tensor-parallel group on {self.address} did not form within "
                                          f"{self.timeout_s:.0f}s")
        if err:
            raise TensorParallelError(f"could not form the tensor-parallel group on {self.address}: {err[0]}")
        self._reducer.group = self.group
        log.info("tensor parallel: %d ranks up on %s, collectives over %s", self.world, self.address,
                 self.group.transport)

    def _raise_if_a_rank_exited(self) -> None:
        """Shared-memory waits ask this (a dead peer closes no socket there)."""
        from ssd.distributed.shm import ShmTimeout

        for r, p in self.procs.items():
            if p.poll() is not None:
                raise ShmTimeout(f"tensor-parallel rank {r} exited")

    def _check_procs(self, when: str) -> None:
        for r, p in self.procs.items():
            if p.poll() is not None:
                tail = p.tail()
                raise TensorParallelError(f"tensor-parallel rank {r} (pid {p.pid}) exited {when} with code "
                                          f"{p.returncode}:\n{tail}")

    # ---- failures ----------------------------------------------------------------------------------
    def fail(self, e: BaseException) -> TensorParallelError:
        """The group is unusable after any failed collective: say which rank went away, if known."""
        dead = [f"rank {r} (pid {p.pid}, exit code {p.returncode})" for r, p in self.procs.items()
                if p.poll() is not None]
        what = f"{', '.join(dead)} exited" if dead else f"a collective failed or timed out ({e})"
        self.broken = (f"the tensor-parallel target is down: {what}. This engine cannot continue; close it and "
                       "start a new LLM")
        return TensorParallelError(self.broken)

    def check(self) -> None:
        if self.broken:
            raise TensorParallelError(self.broken)
        if self.group is None:
            raise TensorParallelError("the tensor-parallel group is closed")

    def stats(self) -> dict:
        """Cumulative per-rank timings: seconds busy in forwards (logits included) and KV copies, of
        which in collectives (`allreduce_s`: the all-reduces and the logits gathers; compute = busy -
        that) and, of that, waiting for a slower peer (`wait_s`; None over gloo), the all-reduce and
        gather counts; the same for decode-step forwards only (`decode_*`); plus rank 0's forward
        counts and the transport ("shm" or "gloo")."""
        self.check()
        g = self.group
        try:
            g.send_command(STATS)
            rows = g.gather_floats(stat_row(self.busy_s, self.decode_busy_s, g))
        except RuntimeError as e:
            raise self.fail(e) from e
        return dict(forwards=self.forwards, decode_forwards=self.decode_forwards, transport=g.transport,
                    ranks=[dict(rank=r, busy_s=b, allreduce_s=c, allreduces=int(n), gathers=int(m),
                                wait_s=w if w >= 0 else None, decode_busy_s=db, decode_allreduce_s=dc,
                                decode_wait_s=dw if w >= 0 else None)
                           for r, (b, c, n, m, w, db, dc, dw) in enumerate(rows)])

    # ---- shutdown ----------------------------------------------------------------------------------
    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.group is not None and not self.broken:
            try:
                self.group.send_command(SHUTDOWN)
            except Exception:       # noqa: BLE001 - ranks may be gone already
                pass
        for p in self.procs.values():
            if self.group is None or self.broken:       # never formed, or failed: nothing to wait for
                p.kill()
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        if self.group is not None:
            if not self.broken:     # ranks started elsewhere: let them shut their side down first
                remote = [bye_key(r) for r in range(1, self.world) if r not in self.procs]
                try:
                    if remote:
                        self.store.wait(remote, timedelta(seconds=5))
                except Exception:   # noqa: BLE001 - a rank that does not answer: close anyway
                    log.warning("tensor-parallel ranks %s did not confirm their shutdown within 5 s", remote)
            self.group.close()
            self.group = None


def _build_kernels_first(dtype: str, device) -> None:
    """Compile (or load) the C++ kernels here before any rank starts: N processes finding no cached
    build would each wait on the build lock, and a rank killed while it holds that lock (start-up
    timeout) would leave it behind for every later process."""
    if torch.device(device).type != "cpu" or dtype in ("float32", "fp32", "bfloat16", "bf16"):
        return
    from ssd.kernels.build import KernelBuildError, load_qgemm

    try:
        load_qgemm()
    except KernelBuildError:
        pass        # the model load reports it (or falls back) as without tensor parallelism


def _close_ref(tp: TPTarget):
    ref = weakref.ref(tp)

    def close():
        t = ref()
        if t is not None:
            t.close()
    return close


def _split(hostport: str) -> tuple[str, int]:
    host, port = hostport.rsplit(":", 1)
    return host, int(port)


class TPModelRunner(ModelRunner):
    """A ModelRunner over rank 0's shard whose forwards and KV copies run on every rank."""

    def __init__(self, tp: TPTarget, model, num_blocks: int, block_size: int, device: torch.device):
        super().__init__(model, num_blocks, block_size, device)
        self.tp = tp

    def forward(self, items):
        """The mirrored forward and the gather of the logits columns (ModelRunner.forward over `run`)."""
        self.tp.check()
        decode = is_decode([len(it.tokens) for it in items])
        self.tp.group.decode = decode
        t0 = time.perf_counter()
        try:
            return super().forward(items)
        except TensorParallelError:
            raise
        except RuntimeError as e:
            raise self.tp.fail(e) from e
        finally:
            dt = time.perf_counter() - t0
            self.tp.busy_s += dt
            self.tp.forwards += 1
            if decode:
                self.tp.decode_busy_s += dt
                self.tp.decode_forwards += 1
            if self.tp.group is not None:
                self.tp.group.decode = False

    def run(self, batch: StepBatch) -> torch.Tensor:
        """Send the batch (with the rows whose logits rank 0 will ask for), then run rank 0's shard."""
        self.tp.group.send_command(FORWARD, encode_batch(batch.tokens, batch.positions, batch.query_lens,
                                                         batch.ctx_slots, batch.logit_rows))
        return super().run(batch)

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        self.tp.check()
        try:
            src, dst = torch.as_tensor(src, dtype=torch.long), torch.as_tensor(dst, dtype=torch.long)
            self.tp.group.send_command(COPY, torch.cat([src.cpu(), dst.cpu()]))
            super().copy_slots(src, dst)
        except RuntimeError as e:
            raise self.tp.fail(e) from e
