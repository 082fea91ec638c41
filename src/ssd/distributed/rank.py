"""A tensor-parallel rank 1..N-1: joins rank 0's store, loads its shard of the target, then runs the
commands rank 0 broadcasts (forward one packed batch over its shard and KV heads and send rank 0 its
vocab columns of the logits, copy KV slots) until told to stop or rank 0 goes away.

Started by the engine (`python -m ssd.distributed.rank ...`), or by hand on another host:
`ssd tp-rank --connect HOST:PORT --rank R --world-size N` (docs/ARCHITECTURE.md, "Tensor parallel target").
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time

import torch

from ssd.distributed.group import (COPY, FORWARD, SHUTDOWN, STATS, TPGroup, decode_batch, is_decode, make_store,
                                   negotiate_shm, stat_row)

log = logging.getLogger(__name__)

CONFIG_KEY, KV_KEY = "ssd/config", "ssd/kv"


def ready_key(rank: int) -> str:
    return f"ssd/rank{rank}/ready"


def bye_key(rank: int) -> str:
    """Set by a rank once its gloo groups are shut down after SHUTDOWN: rank 0 closes its own only
    then (both sides tearing down one link at once could abort a process in gloo's teardown)."""
    return f"ssd/rank{rank}/bye"


def error_key(rank: int) -> str:
    return f"ssd/rank{rank}/error"


class Reducer:
    """The model's collectives (all-reduce when called, `gather` of the logits columns), bound to the
    group once it exists (the shard is loaded first)."""

    def __init__(self):
        self.group: TPGroup | None = None

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(t)

    def gather(self, t: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        return self.group.gather_columns(t, widths)


def pin(cores: list[int] | None, threads: int | None) -> None:
    if cores:
        os.sched_setaffinity(0, cores)
    n = threads or (len(cores) if cores else None)
    if n:
        torch.set_num_threads(n)


def _watch_parent(parent_pid: int) -> None:
    """A rank spawned by the engine exits when the engine process is gone (no orphans)."""
    def watch():
        while True:
            if os.getppid() != parent_pid:
                os._exit(3)
            time.sleep(0.5)
    threading.Thread(target=watch, daemon=True, name="ssd-tp-parent-watch").start()


def _engine_alive(store):
    """While idle on shared memory: ask rank 0's store about once a second (it is gone with rank 0)."""
    last = [time.monotonic()]

    def check():
        now = time.monotonic()
        if now - last[0] > 1.0:
            last[0] = now
            store.check([CONFIG_KEY])       # raises once rank 0's store is gone
    return check


def serve(host: str, port: int, rank: int, world: int, model: str | None = None, device: str | None = None,
          threads: int | None = None, cores: list[int] | None = None, timeout_s: float = 60.0) -> None:
    from ssd.engine.model_runner import ModelRunner, StepBatch
    from ssd.models.loader import load_model

    pin(cores, threads)
    store = make_store(host, port, rank, world, timeout_s)
    conf = json.loads(store.get(CONFIG_KEY))
    try:
        if conf["world"] != world:
            raise ValueError(f"this rank was started with --world-size {world} but the engine at {host}:{port} "
                             f"runs tensor_parallel_size={conf['world']}")
        if not 0 < rank < world:
            raise ValueError(f"--rank must be in [1, {world - 1}] (rank 0 is the engine), got {rank}")
        from ssd.distributed.devices import remote_rank_device

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        dev = torch.device(device or remote_rank_device(conf["device"], rank, gpus))
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        reducer = Reducer()
        loaded = load_model(model or conf["model"], conf["dtype"], dev, conf["max_positions"], False,
                            shard=(rank, world), reduce=reducer, gather=reducer.gather)
        kv = json.loads(store.get(KV_KEY))
        runner = ModelRunner(loaded.model, kv["num_blocks"], kv["block_size"], dev)
    except Exception as e:
        store.set(error_key(rank), f"{type(e).__name__}: {e}")
        raise
    store.set(ready_key(rank), str(os.getpid()))
    from ssd.speculation.worker.transport import local_address

    group = TPGroup(store, rank, world, conf["timeout_s"], local_address(host, port), device=dev)
    negotiate_shm(group)
    if group.shm is not None:
        group.shm.idle_check = _engine_alive(store)
    reducer.group = group
    busy = decode_busy = 0.0
    log.info("tensor-parallel rank %d/%d is up (pid %d), collectives over %s", rank, world, os.getpid(),
             group.transport)
    try:
        while True:
            kind, payload = group.recv_command()
            t0 = time.perf_counter()
            if kind == FORWARD:
                tokens, positions, query_lens, ctx, rows = decode_batch(payload)
                group.decode = is_decode(query_lens)
                hidden = runner.run(StepBatch(tokens, positions, query_lens, ctx, rows))
                if rows:
                    with torch.inference_mode():
                        runner.model.logits(hidden[torch.tensor(rows, dtype=torch.long, device=dev)])
                if group.decode:
                    decode_busy += time.perf_counter() - t0
                group.decode = False
            elif kind == COPY:
                src, dst = payload.chunk(2)
                runner.copy_slots(src, dst)
            elif kind == STATS:
                group.gather_floats(stat_row(busy, decode_busy, group))
            elif kind == SHUTDOWN:
                break
            else:
                raise RuntimeError(f"unknown tensor-parallel command {kind}")
            busy += time.perf_counter() - t0
    finally:
        group.close()
    try:
        store.set(bye_key(rank), "1")
    except Exception:       # noqa: BLE001 - rank 0 may be gone: nothing waits for this then
        pass


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="ssd tp-rank", description="one rank of a tensor-parallel target")
    p.add_argument("--connect", required=True, help="HOST:PORT of the engine (rank 0)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--model", default=None, help="the model's path on this host (default: the engine's)")
    p.add_argument("--device", default=None,
                   help="default: 'cpu' for a CPU engine; for a CUDA engine cuda:(RANK mod this host's GPU count)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--cores", default=None, help="comma-separated CPU cores to pin this rank to")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the engine at start-up")
    p.add_argument("--parent-pid", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[tp-rank {a.rank}] %(levelname)s %(message)s")
    if a.parent_pid:
        _watch_parent(a.parent_pid)
    host, port = a.connect.rsplit(":", 1)
    cores = [int(c) for c in a.cores.split(",")] if a.cores else None
    try:
        serve(host, int(port), a.rank, a.world_size, a.model, a.device, a.threads, cores, a.timeout)
    except Exception as e:  # noqa: BLE001 - the engine sees the error key or a broken group
        log.error("rank %d stopped: %s", a.rank, e)
        sys.exit(1)


if __name__ == "__main__":
    main()
