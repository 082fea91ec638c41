"""Message transport between the engine (rank 0) and one draft worker (rank 1).

Each link is its own two-rank gloo process group built on its own TCP store (not torch's global
default group), so several engines, each with its own worker, can live in one process. A message
is a header (kind, number of ints, number of floats) and at most one int64 and one float32 payload.

A doorbell counter in the store lets a busy receiver ask "has a message arrived?" between pieces of
work (gloo's receive cannot be polled: it completes only inside wait()).

Network interface: gloo's default device binds to the address the machine's hostname resolves to,
often 127.0.0.1 or an address the peer cannot reach (another host, another network namespace). Each
side therefore binds gloo to the address of the link itself: the engine (rank 0) to the address it
listens on, the worker to its own address on the route to the engine (`local_address`).
GLOO_SOCKET_IFNAME, when set, names the interface instead (docs/ARCHITECTURE.md 4).
"""
from __future__ import annotations

import ipaddress
import os
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
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=op_timeout_s or timeout_s)
        opts._devices = [gloo_device(host if rank == 0 else local_address(host, port))]
        self.group = dist.ProcessGroupGloo(self.store, rank, 2, opts)
        self.received = 0
        self.vocab: int | None = None      # width of proposal rows in a Speculation (engine side)
        self.closed = False

    def pending(self) -> bool:
        """True when the peer has sent a message this side has not received yet."""
        return self.store.add(f"doorbell-{self.rank}", 0) > self.received

    def send(self, msg) -> None:
        self.post(msg).wait()

    def post(self, msg) -> "Posted":
        """Start sending `msg`; the returned handle's wait() returns once the peer has received it.
        (A gloo send completes only when the peer posts the matching receive: a worker busy with a
        draft step takes it at the end of that step, so an engine fanning a round out to several
        workers posts to all of them before waiting for any.)"""
        kind, ints, floats = m.encode(msg)
        self.store.add(f"doorbell-{self.peer}", 1)      # ring first: the peer stops at its next poll
        header = torch.tensor([int(kind), ints.numel(), floats.numel()], dtype=torch.long)
        tensors = [t.contiguous() for t in (header, ints, floats) if t is header or t.numel()]
        return Posted([self.group.send([t], self.peer, 0) for t in tensors], tensors)

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


class Posted:
    """Sends in flight (the tensors are kept alive until they complete)."""

    def __init__(self, works, tensors):
        self.works, self.tensors = works, tensors

    @staticmethod
    def joined(posted: list["Posted"]) -> "Posted":
        """One handle for several posts (waited for in the order they were posted)."""
        return Posted([w for p in posted for w in p.works], [t for p in posted for t in p.tensors])

    def done(self) -> bool:
        """Whether the peer has received everything (without waiting)."""
        if all(w.is_completed() for w in self.works):
            self.wait()             # raises if a send failed; releases the tensors
            return True
        return False

    def wait(self) -> None:
        for w in self.works:
            w.wait()
        self.works, self.tensors = [], []


def local_address(host: str, port: int) -> str:
    """This machine's address on the route to host:port (no packet is sent: a UDP socket is only
    connected, which makes the kernel pick the source address)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((host, port))
            return s.getsockname()[0]
    except OSError:
        return ""           # unresolvable here: gloo's default choice (hostname) decides


def gloo_device(address: str):
    """A gloo device bound to `address` (GLOO_SOCKET_IFNAME, when set, names the interface instead;
    a wildcard or empty address leaves the choice to gloo: the hostname's address)."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if ifname:
        return dist.ProcessGroupGloo.create_device(interface=ifname.split(",")[0])
    try:
        wildcard = ipaddress.ip_address(address).is_unspecified
    except ValueError:
        wildcard = not address      # a host name: gloo resolves it
    if wildcard:
        return dist.ProcessGroupGloo.create_default_device()
    return dist.ProcessGroupGloo.create_device(hostname=address)
