"""The tensor-parallel process group: rank 0 (the engine) and ranks 1..N-1 (ssd/distributed/rank.py).

Its own TCP store and two gloo groups on it (never torch's global default group, so it can live
next to an SSD draft link or a second engine in one process):

- `cmd`: rank 0 broadcasts the next command's header to the ranks. Idle ranks wait here for as
  long as the engine is idle, so its timeout is long; a dead rank 0 closes the sockets, which ends
  that wait at once. Rank 0's own wait for the header broadcast is bounded by `timeout_s` (a gloo
  send completes only once every peer has posted its receive: a rank stopped before it got back to
  waiting for a command would otherwise keep rank 0 waiting for the idle timeout).
- `step`: the command's payload, the all-reduces of a forward and the gather of the vocab-parallel
  logits, bounded by `timeout_s`: a rank that dies or hangs mid-step makes rank 0 fail in bounded
  time, never hang.

Both groups bind gloo to the rank's address on the link (rank 0: the address it listens on; other
ranks: their source address toward rank 0), as the draft-worker link does (transport.py): gloo's
default, the hostname's address, is often 127.0.0.1, which another host cannot reach.

Ranks on one host use a shared-memory segment instead (ssd/distributed/shm.py, negotiated in
`negotiate_shm`): the commands, their payloads and every collective of a step then go through it and
gloo only carries the set-up and the shutdown. `transport` says which one a group uses.

Ranks on CUDA GPUs (one each, ssd/distributed/devices.py) run the all-reduces and the logits gather
over a third group, NCCL (`nccl`), on their device tensors; commands and stats stay on the CPU as
above. NOT RUN ON A GPU BY OUR TESTS: this workplace has lent at most one GPU, and NCCL refuses two
ranks on one device; tests/test_cuda.py has the check for a host with two or more.

Time spent in collectives (all-reduces and logits gathers) is accumulated per rank (`comm_s`; counts
`reduces`, `gathers`) for the bench.
"""
from __future__ import annotations

import gc
import logging
import time
from datetime import timedelta

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

IDLE_TIMEOUT = timedelta(days=7)

DECODE_MAX_QUERY = 16      # a forward whose every query is at most this long counts as a decode step

