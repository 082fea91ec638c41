"""Offline check of auto's draft-length choice at batch 1 (mode auto, in-process draft), on recorded
greedy acceptance traces.

At temperature 0 a prompt's outcome under any draft length is fixed by one trace: at every output
position p, how many of the draft's next K greedy tokens match the target's. So a policy (fixed K,
or auto's real `Chooser` with a given cost model) can be replayed on the traces with rounds priced
from measured costs, and compared without the machine noise a bench has (optional noise and drift
are added to test robustness).

What it cannot show: the engine's own timing noise. On the 2-core host the same 3-row verify took
76-156 ms within one run, in phases lasting many rounds, and a chooser sees those phases together
with its own choices. A per-row-count cost table that won 1-5% here (commit e5dc43e) lost 5-10% in
the engine (benchmarks/results/cpu-avx2-equal-b1-rowtable): row counts measured in a slow phase
looked dear and were never run again. Treat a gain here as necessary, not sufficient.

    python scripts/auto_trace_sim.py record --out traces.json          # real models, ~10 min on 2 cores
    python scripts/auto_trace_sim.py costs                             # target ms per row count, draft ms per step
    python scripts/auto_trace_sim.py simulate traces.json --target-ms 80,88,100,118,138 --draft-ms 30

The costs are this host's; `costs` measures them with auto's plan forced through K = 0..4 in turn.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
from collections import defaultdict

K_MAX = 4


def record(args) -> None:
    from ssd import LLM, SamplingParams
    from ssd.bench.datasets import load_prompts, render_prompt

    target = LLM(args.target, threads=args.threads, kv_cache_gb=0.3, progress=False)
    draft = LLM(args.draft, threads=args.threads, kv_cache_gb=0.3, progress=False)
    greedy = lambda n: SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)   # noqa: E731
    out = {}
    for ds in args.datasets.split(","):
        for i, p in enumerate(load_prompts(ds, args.num_prompts)):
            ids = render_prompt(p, target.tokenizer)
            ref = target.generate([ids], greedy(args.max_tokens))[0].token_ids
            trace = []
            for pos in range(1, len(ref)):       # rounds start after the prefill's token
                chain = draft.generate([ids + ref[:pos]], greedy(K_MAX))[0].token_ids
                n = 0
                while n < K_MAX and pos + n < len(ref) and chain[n] == ref[pos + n]:
                    n += 1
                trace.append(n)
            out[f"{ds}-{i}"] = trace
            print(ds, i, "".join(map(str, trace)), flush=True)
    target.close()
    draft.close()
    with open(args.out, "w") as f:
        json.dump(out, f)


def costs(args) -> None:
    """Median target forward ms at 1..5 rows and draft ms per step (auto's plan forced through K = 0..4
    in turn, so every K sees the same machine phases; a draft step's median includes its share of the
    catch-ups that plain rounds cause)."""
    from ssd import LLM, SamplingParams
    from ssd.bench.datasets import load_prompts, render_prompt
    from ssd.speculation import chooser

    seen, turn = defaultdict(lambda: ([], [])), [0]

    def plan(self, ids, caps, behind=None, remaining=None):
        self.rounds += 1
        turn[0] += 1
        self.predicted_tokens, self.predicted_s = 1.0, 0.0
        return [min(turn[0] % (K_MAX + 1), caps[0])]

    observe = chooser.Chooser.observe

    def watch(self, ids, num_draft, accepted, draft_s, target_s, caught_up=0):
        seen[num_draft[0]][0].append(draft_s * 1e3)
        seen[num_draft[0]][1].append(target_s * 1e3)
        return observe(self, ids, num_draft, accepted, draft_s, target_s, caught_up)

    chooser.Chooser.plan, chooser.Chooser.observe = plan, watch
    llm = LLM(args.target, draft=args.draft, mode="auto", k=K_MAX, threads=args.threads, kv_cache_gb=0.3,
              progress=False)
    prompts = [render_prompt(p, llm.tokenizer) for p in load_prompts(args.dataset, args.num_prompts)]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params)
    seen.clear()
    for p in prompts:
        llm.generate([p], params)
    llm.close()
    target = [statistics.median(seen[k][1]) for k in range(K_MAX + 1)]
    step = statistics.median(d / k for k in range(1, K_MAX + 1) for d in seen[k][0])
    for k in range(K_MAX + 1):
        print(f"K={k}: {len(seen[k][1])} rounds, target at {k + 1} rows {target[k]:.1f} ms")
    print(f"simulate with: --target-ms {','.join(f'{t:.1f}' for t in target)} --draft-ms {step:.1f}")


def replay(traces: list[list[int]], target_ms: dict[int, float], draft_ms: float, policy, noise: float,
           drift: float, bursts: bool, seed: int) -> float:
    """Tokens/s of a policy (a fixed K, or "auto": the engine's Chooser) over the traces, as one engine
    (one cost model and the engine-wide acceptance persist across prompts)."""
    from ssd.speculation.chooser import Chooser, CostModel

    rng = random.Random(seed)
    cost, first = CostModel(), None
    slow_until, slow = -1.0, 1.0
    total_ms, tokens = 0.0, 0
    for i, trace in enumerate(traces):
        ch = Chooser(K_MAX, cost=cost, shares_acceptance=first)
        first = first or ch
        pos, end = 1, len(trace) + 1
        while pos < end:
            cap = min(K_MAX, end - pos - 1)
            k = min(policy, cap) if isinstance(policy, int) else ch.plan([i], [cap], [0], [end - pos])[0]
            accepted = min(trace[pos - 1], k)
            if bursts and total_ms > slow_until and rng.random() < 0.01:     # a slow phase of 1-5 s
                slow_until, slow = total_ms + rng.uniform(1000, 5000), rng.uniform(1.3, 2.0)
            burst = slow if total_ms < slow_until else 1.0
            f = rng.lognormvariate(0.0, noise) * (1.0 + drift * math.sin(total_ms / 6000.0)) * burst
            tgt, drf = target_ms[k + 1] * f, draft_ms * k * f
            ch.observe([i], [k], [accepted], drf / 1e3, tgt / 1e3)
            total_ms += tgt + drf
            pos += accepted + 1
            tokens += accepted + 1
    return tokens / total_ms * 1e3


def simulate(args) -> None:
    with open(args.traces) as f:
        traces = json.load(f)
    target_ms = {r + 1: float(x) for r, x in enumerate(args.target_ms.split(","))}
    if len(target_ms) < K_MAX + 1:
        raise SystemExit(f"--target-ms needs {K_MAX + 1} values (1..{K_MAX + 1} rows)")
    sets = sorted({name.rsplit("-", 1)[0] for name in traces})
    for noise, drift in ((0.0, 0.0), (args.noise, 0.0), (args.noise, args.drift)):
        seeds = range(1 if noise == drift == 0 else args.seeds)
        for s in sets:
            group = [t for name, t in traces.items() if name.rsplit("-", 1)[0] == s]
            mean = lambda pol: statistics.fmean(   # noqa: E731
                replay(group, target_ms, args.draft_ms, pol, noise, drift, args.bursts, seed) for seed in seeds)
            fixed = {k: mean(k) for k in range(1, K_MAX + 1)}
            best = max(fixed.values())
            auto = mean("auto")
            print(f"noise {noise:.2f} drift {drift:.2f} {s:10s} fixed K " +
                  " ".join(f"{k}:{v:.2f}" for k, v in fixed.items()) +
                  f" | auto {auto:.2f}, auto/best {auto / best:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("record", "costs"):
        p = sub.add_parser(name)
        p.add_argument("--target", default="qwen2.5-coder-1.5b")
        p.add_argument("--draft", default="qwen2.5-coder-0.5b")
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--num-prompts", type=int, default=8)
        p.add_argument("--max-tokens", type=int, default=64 if name == "record" else 96)
    sub.choices["record"].add_argument("--datasets", default="humaneval,mtbench")
    sub.choices["record"].add_argument("--out", default="traces.json")
    sub.choices["costs"].add_argument("--dataset", default="mtbench")
    p = sub.add_parser("simulate")
    p.add_argument("traces")
    p.add_argument("--target-ms", default="80,88,100,118,138", help="target forward ms at 1..5 rows")
    p.add_argument("--draft-ms", type=float, default=30.0, help="draft ms per step")
    p.add_argument("--noise", type=float, default=0.08, help="lognormal sigma of every round's time")
    p.add_argument("--drift", type=float, default=0.3, help="slow +-drift of the machine's speed")
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--bursts", action="store_true", help="slow phases (1.3-2x for 1-5 s) at random")
    args = ap.parse_args()
    {"record": record, "costs": costs, "simulate": simulate}[args.cmd](args)


if __name__ == "__main__":
    main()
