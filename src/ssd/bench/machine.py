"""Describe the machine a benchmark ran on, and estimate its memory-read bandwidth.

Decoding small batches is memory-bound (every generated token reads all weights once), so the
bandwidth estimate gives a roofline for tokens/s: ``bandwidth / bytes_of_weights``.
"""
from __future__ import annotations

import datetime as _dt
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

# CPU flags that matter for the matmul kernels torch picks.
_FLAG_PREFIXES = ("avx512", "amx")
_FLAGS_EXACT = ("avx", "avx2", "fma", "f16c", "avx_vnni", "sse4_2", "neon", "asimd", "sve", "sve2", "bf16")


def _read(path: str) -> str | None:
    try:
        return Path(path).read_text()
    except OSError:
        return None


def _cpuinfo() -> dict[str, Any]:
    text = _read("/proc/cpuinfo") or ""
    model, flags, phys = None, set(), set()
    cur_phys = "0"
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key, val = key.strip(), val.strip()
        if key in ("model name", "Model", "cpu model") and model is None:
            model = val
        elif key in ("flags", "Features") and not flags:
            flags = set(val.split())
        elif key == "physical id":
            cur_phys = val
        elif key == "core id":
            phys.add((cur_phys, val))
    if model is None:
        model = platform.processor() or platform.machine() or None
    wanted = sorted(f for f in flags if f in _FLAGS_EXACT or f.startswith(_FLAG_PREFIXES))
    return {"model": model, "physical_cores": len(phys) or None, "flags": wanted}


def _meminfo_gib() -> dict[str, float | None]:
    out: dict[str, float | None] = {"total_gib": None, "available_gib": None}
    text = _read("/proc/meminfo")
    if text:
        for line in text.splitlines():
            key, _, val = line.partition(":")
            parts = val.split()
            if not parts:
                continue
            gib = round(int(parts[0]) / (1 << 20), 2)  # kB -> GiB
            if key == "MemTotal":
                out["total_gib"] = gib
            elif key == "MemAvailable":
                out["available_gib"] = gib
    else:
        try:
            pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
            out["total_gib"] = round(pages * size / (1 << 30), 2)
        except (ValueError, OSError, AttributeError):
            pass
    # A cgroup (container) limit, if tighter than the host's memory.
    limit = _read("/sys/fs/cgroup/memory.max") or _read("/sys/fs/cgroup/memory/memory.limit_in_bytes")
    if limit and limit.strip().isdigit():
        gib = int(limit) / (1 << 30)
        if out["total_gib"] is None or gib < out["total_gib"]:  # "unlimited" is a huge number
            out["cgroup_limit_gib"] = round(gib, 2)
    return out


def _cgroup_cpus() -> float | None:
    text = _read("/sys/fs/cgroup/cpu.max")
    if text:
        quota, _, period = text.strip().partition(" ")
        if quota.isdigit() and period.isdigit() and int(period) > 0:
            return round(int(quota) / int(period), 2)
    return None


def _cuda_devices() -> list[dict[str, Any]]:
    devices = []
    try:
        if torch.cuda.is_available():
            for i in range(torch.cuda.device_count()):
                prop = torch.cuda.get_device_properties(i)
                devices.append({
                    "index": i,
                    "name": prop.name,
                    "memory_gib": round(prop.total_memory / (1 << 30), 2),
                    "capability": f"{prop.major}.{prop.minor}",
                })
    except Exception as e:  # a broken driver must not break the report
        logger.debug("cuda query failed: %s", e)
    return devices


def machine_info() -> dict[str, Any]:
    """A JSON-serializable description of this machine and software stack."""
    cpu = _cpuinfo()
    try:
        affinity = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        affinity = None
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # older torch
        capability = None
    return {
        "cpu": {
            "model": cpu["model"],
            "logical_cpus": os.cpu_count(),
            "physical_cores": cpu["physical_cores"],
            "usable_cpus": affinity,
            "cgroup_cpu_limit": _cgroup_cpus(),
            "flags": cpu["flags"],
        },
        "torch_threads": torch.get_num_threads(),
        "memory": _meminfo_gib(),
        "torch": {
            "version": torch.__version__,
            "cpu_capability": capability,
            "cuda": torch.version.cuda,
        },
        "cuda_devices": _cuda_devices(),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }


def measure_bandwidth_gbps(threads: int, size_mb: int = 512, repeats: int = 5,
                           passes: int = 3) -> float:
    """Memory-read bandwidth in GB/s (10^9 bytes/s) seen by torch with ``threads`` threads.

    Sums a float32 tensor of ``size_mb`` MiB ``passes`` times per timing and reports the best of
    ``repeats`` timings. Use a size well above the last-level cache (the default 512 MiB) for a
    DRAM figure. The previous torch thread count is restored.
    """
    if threads < 1 or size_mb < 1:
        raise ValueError("threads and size_mb must be >= 1")
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        numel = size_mb * (1 << 20) // 4
        x = torch.ones(numel, dtype=torch.float32)  # touched, so pages are resident
        x.sum()  # warm-up
        nbytes = x.numel() * x.element_size()
        best = float("inf")
        for _ in range(max(1, repeats)):
            t0 = time.perf_counter()
            for _ in range(max(1, passes)):
                x.sum()
            best = min(best, (time.perf_counter() - t0) / max(1, passes))
        del x
        gbps = nbytes / best / 1e9
        logger.debug("bandwidth %.1f GB/s (%d threads, %d MiB)", gbps, threads, size_mb)
        return gbps
    finally:
        torch.set_num_threads(prev)
