"""Run `ssd bench` and report, per configuration, the CPU seconds its child processes (draft workers)
spent while that configuration's batches ran (a diagnostic, not part of the engine).

Usage: .venv/bin/python scripts/worker_cpu_log.py <ssd bench arguments> 2> cpu.log
       NO_KEEP=1 ... : auto_ssd without WorkerProposer.keep_in_step (the worker idles in local stints)

Prints `[cpu] <mode><k>: children cpu Xs over Ys wall in N batches` per configuration and
`[keep] tokens sent ...` (keep_in_step's prefills) at exit. It wraps bench.engine_runs.run_chunk and
WorkerProposer.keep_in_step, so it follows their signatures; Linux only (/proc).
"""
import atexit
import glob
import os
import sys
import time

from ssd.bench import engine_runs as E
from ssd.speculation.worker import proposer as P

TICKS = os.sysconf("SC_CLK_TCK")


def children_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of each child process of this one, by pid."""
    out = {}
    for f in glob.glob("/proc/self/task/*/children"):
        for pid in open(f).read().split():
            try:
                fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
                out[pid] = (int(fields[11]) + int(fields[12])) / TICKS
            except OSError:
                pass
    return out


per_config: dict[str, list] = {}
run_chunk = E.run_chunk


def timed_chunk(llm, cell, chunk, plist):
    label = llm.config.mode + str(llm.config.k)
    c0, t0 = children_cpu(), time.perf_counter()
    out = run_chunk(llm, cell, chunk, plist)
    c1, t1 = children_cpu(), time.perf_counter()
    acc = per_config.setdefault(label, [0.0, 0.0, 0])
    acc[0] += sum(v - c0.get(p, 0.0) for p, v in c1.items())
    acc[1] += t1 - t0
    acc[2] += 1
    return out


E.run_chunk = timed_chunk
keep_in_step = (lambda self, seqs: 0) if os.environ.get("NO_KEEP") else P.WorkerProposer.keep_in_step
sent = [0, 0]


def counted_keep(self, seqs):
    n = keep_in_step(self, seqs)
    sent[0] += n
    sent[1] += 1
    return n


P.WorkerProposer.keep_in_step = counted_keep


@atexit.register
def report() -> None:
    for label, (cpu, wall, n) in per_config.items():
        print(f"[cpu] {label}: children cpu {cpu:.1f}s over {wall:.1f}s wall in {n} batches", file=sys.stderr)
    print(f"[keep] tokens sent {sent[0]} in {sent[1]} calls", file=sys.stderr)


if __name__ == "__main__":
    from ssd.cli import main
    sys.argv = ["ssd"] + sys.argv[1:]
    main()
