"""Which device each tensor-parallel rank computes on, and which backend carries its collectives.
Pure functions (no torch import): tested on their own in tests/test_tensor_parallel.py.

- CPU: every rank on "cpu"; collectives over shared memory on one host, else gloo (TCP).
- CUDA: one GPU per rank, collectives over NCCL. Ranks the engine spawns on its own host take the
  GPUs after rank 0's (an engine on cuda:N puts rank r on cuda:N+r); a rank started by hand on
  another host (`ssd tp-rank`) takes cuda:(r mod its GPU count) unless given --device. Commands and
  their payloads stay on the CPU (shared memory or gloo) either way.
"""
from __future__ import annotations


def _parse(device: str) -> tuple[str, int | None]:
    kind, _, index = str(device).partition(":")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"tensor parallel runs on 'cpu' or 'cuda[:N]', not {device!r}")
    if not index:
        return kind, None
    if not index.isdigit():
        raise ValueError(f"{device!r} is not a device: use 'cpu' or 'cuda:N'")
    return kind, int(index)


def spawned_rank_devices(device: str, world: int, gpu_count: int) -> list[str]:
    """Devices of ranks 0..world-1 that the engine on `device` starts on its own host."""
    kind, index = _parse(device)
    if kind == "cpu":
        return ["cpu"] * world
    base = index or 0
    if base + world > gpu_count:
        raise ValueError(f"tensor_parallel_size={world} on {device} needs GPUs cuda:{base}..cuda:{base + world - 1} "
                         f"(one per rank, rank 0 on {device}), but this host has {gpu_count}; lower "
                         "tensor_parallel_size, start the engine on a lower cuda:N, or start ranks on other hosts "
                         "(tp_host / --tp-host and `ssd tp-rank`)")
    return [f"cuda:{base + r}" for r in range(world)]


def remote_rank_device(engine_device: str, rank: int, gpu_count: int) -> str:
    """Default device of a rank started by hand (`ssd tp-rank` without --device) for an engine on
    `engine_device`: the CPU for a CPU engine, else the rank's GPU on its own host."""
    kind, _ = _parse(engine_device)
    if kind == "cpu":
        return "cpu"
    if gpu_count < 1:
        raise ValueError(f"the engine runs its tensor-parallel target on {engine_device}, but this host has no "
                         "CUDA GPU: run this rank on a host with one, or pass --device")
    return f"cuda:{rank % gpu_count}"
