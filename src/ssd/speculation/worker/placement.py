"""Where SSD's draft workers run (docs/ARCHITECTURE.md 4.2): remote addresses, or local CPU cores.

Default local placement of M workers: one core each, the last M cores this process may use
(`os.sched_getaffinity`), in order; the target decodes on the others. With a single usable core a
single worker shares it (unpinned); several workers need M + 1 cores. `draft_cores` overrides the
placement: a flat list pins the one worker, a list of lists gives each worker its cores (workers
never share a core; the target may, when cores are given explicitly).
"""
from __future__ import annotations

from typing import Sequence

Cores = list[int]


def split_hosts(draft_host: str | Sequence[str] | None) -> list[str] | None:
    """'H:P' or 'H1:P1,H2:P2' or a list of 'H:P' -> one address per worker (None: local workers)."""
    if draft_host is None:
        return None
    hosts = [h.strip() for h in draft_host.split(",")] if isinstance(draft_host, str) else [str(h) for h in draft_host]
    for h in hosts:
        host, _, port = h.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"draft_host {h!r} is not HOST:PORT (e.g. 10.0.0.2:29500); give one per draft worker")
    if len(set(hosts)) != len(hosts):
        raise ValueError(f"draft_host lists an address twice ({', '.join(hosts)}): each worker needs its own port")
    return hosts


def per_worker_cores(draft_cores, num_workers: int) -> list[Cores] | None:
    """draft_cores as given -> one core list per worker (None: default placement)."""
    if draft_cores is None:
        return None
    cores = list(draft_cores)
    if cores and all(isinstance(c, int) for c in cores):
        if num_workers != 1:
            raise ValueError(f"draft_cores {cores} is one core list but there are {num_workers} draft workers: "
                             "give one list per worker, e.g. [[2], [3]] (CLI: --draft-cores 2/3)")
        cores = [cores]
    cores = [list(c) for c in cores]
    if len(cores) != num_workers or any(not c for c in cores):
        raise ValueError(f"draft_cores has {len(cores)} core list(s) for {num_workers} draft worker(s): give one "
                         "non-empty list per worker, e.g. [[2], [3]] (CLI: --draft-cores 2/3)")
    seen: dict[int, int] = {}
    for w, cs in enumerate(cores):
        for c in cs:
            if c in seen and seen[c] != w:
                raise ValueError(f"draft_cores gives core {c} to draft workers {seen[c]} and {w}: workers must not "
                                 "share a core (they would slow each other down)")
            seen[c] = w
    return cores


def local_cores(usable: Sequence[int], num_workers: int, draft_cores=None) -> list[Cores | None]:
    """The cores of each local worker (None: unpinned) for a process allowed to run on `usable`."""
    given = per_worker_cores(draft_cores, num_workers)
    allowed = sorted(usable)
    if given is not None:
        bad = sorted({c for cs in given for c in cs} - set(allowed))
        if bad:
            raise ValueError(f"draft_cores names core(s) {bad}, which this process may not use (allowed: {allowed})")
        return given
    if num_workers == 1 and len(allowed) == 1:
        return [None]           # one core: the worker shares it with the target
    if len(allowed) < num_workers + 1:
        raise ValueError(f"{num_workers} local draft workers need {num_workers + 1} CPU cores (one each, and one for "
                         f"the target) but this process may use {len(allowed)} ({allowed}): lower num_draft_workers "
                         "(CLI: --draft-workers), give draft_cores per worker explicitly, or run workers on other "
                         "hosts (draft_host)")
    return [[c] for c in allowed[len(allowed) - num_workers:]]


def cores_taken(placement: Sequence[Cores | None]) -> int:
    """How many cores a `local_cores` placement gives its workers (an unpinned worker counts one)."""
    return sum(len(c) if c else 1 for c in placement)