# commands (header: kind, payload length)
FORWARD, COPY, SHUTDOWN, STATS = 1, 2, 3, 4


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed, died, or did not join in time."""


def make_store(host: str, port: int, rank: int, world: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size=world, is_master=rank == 0, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _nccl(store: dist.Store, rank: int, world: int, timeout: timedelta, device: torch.device):
    """The collectives of ranks on CUDA GPUs (NCCL enforces `timeout` by aborting the process)."""
    if not dist.is_nccl_available():
        raise TensorParallelError("tensor parallel on CUDA needs NCCL, which this torch build lacks: install a "
                                  "CUDA build of torch, or run the target on device='cpu'")
    torch.cuda.set_device(device)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    pg = dist.ProcessGroupNCCL(store, rank, world, opts)
    if hasattr(pg, "_set_sequence_number_for_group"):
        pg._set_sequence_number_for_group()
    return pg


def _gloo(store: dist.Store, rank: int, world: int, timeout: timedelta, address: str | None):
    if address is None:
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    from ssd.speculation.worker.transport import gloo_device

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [gloo_device(address)]
    return dist.ProcessGroupGloo(store, rank, world, opts)


class TPGroup:
    def __init__(self, store: dist.Store, rank: int, world: int, timeout_s: float, address: str | None = None,
                 device: torch.device | str = "cpu"):
        """address: this rank's address on the link, for gloo to bind to (None: gloo's default);
        device: this rank's compute device (CUDA: the collectives run over NCCL)."""
        self.store, self.rank, self.world = store, rank, world
        self.cmd = _gloo(dist.PrefixStore("tp-cmd", store), rank, world, IDLE_TIMEOUT, address)
        self.step = _gloo(dist.PrefixStore("tp-step", store), rank, world, timedelta(seconds=timeout_s), address)
        self.timeout = timedelta(seconds=timeout_s)
        self.device = torch.device(device)
        self.nccl = None
        if self.device.type == "cuda":
            self.nccl = _nccl(dist.PrefixStore("tp-nccl", store), rank, world, self.timeout, self.device)
        self.comm_s = 0.0
        self.reduces = 0
        self.gathers = 0
        self.closed = False
        self.shm = None             # a ShmChannel once negotiate_shm agreed on one
        self.decode = False         # set by the caller around a decode-step forward: its collectives
        self.decode_comm_s = 0.0    # are also counted here (and their waits in decode_wait_s)
        self.decode_wait_s = 0.0
        self.comm_wait_s = 0.0      # of comm_s, waiting for a slower peer (shared memory only)

    @property
    def transport(self) -> str:
        """What carries the collectives: "nccl", "shm" or "gloo"."""
        return "nccl" if self.nccl is not None else "gloo" if self.shm is None else "shm"

    @property
    def wait_s(self) -> float:
        """Of comm_s, the time spent waiting for a slower peer to arrive (shared memory only: gloo's
        wait and wire time are not told apart; -1 then). Over NCCL comm_s is the host's launch time
        only (the collectives run asynchronously on the GPU). Waits outside the all-reduces and
        gathers (for a command, for a stats reply) are not counted: they are not in comm_s either."""
        return -1.0 if self.shm is None or self.nccl is not None else self.comm_wait_s

    def _shm_wait(self) -> float:
        return 0.0 if self.shm is None else self.shm.wait_s

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks (fp32 on the wire for 16-bit activations)."""
        t0, w0 = time.perf_counter(), self._shm_wait()
        buf = t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()
        if self.nccl is not None:
            self.nccl.allreduce([buf]).wait()
        elif self.shm is not None:
            self.shm.all_reduce(buf)
        else:
            self.step.allreduce([buf]).wait()
        if buf is not t:
            t.copy_(buf)
        self._count(t0, w0)
        self.reduces += 1
        return t

    def _count(self, t0: float, w0: float) -> None:
        dt = time.perf_counter() - t0
        self.comm_s += dt
        waited = self._shm_wait() - w0
        self.comm_wait_s += waited
        if self.decode:
            self.decode_comm_s += dt
            self.decode_wait_s += waited

    def gather_columns(self, t: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Rank 0: every rank's `t` [N, widths[rank]] side by side, [N, sum(widths)] fp32; other
        ranks: None. Padded to the widest slice on the wire (gloo gathers equal shapes)."""
        t0, w0 = time.perf_counter(), self._shm_wait()
        buf = t.new_zeros((t.shape[0], max(widths)), dtype=torch.float32)
        buf[:, :t.shape[1]] = t
        if self.nccl is not None:       # every rank gets the columns (NCCL's all-gather); rank 0 uses them
            out = [torch.empty_like(buf) for _ in range(self.world)]
            self.nccl.allgather([out], [buf]).wait()
        elif self.shm is not None:
            out = self.shm.gather(buf) or []
        else:
            out = [torch.empty_like(buf) for _ in range(self.world)] if self.rank == 0 else []
            self.step.gather(out, buf, 0, self.timeout).wait(self.timeout)
        self._count(t0, w0)
        self.gathers += 1
        if self.rank != 0:
            return None
        return torch.cat([o[:, :w] for o, w in zip(out, widths)], dim=1)

    def send_command(self, kind: int, payload: torch.Tensor | None = None) -> None:
        """Rank 0: the header, then the int64 payload."""
        n = 0 if payload is None else payload.numel()
        if self.shm is not None:
            head = torch.tensor([kind, n], dtype=torch.long)
            self.shm.broadcast_longs(head if payload is None else torch.cat([head, payload.reshape(-1).long()]))
            return
        self.cmd.broadcast(torch.tensor([kind, n], dtype=torch.long), 0).wait(self.timeout)
        if n:
            self.step.broadcast(payload.contiguous(), 0).wait()

    def recv_command(self) -> tuple[int, torch.Tensor]:
        """Ranks 1..N-1: wait (unbounded while rank 0 is idle) for the next command."""
        if self.shm is not None:
            msg = self.shm.broadcast_longs(None, idle=True)
            return int(msg[0]), msg[2:2 + int(msg[1])]
        header = torch.zeros(2, dtype=torch.long)
        self.cmd.broadcast(header, 0).wait()
        kind, n = header.tolist()
        payload = torch.zeros(n, dtype=torch.long)
        if n:
            self.step.broadcast(payload, 0).wait()
        return kind, payload

    def gather_floats(self, values: list[float]) -> list[list[float]]:
        """Every rank's `values` (same length on all ranks), on every rank."""
        t = torch.tensor(values, dtype=torch.float64)
        if self.shm is not None:
            return [o.tolist() for o in self.shm.all_gather(t)]
        out = [torch.zeros_like(t) for _ in range(self.world)]
        self.step.allgather([out], [t]).wait()
        return [o.tolist() for o in out]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self.shm is not None:
            self.shm.close()
        groups = [g for g in (self.nccl, self.step, self.cmd) if g is not None]
        self.nccl = self.step = self.cmd = None
        while groups:
            # shut each down and destroy it here, while the interpreter is whole: left to its finalization,
            # a group's threads and pairs were torn down in no set order and now and then aborted the
            # process at exit ("terminate called without an active exception", exit -6)
            try:
                groups.pop().shutdown()
            except Exception:       # noqa: BLE001 - best effort at exit
                pass
        gc.collect()


