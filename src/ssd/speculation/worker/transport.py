"""Message transport between the engine (rank 0) and one draft worker (rank 1).

Each link is its own two-rank gloo process group built on its own TCP store (not torch's global
default group), so several engines, each with its own worker, can live in one process. A message
is a header (kind, number of ints, number of floats) and at most one int64 and one float32 payload.

A doorbell counter in the store lets a busy receiver ask "has a message arrived?" between pieces of
work (gloo's receive cannot be polled: it completes only inside wait()).
"""
from __future__ import annotations

import socket
from datetime import timedelta

import torch
import torch.distributed as dist

from ssd.speculation.worker import messages as m

_HEADER = 3


class Channel:
    def __init__(self, host: str, port: int, rank: int, timeout_s: float, op_timeout_s: float | None = None):
        """timeout_s bounds the rendezvous; op_timeout_s (default: the same) bounds each send/receive."""
        self.rank, self.peer = rank, 1 - rank
        self.store = dist.TCPStore(host, port, world_size=2, is_master=rank == 0, timeout=timedelta(seconds=timeout_s))
        self.group = dist.ProcessGroupGloo(self.store, rank, 2, timedelta(seconds=op_timeout_s or timeout_s))
        self.received = 0
        self.vocab: int | None = None      # width of proposal rows in a Speculation (engine side)
        self.closed = False

    def pending(self) -> bool:
        """True when the peer has sent a message this side has not received yet."""
        return self.store.add(f"doorbell-{self.rank}", 0) > self.received

    def send(self, msg) -> None:
        kind, ints, floats = m.encode(msg)
        self.store.add(f"doorbell-{self.peer}", 1)      # ring first: a send may block until received
        header = torch.tensor([int(kind), ints.numel(), floats.numel()], dtype=torch.long)
        for t in (header, ints, floats):
            if t is header or t.numel():
                self.group.send([t.contiguous()], self.peer, 0).wait()

    def recv(self):
        header = torch.zeros(_HEADER, dtype=torch.long)
        self.group.recv([header], self.peer, 0).wait()
        kind, ni, nf = header.tolist()
        ints = torch.zeros(ni, dtype=torch.long)
        floats = torch.zeros(nf, dtype=torch.float32)
        for t in (ints, floats):
            if t.numel():
                self.group.recv([t], self.peer, 0).wait()
        self.received += 1
        return m.decode(kind, ints, floats, self.vocab)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            try:
                self.group.shutdown()
            except Exception:       # noqa: BLE001 - best effort at exit
                pass


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
