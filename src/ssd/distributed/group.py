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

Time spent in collectives (all-reduces and logits gathers) is accumulated per rank (`comm_s`; counts
`reduces`, `gathers`) for the bench.
"""
from __future__ import annotations

import time
from datetime import timedelta

import torch
import torch.distributed as dist

IDLE_TIMEOUT = timedelta(days=7)

# commands (header: kind, payload length)
FORWARD, COPY, SHUTDOWN, STATS = 1, 2, 3, 4


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed, died, or did not join in time."""


def make_store(host: str, port: int, rank: int, world: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size=world, is_master=rank == 0, timeout=timedelta(seconds=timeout_s),
                         wait_for_workers=False)


def _gloo(store: dist.Store, rank: int, world: int, timeout: timedelta, address: str | None):
    if address is None:
        return dist.ProcessGroupGloo(store, rank, world, timeout)
    from ssd.speculation.worker.transport import gloo_device

    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = timeout
    opts._devices = [gloo_device(address)]
    return dist.ProcessGroupGloo(store, rank, world, opts)


class TPGroup:
    def __init__(self, store: dist.Store, rank: int, world: int, timeout_s: float, address: str | None = None):
        """address: this rank's address on the link, for gloo to bind to (None: gloo's default)."""
        self.store, self.rank, self.world = store, rank, world
        self.cmd = _gloo(dist.PrefixStore("tp-cmd", store), rank, world, IDLE_TIMEOUT, address)
        self.step = _gloo(dist.PrefixStore("tp-step", store), rank, world, timedelta(seconds=timeout_s), address)
        self.timeout = timedelta(seconds=timeout_s)
        self.comm_s = 0.0
        self.reduces = 0
        self.gathers = 0
        self.closed = False

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks (fp32 on the wire for 16-bit activations)."""
        t0 = time.perf_counter()
        buf = t if t.dtype == torch.float32 and t.is_contiguous() else t.float().contiguous()
        self.step.allreduce([buf]).wait()
        if buf is not t:
            t.copy_(buf)
        self.comm_s += time.perf_counter() - t0
        self.reduces += 1
        return t

    def gather_columns(self, t: torch.Tensor, widths: list[int]) -> torch.Tensor | None:
        """Rank 0: every rank's `t` [N, widths[rank]] side by side, [N, sum(widths)] fp32; other
        ranks: None. Padded to the widest slice on the wire (gloo gathers equal shapes)."""
        t0 = time.perf_counter()
        buf = t.new_zeros((t.shape[0], max(widths)), dtype=torch.float32)
        buf[:, :t.shape[1]] = t
        out = [torch.empty_like(buf) for _ in range(self.world)] if self.rank == 0 else []
        self.step.gather(out, buf, 0, self.timeout).wait(self.timeout)
        self.comm_s += time.perf_counter() - t0
        self.gathers += 1
        if self.rank != 0:
            return None
        return torch.cat([o[:, :w] for o, w in zip(out, widths)], dim=1)

    def send_command(self, kind: int, payload: torch.Tensor | None = None) -> None:
        """Rank 0: the header, then the int64 payload."""
        n = 0 if payload is None else payload.numel()
        self.cmd.broadcast(torch.tensor([kind, n], dtype=torch.long), 0).wait(self.timeout)
        if n:
            self.step.broadcast(payload.contiguous(), 0).wait()

    def recv_command(self) -> tuple[int, torch.Tensor]:
        """Ranks 1..N-1: wait (unbounded while rank 0 is idle) for the next command."""
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
        out = [torch.zeros_like(t) for _ in range(self.world)]
        self.step.allgather([out], [t]).wait()
        return [o.tolist() for o in out]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for g in (self.step, self.cmd):
            try:
                g.shutdown()
            except Exception:       # noqa: BLE001 - best effort at exit
                pass


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