def stat_row(busy_s: float, decode_busy_s: float, g: "TPGroup") -> list[float]:
    """One rank's cumulative timings for TPTarget.stats (the same order on every rank)."""
    return [busy_s, g.comm_s, float(g.reduces), float(g.gathers), g.wait_s, decode_busy_s, g.decode_comm_s,
            g.decode_wait_s]


def is_decode(query_lens) -> bool:
    return bool(query_lens) and max(query_lens) <= DECODE_MAX_QUERY


def negotiate_shm(group: TPGroup, want: bool = True, spin: bool = True) -> None:
    """Collective over the group's store: rank 0 offers a shared-memory segment (when `want`, and on
    x86), every rank says whether it mapped it (it has not on another host), and the group uses it only
    if all did. Bounded by the group's timeout; the segment's file is unlinked before this returns.
    spin (rank 0's word for all): busy-wait before yielding; False when the ranks share cores."""
    import json
    import os

    from ssd.distributed import shm

    store, rank, world, timeout = group.store, group.rank, group.world, group.timeout
    answer = lambda r: f"tp-shm/answer/{r}"         # noqa: E731
    if rank == 0:
        offer = None
        if want and shm.available() and world <= shm.MAX_WORLD:
            try:
                path, nonce, size = shm.create(world)
                offer = dict(path=path, nonce=nonce, size=size, spin=shm.SPIN if spin else 0)
            except OSError as e:
                log.info("tensor parallel: no shared-memory segment (%s): collectives over gloo", e)
        store.set("tp-shm/offer", json.dumps(offer))
        try:
            ch = shm.ShmChannel(offer["path"], offer["nonce"], offer["size"], 0, world, timeout.total_seconds(),
                                offer["spin"]) if offer else None
            if world > 1:
                store.wait([answer(r) for r in range(1, world)], timeout)
            answers = [store.get(answer(r)).decode() for r in range(1, world)]
        finally:
            if offer:
                os.unlink(offer["path"])
        use = ch is not None and all(a == "ok" for a in answers)
        if ch is not None and not use:
            log.info("tensor parallel: rank(s) %s could not map the shared-memory segment (%s): collectives over "
                     "gloo", [r + 1 for r, a in enumerate(answers) if a != "ok"], "; ".join(set(answers)))
            ch.close()
        store.set("tp-shm/use", "1" if use else "0")
    else:
        offer = json.loads(store.get("tp-shm/offer"))
        ch, said = None, "not offered"
        if offer:
            try:
                ch = shm.ShmChannel(offer["path"], offer["nonce"], offer["size"], rank, world,
                                    timeout.total_seconds(), offer["spin"])
                said = "ok"
            except (OSError, ValueError) as e:
                said = f"{type(e).__name__}: {e}"
        store.set(answer(rank), said)
        use = store.get("tp-shm/use").decode() == "1"
        if ch is not None and not use:
            ch.close()
    group.shm = ch if use else None


def encode_batch(tokens, positions, query_lens, ctx_slots, logit_rows=()) -> torch.Tensor:
    """One int64 tensor: [n, T, L, query_lens(n), ctx_lens(n), tokens(T), positions(T), logit_rows(L),
    slots...]."""
    ctx = [torch.as_tensor(c, dtype=torch.long).reshape(-1) for c in ctx_slots]
    head = torch.tensor([len(query_lens), len(tokens), len(logit_rows), *query_lens, *[len(c) for c in ctx],
                         *tokens, *positions, *logit_rows], dtype=torch.long)
    return torch.cat([head, *ctx]) if ctx else head


def decode_batch(t: torch.Tensor):
    """-> (tokens, positions, query_lens, ctx_slots, logit_rows) as encode_batch took them."""
    n, T, L = int(t[0]), int(t[1]), int(t[2])
    i = 3
    query_lens = t[i:i + n].tolist()
    ctx_lens = t[i + n:i + 2 * n].tolist()
    i += 2 * n
    tokens = t[i:i + T].tolist()
    positions = t[i + T:i + 2 * T].tolist()
    i += 2 * T
    logit_rows = t[i:i + L].tolist()
    i += L
    ctx_slots = list(t[i:].split(ctx_lens)) if n else []
    return tokens, positions, query_lens, ctx_slots, logit_rows
