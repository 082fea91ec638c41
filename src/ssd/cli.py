"""`ssd generate | chat | serve | bench | models` — the command-line interface."""
from __future__ import annotations

import argparse
import json
import logging
import sys


def _engine_args(p: argparse.ArgumentParser, default_draft: str | None = None) -> None:
    from ssd.models.registry import DEFAULT_TARGET

    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_TARGET, help="target: built-in name, HF folder, GGUF file or hub id "
                   "(default %(default)s)")
    g.add_argument("--draft", default=default_draft, help="draft model for --mode sd (default: none)")
    g.add_argument("--mode", choices=["ar", "sd"], default=None, help="decoding mode (default: sd with a draft, else ar)")
    g.add_argument("--k", type=int, default=4, help="draft tokens per speculation round (default %(default)s)")
    g.add_argument("--device", default="cpu", help="cpu or cuda:N (default %(default)s)")
    g.add_argument("--draft-device", default=None, help="device of the draft (default: --device)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's default)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights: auto = float16 via FBGEMM on CPU (fp32 activations), bfloat16 on CUDA")
    g.add_argument("--max-model-len", type=int, default=4096, help="longest prompt + output in tokens")
    g.add_argument("--kv-cache-gb", type=float, default=1.0, help="KV cache memory of the target in GiB")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def _llm(args):
    from ssd import LLM

    return LLM(args.model, draft=args.draft, mode=args.mode, k=args.k, device=args.device,
               draft_device=args.draft_device, threads=args.threads, dtype=args.dtype,
               max_model_len=args.max_model_len, kv_cache_gb=args.kv_cache_gb)


def _params(args):
    from ssd import SamplingParams

    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                          max_tokens=args.max_tokens, stop=args.stop, ignore_eos=args.ignore_eos)


def format_metrics(m) -> str:
    parts = [f"{m.num_generated_tokens} tokens", f"{m.tokens_per_s:.2f} tok/s"]
    if m.decode_tokens_per_s:
        parts.append(f"decode {m.decode_tokens_per_s:.2f} tok/s")
    if m.ttft_s is not None:
        parts.append(f"TTFT {m.ttft_s * 1e3:.0f} ms")
    if m.acceptance_rate is not None:
        parts.append(f"acceptance {m.acceptance_rate:.2f}")
        parts.append(f"{m.mean_accepted_len:.2f} tokens/target forward")
        parts.append("by position " + " ".join(f"{a:.2f}" for a in m.acceptance_by_position))
    return " | ".join(parts)


def cmd_generate(args) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    prompt = prompt.encode().decode("unicode_escape") if args.escapes else prompt
    params = _params(args)      # validate before loading models
    llm = _llm(args)
    source = prompt
    if args.chat:
        source = ([{"role": "system", "content": args.system}] if args.system else []) + \
                 [{"role": "user", "content": prompt}]
    else:
        sys.stdout.write(prompt)
    final = None
    for chunk in llm.stream(source, params):
        sys.stdout.write(chunk.text)
        sys.stdout.flush()
        final = chunk.output or final
    sys.stdout.write("\n")
    if args.metrics and final is not None:
        print(f"[{llm.config.mode}] {format_metrics(final.metrics)} | finish: {final.finish_reason}",
              file=sys.stderr)
    return 0


def cmd_models(args) -> int:
    from ssd.models import registry

    if args.action == "list":
        print(f"{'name':<22}{'role':<10}{'parts installed':<17}{'prepared':<10}path")
        for m in registry.list_models():
            print(f"{m.name:<22}{m.role:<10}{'yes' if m.parts_installed else 'no':<17}"
                  f"{'yes' if m.cached else 'no':<10}{m.path}")
        print(f"\ncache: {registry.cache_dir()} (set SSD_CACHE_DIR to move it)")
        return 0
    for name in args.names or [registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT]:
        path = registry.resolve_model(name, progress=True)
        print(f"{name}: ready at {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ssd", description="Exact LLM inference: autoregressive, speculative (SD) "
                                "and speculative-speculative decoding.")
    p.add_argument("-v", "--verbose", action="count", default=0, help="-v: info logs, -vv: debug logs")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text for one prompt, streamed to the terminal")
    g.add_argument("--prompt", "-p", default=None, help="the prompt (default: read stdin)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--system", default=None, help="system message (with --chat)")
    g.add_argument("--escapes", action="store_true", help="interpret backslash escapes (\\n) in --prompt")
    g.add_argument("--metrics", action="store_true", help="print tokens/s, TTFT and acceptance afterwards")
    _engine_args(g)
    _sampling_args(g)
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list or prepare the built-in models")
    m.add_argument("action", choices=["list", "fetch"])
    m.add_argument("names", nargs="*", help="models to fetch (default: the default target and draft)")
    m.set_defaults(func=cmd_models)

    from ssd.bench.cli import add_bench_parser
    add_bench_parser(sub, _engine_args)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(args.verbose, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        print("\ninterrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
