"""Typed tensor messages between the engine and a draft worker over torch.distributed.

A message is a fixed header (int64: type, number of ints, number of floats) followed by at most
one int64 and one float32 payload tensor. No pickle crosses the wire; both ends agree on the
payload layout per message type (documented where each message is built).
"""
from __future__ import annotations

import enum
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

HEADER = 4


class Msg(enum.IntEnum):
    HELLO = 1        # worker -> engine: ints [vocab_size, pid]
    ADD = 2          # engine -> worker: a new sequence (see draft_worker.AddRequest)
    SPECULATE = 3    # engine -> worker: outcomes of the last round, asks for the next speculation
    SPECULATION = 4  # worker -> engine: draft tokens (+ proposal probabilities when sampling)
    FREE = 5         # engine -> worker: ints [seq_id, ...]
    SHUTDOWN = 6
    ERROR = 7        # worker -> engine: floats empty, ints = utf-8 bytes of the message
    CONFIG = 8       # engine -> worker, right after HELLO: ints [target vocab width]


@dataclass
class Message:
    kind: Msg
    ints: torch.Tensor      # int64 [n]
    floats: torch.Tensor    # float32 [m]


class Channel:
    """Point-to-point messages with one peer over the default process group.

    A doorbell counter in the rendezvous store lets a busy receiver ask "has a message arrived?"
    between pieces of work (gloo's irecv cannot be polled: it completes only inside wait())."""

    def __init__(self, peer: int, store=None):
        self.peer = peer
        self.store = store
        self.received = 0

    def _bell_key(self, to: int) -> str:
        return f"doorbell-{to}"

    def pending(self) -> bool:
        """True when the peer has sent a message this side has not received yet."""
        if self.store is None:
            return False
        return self.store.add(self._bell_key(dist.get_rank()), 0) > self.received

    def send(self, kind: Msg, ints=None, floats=None) -> None:
        if self.store is not None:      # ring first: gloo's send blocks until the peer receives
            self.store.add(self._bell_key(self.peer), 1)
        it = torch.as_tensor(ints if ints is not None else [], dtype=torch.long).reshape(-1)
        ft = torch.as_tensor(floats if floats is not None else [], dtype=torch.float32).reshape(-1)
        dist.send(torch.tensor([int(kind), it.numel(), ft.numel(), 0], dtype=torch.long), self.peer)
        if it.numel():
            dist.send(it.contiguous(), self.peer)
        if ft.numel():
            dist.send(ft.contiguous(), self.peer)

    def recv(self) -> Message:
        return self.finish_recv(self.start_recv())

    def start_recv(self):
        """Begin receiving a header; returns (buffer, work). Poll work.is_completed()."""
        h = torch.zeros(HEADER, dtype=torch.long)
        return h, dist.irecv(h, self.peer)

    def finish_recv(self, pending) -> Message:
        h, work = pending
        work.wait()
        kind, ni, nf = int(h[0]), int(h[1]), int(h[2])
        ints = torch.zeros(ni, dtype=torch.long)
        floats = torch.zeros(nf, dtype=torch.float32)
        if ni:
            dist.recv(ints, self.peer)
        if nf:
            dist.recv(floats, self.peer)
        self.received += 1
        return Message(Msg(kind), ints, floats)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_group(host: str, port: int, rank: int, timeout_s: float):
    """Rendezvous through a TCP store hosted by rank 0 (the engine); returns the store."""
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(host, port, world_size=2, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    return store


def error_message(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode_error(ints: torch.Tensor) -> str:
    return bytes(ints.tolist()).decode("utf-8", "replace")
