"""Shared-memory collectives of tensor-parallel ranks on one host (ssd/distributed/shm.py): exact
results against a reference in real processes (ops bigger than a slot, uneven widths, 3 ranks), the
negotiation's fallback to gloo when a rank cannot map the segment, and bounded waits."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

from ssd.distributed import shm
from ssd.distributed.group import TPGroup, make_store, negotiate_shm
from ssd.speculation.worker.client import _child_env
from ssd.speculation.worker.transport import free_port

pytestmark = pytest.mark.skipif(not shm.available(), reason="shared-memory collectives are x86 only")

RANK_SCRIPT = textwrap.dedent("""
    import sys, torch
    from ssd.distributed.group import TPGroup, make_store, negotiate_shm
    rank, world, port, slot = (int(a) for a in sys.argv[1:5])
    g = TPGroup(make_store("127.0.0.1", port, rank, world, 30), rank, world, 20.0, "127.0.0.1")
    import ssd.distributed.shm as shm
    shm_create = shm.create
    shm.create = lambda w: shm_create(w, slot)          # small slots: every op below spans several
    negotiate_shm(g)
    assert g.transport == "shm", g.transport
    gen = torch.Generator().manual_seed(1)
    for n in (1, 7, 1536, 70_001):
        xs = [torch.randn(n, generator=gen) for _ in range(world)]
        t = xs[rank].clone()
        g.all_reduce(t)
        ref = xs[0].clone()
        for x in xs[1:]:
            ref += x
        assert torch.equal(t, ref), ("all_reduce", n)
        widths = [n // world + (r < n % world) for r in range(world)]     # uneven column slices
        cols = torch.randn(3, widths[rank], generator=torch.Generator().manual_seed(rank * 100 + n))
        got = g.gather_columns(cols, widths)
        if rank == 0:
            want = torch.cat([torch.randn(3, widths[r], generator=torch.Generator().manual_seed(r * 100 + n))
                              for r in range(world)], 1)
            assert torch.equal(got, want), ("gather", n)
        else:
            assert got is None
    for n in (0, 5, 50_000):
        if rank == 0:
            g.send_command(1, torch.arange(n) * 3)
        else:
            kind, payload = g.recv_command()
            assert kind == 1 and torch.equal(payload, torch.arange(n) * 3), ("command", n)
    rows = g.gather_floats([float(rank), 2.5])
    assert rows == [[float(r), 2.5] for r in range(world)], rows
    g.close()
    print("ok", rank)
    """)


@pytest.mark.parametrize("world", [2, 3])
def test_collectives_over_shared_memory_are_exact_in_real_processes(tmp_path, world):
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(world), str(port), "4096"],
                              env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert out.startswith("ok")


def _pair(monkeypatch=None, refuse_rank: int | None = None, **kw):
    """Two TPGroups in two threads of this process (ranks 0 and 1), negotiated."""
    port = free_port()
    groups: dict[int, TPGroup] = {}
    errors: list[BaseException] = []
    if refuse_rank is not None:
        real = shm.ShmChannel

        class Refusing(real):
            def __init__(self, path, nonce, size, rank, *a, **k):
                if rank == refuse_rank:
                    raise ValueError("not this host")
                super().__init__(path, nonce, size, rank, *a, **k)
        monkeypatch.setattr(shm, "ShmChannel", Refusing)

    def join(rank):
        try:
            g = TPGroup(make_store("127.0.0.1", port, rank, 2, 30), rank, 2, 2.0, "127.0.0.1")
            negotiate_shm(g, **(kw if rank == 0 else {}))
            groups[rank] = g
        except BaseException as e:  # noqa: BLE001
            errors.append(e)
    ts = [threading.Thread(target=join, args=(r,)) for r in (0, 1)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert not errors, errors
    return groups[0], groups[1]


def _reduce_both(g0, g1):
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([10.0, 20.0])
    t = threading.Thread(target=g1.all_reduce, args=(b,))
    t.start()
    g0.all_reduce(a)
    t.join(30)
    return a, b


def test_a_rank_that_cannot_map_the_segment_makes_the_group_use_gloo(monkeypatch):
    g0, g1 = _pair(monkeypatch, refuse_rank=1)
    try:
        assert g0.transport == g1.transport == "gloo"
        a, b = _reduce_both(g0, g1)
        assert a.tolist() == b.tolist() == [11.0, 22.0]
    finally:
        g0.close()
        g1.close()


def test_gloo_when_not_wanted_and_shm_otherwise():
    for want, transport in ((False, "gloo"), (True, "shm")):
        g0, g1 = _pair(want=want)
        try:
            assert g0.transport == g1.transport == transport
            a, b = _reduce_both(g0, g1)
            assert a.tolist() == b.tolist() == [11.0, 22.0]
            assert (g0.wait_s >= 0) == (transport == "shm")
        finally:
            g0.close()
            g1.close()


def test_wait_for_a_peer_counts_only_inside_collectives():
    """wait_s is a part of comm_s (the all-reduces and gathers): a wait for a late peer in a stats
    exchange is in neither (it was counted in wait_s alone once, which made wait_s > comm_s)."""
    g0, g1 = _pair(want=True)
    try:
        assert g0.transport == "shm"
        late = threading.Thread(target=lambda: (time.sleep(0.2), g1.gather_floats([1.0])))
        late.start()
        g0.gather_floats([0.0])                 # rank 0 waits ~0.2 s for rank 1, outside a collective
        late.join(30)
        assert g0.shm.wait_s >= 0.1             # the channel saw the wait
        assert g0.wait_s == g0.comm_s == 0.0    # the collectives' share did not
        t = threading.Thread(target=lambda: (time.sleep(0.2), g1.all_reduce(torch.ones(3))))
        t.start()
        g0.all_reduce(torch.ones(3))            # the same wait inside an all-reduce is counted
        t.join(30)
        assert 0.1 <= g0.wait_s <= g0.comm_s
    finally:
        g0.close()
        g1.close()


def test_the_segment_file_is_gone_once_the_group_formed():
    import glob

    before = set(glob.glob(f"{shm._dir()}/ssd-tp-*"))
    g0, g1 = _pair()
    try:
        assert g0.transport == "shm"
        assert set(glob.glob(f"{shm._dir()}/ssd-tp-*")) == before
    finally:
        g0.close()
        g1.close()


def test_a_peer_that_never_arrives_times_out_and_a_dead_one_is_reported_at_once():
    path, nonce, size = shm.create(2, 4096)
    try:
        ch = shm.ShmChannel(path, nonce, size, 0, 2, timeout_s=1.0)
        t0 = time.monotonic()
        with pytest.raises(shm.ShmTimeout, match="rank 1 did not reach collective #1 within 1s"):
            ch.all_reduce(torch.ones(4))
        assert 0.9 < time.monotonic() - t0 < 10
        ch2 = shm.ShmChannel(path, nonce, size, 0, 2, timeout_s=60.0)

        def gone():
            raise shm.ShmTimeout("tensor-parallel rank 1 exited")
        ch2.peer_check = gone
        t0 = time.monotonic()
        with pytest.raises(shm.ShmTimeout, match="exited"):
            ch2.all_reduce(torch.ones(4))
        assert time.monotonic() - t0 < 5
    finally:
        os.unlink(path)


def test_a_stale_or_foreign_segment_is_refused():
    path, nonce, size = shm.create(2, 4096)
    try:
        with pytest.raises(ValueError, match="nonce differs"):
            shm.ShmChannel(path, "00" * 16, size, 1, 2, 1.0)
        with pytest.raises(ValueError, match="wrong size"):
            shm.ShmChannel(path, nonce, size + 1, 1, 2, 1.0)
    finally:
        os.unlink(path)
