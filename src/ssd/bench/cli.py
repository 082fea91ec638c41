"""`ssd bench`: compare our modes (and transformers) on the benchmark prompt sets."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Callable

from ssd.bench.datasets import DATASETS, PROMPT_SETS

log = logging.getLogger(__name__)

# `ssd bench --quick` (used by `make demo`): AR vs SD, 2 prompts of three sets, 32 tokens, no peers.
QUICK = {"modes": "ar,sd", "datasets": "humaneval,gsm8k,mtbench", "num_prompts": 2, "max_tokens": 32,
         "peers": ""}
DEFAULTS = {"modes": "ar,sd", "datasets": ",".join(DATASETS), "num_prompts": 4, "max_tokens": 64, "peers": ""}


def _int_list(text: str) -> list[int]:
    try:
        ks = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None
    if not ks:
        raise argparse.ArgumentTypeError("give at least one value")
    return ks


def add_bench_parser(sub, engine_args: Callable[..., None]) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "bench", help="benchmark AR / SD (and transformers peers) on HumanEval, GSM8K, MT-Bench, ShareGPT",
        description="Run each mode over the prompt sets in one process and write JSON + Markdown + PNG "
                    "reports with machine info. Greedy runs also check that SD's tokens equal AR's.",
        conflict_handler="resolve")   # --k / --mode of the engine args are redefined below
    engine_args(p, default_draft="qwen2.5-coder-0.5b")
    g = p.add_argument_group("benchmark")
    g.add_argument("--modes", "--mode", default=None,
                   help=f"comma list of our modes to run (default {DEFAULTS['modes']})")
    g.add_argument("--k", type=_int_list, default=[4],
                   help="draft tokens per round; a comma list (e.g. 2,4,8) sweeps it (default 4)")
    g.add_argument("--draft-vocab", type=_int_list, default=None,
                   help="the draft's reduced head (see the engine option); a comma list (e.g. 0,32768) runs every "
                   "draft mode once per value, labelled vocab=N (default: the engine's)")
    g.add_argument("--datasets", default=None, help=f"comma list from {', '.join(PROMPT_SETS)} (default: all but mixed; mixed "
                        "alternates humaneval and mtbench prompts in one batch)")
    g.add_argument("--num-prompts", type=int, default=None,
                   help=f"prompts per dataset (default {DEFAULTS['num_prompts']})")
    g.add_argument("--max-tokens", type=int, default=None,
                   help=f"tokens generated per prompt, EOS ignored (default {DEFAULTS['max_tokens']})")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default %(default)s)")
    g.add_argument("--batch-size", "--batch-sizes", type=_int_list, default=[1],
                   help="concurrent requests per generate call; a comma list (e.g. 1,4,8) runs each with the "
                        "same engines and adds a plot by batch size (default 1: one prompt at a time)")
    g.add_argument("--no-interleave", action="store_true",
                   help="run the configurations one after another (one engine in memory at a time) instead of "
                        "alternating them batch by batch (the default: run order then cannot bias the comparison)")
    g.add_argument("--peers", default=None,
                   help="comma list of peers: hf, hf-assisted (transformers), llama.cpp (llama-cpp-python on the "
                        "same GGUF files; optional, see README) (default: none)")
    g.add_argument("--peer-assistant-tokens", type=int, default=None,
                   help="draft length of hf-assisted (default: transformers' own schedule)")
    g.add_argument("--placement", choices=["paper", "equal"], default="paper",
                   help="ssd hardware: paper = the target gets --threads in every mode and SSD adds the draft "
                        "worker's cores; equal = every mode gets --threads cores in total, so SSD's target "
                        "runs on --threads minus --draft-threads (default %(default)s)")
    g.add_argument("--seed", type=int, default=0, help="prompt selection and sampling seed (default %(default)s)")
    g.add_argument("--out-dir", default="benchmarks/results", help="report folder (default %(default)s)")
    g.add_argument("--stem", default=None, help="report file name stem (default: bench-<time>-<config>)")
    g.add_argument("--title", default=None, help="report title")
    g.add_argument("--no-bandwidth", action="store_true", help="skip the memory-bandwidth measurement")
    g.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up generation")
    g.add_argument("--quick", action="store_true",
                   help="short preset: AR vs SD, 2 prompts of humaneval, gsm8k and mtbench, 32 tokens, no peers "
                        "(explicit options still win)")
    g.add_argument("--kernels", action="store_true",
                   help="instead of generating: time the low-bit GEMM over the model's linear layers for "
                        "--kernel-rows rows at each of --kernel-threads (vs the memory-bandwidth bound)")
    g.add_argument("--faithfulness", action="store_true",
                   help="instead of generating: compare the default CPU path's next-token distributions (and "
                        "llama.cpp's with --peers llama.cpp) with the fp32 model on real prompts")
    g.add_argument("--pool", nargs="+", default=None, metavar="JSON",
                   help="instead of generating: auto against the best fixed configuration, paired ratios pooled "
                        "over these replicate reports (pairs stay within a report)")
    g.add_argument("--kernel-rows", type=_int_list, default=[1, 2, 5, 8, 16])
    g.add_argument("--kernel-threads", type=_int_list, default=[1, 2])
    p.set_defaults(func=cmd_bench)
    return p


def cmd_kernel_bench(args) -> int:
    from ssd.bench.kernels import kernel_markdown, run_kernel_bench, write_kernel_report

    res = run_kernel_bench(args.model, args.kernel_threads, args.kernel_rows)
    print(kernel_markdown(res))
    for path in write_kernel_report(res, Path(args.out_dir), args.stem or "kernels-" + Path(str(args.model)).name):
        print(f"report: {path}")
    return 0


def config_from_args(args):
    from ssd.bench.runner import BenchConfig
    from ssd.cli import parse_cores

    preset = QUICK if args.quick else DEFAULTS

    def pick(name):
        v = getattr(args, name)
        return preset[name] if v is None else v

    return BenchConfig(
        model=args.model, draft=args.draft, modes=pick("modes"), k=args.k, datasets=pick("datasets"),
        num_prompts=pick("num_prompts"), max_tokens=pick("max_tokens"), temperature=args.temperature,
        batch_size=args.batch_size, interleave=not args.no_interleave, auto_ssd=bool(args.auto_ssd), threads=args.threads, prefill_threads=args.prefill_threads,
        spec_max_batch=args.spec_max_batch, dtype=args.dtype, device=args.device, draft_device=args.draft_device,
        draft_dtype=args.draft_dtype, max_model_len=args.max_model_len, kv_cache_gb=args.kv_cache_gb, kv_cache_tokens=args.kv_cache_tokens, seed=args.seed, placement=args.placement, peers=pick("peers"),
        peer_assistant_tokens=args.peer_assistant_tokens,
        out_dir=args.out_dir, stem=args.stem, bandwidth=not args.no_bandwidth, warmup=not args.no_warmup,
        title=args.title or ("ssd bench --quick" if args.quick else None),
        draft_vocabs=args.draft_vocab,
        tensor_parallel_size=args.tensor_parallel_size, tp_transport=getattr(args, "tp_transport", "auto"),
        ssd_options=dict(fanout_budget=args.fanout_budget, saguaro_c=args.saguaro_c, backup=args.backup,
                         draft_threads=args.draft_threads, draft_cores=parse_cores(args.draft_cores),
                         num_draft_workers=args.draft_workers))


def cmd_faithfulness(args) -> int:
    from ssd.bench.faithfulness import faithfulness_markdown, run_faithfulness, write_faithfulness_report

    peers = [p for p in (args.peers or "").split(",") if p]
    res = run_faithfulness(args.model, num_prompts=args.num_prompts or 2, peers=peers, threads=args.threads)
    print(faithfulness_markdown(res))
    for path in write_faithfulness_report(res, Path(args.out_dir),
                                          args.stem or "faithfulness-" + Path(str(args.model)).name):
        print(f"report: {path}")
    return 0


def cmd_pool(args) -> int:
    import json

    from ssd.bench.pool import pool_markdown, pooled_auto_vs_best

    print(pool_markdown(pooled_auto_vs_best([json.loads(Path(f).read_text()) for f in args.pool])))
    return 0


def cmd_bench(args) -> int:
    if args.pool:
        return cmd_pool(args)
    if args.kernels:
        return cmd_kernel_bench(args)
    if args.faithfulness:
        return cmd_faithfulness(args)
    from ssd.bench.report import markdown_table
    from ssd.bench.runner import run_bench, summary_markdown, write_bench_report

    cfg = config_from_args(args)          # validates before any model loads
    result = run_bench(cfg)
    paths = write_bench_report(result, cfg.out_dir, cfg.stem or cfg.default_stem())
    print()
    print(markdown_table(result))
    extra = summary_markdown(result)
    if extra:
        print(extra)
    for kind, path in paths.items():
        print(f"{kind}: {path}")
    bad = [r for r in result["runs"] if r.get("matches_ar") is not None and r["matches_ar"] < 1.0
           and r["mode"] not in ("hf", "hf-assisted")]
    if bad:
        print("error: greedy tokens differ from AR in " + ", ".join(f"{r['label']}/{r['dataset']}" for r in bad), file=sys.stderr)
        return 1
    return 0
