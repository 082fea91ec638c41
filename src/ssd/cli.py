"""`ssd generate | chat | serve | bench | models` — the command-line interface."""
from __future__ import annotations

import argparse
import logging
import sys


def _engine_args(p: argparse.ArgumentParser, default_draft: str | None = None) -> None:
    from ssd.models.registry import DEFAULT_TARGET

    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_TARGET, help="target: built-in name, HF folder, GGUF file or hub id "
                   "(default %(default)s)")
    g.add_argument("--draft", default=default_draft,
                   help="draft model for --mode sd/ssd (default: a built-in target's own draft, e.g. "
                        "qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)")
    g.add_argument("--mode", choices=["ar", "sd", "ssd", "auto"], default=None,
                   help="ar, sd (draft then verify), ssd (draft worker on its own core/device pre-drafts while "
                   "the target verifies) or auto (in-process draft; picks each request's draft length, 0 = a "
                   "plain target step, every round from measured costs); default: auto with a draft, else ar")
    g.add_argument("--k", type=int, default=4, help="draft tokens per speculation round (default %(default)s)")
    g.add_argument("--draft-vocab", type=int, default=None,
                   help="the draft scores only the N most frequent token ids, the special tokens and the tokens "
                   "it was fed (a cheaper draft step, lower acceptance; exact either way: the target verifies "
                   "every token). Default 0 = the whole vocabulary")
    g.add_argument("--spec-max-batch", type=int, default=None,
                   help="sd/ssd: speculate only while at most this many sequences decode together; larger "
                   "batches decode one token per round (on a CPU a batched verify of K+1 tokens per sequence can "
                   "cost more than it saves)")
    g.add_argument("--device", default="cpu", help="cpu or cuda:N (default %(default)s)")
    g.add_argument("--draft-device", default=None, help="device of the draft (default: --device for sd; "
                   "for ssd the worker's own CPU core, or cuda:N — checked once on a GPU with tiny models only)")
    g.add_argument("--threads", type=int, default=None, help="CPU threads (default: torch's default)")
    g.add_argument("--prefill-threads", type=int, default=None,
                   help="CPU threads for prompt prefill (default: --threads); with --mode ssd on a CPU, the "
                   "draft core is mostly idle during prefill")
    g.add_argument("--dtype", default="auto",
                   choices=["auto", "gguf", "q8_0", "q4_1", "float32", "bfloat16", "float16", "int8"],
                   help="weights: auto = on CPU a GGUF model's low-bit weights as stored (gguf) and float16 via "
                   "FBGEMM otherwise, bfloat16 on CUDA; q8_0 / q4_1 = quantize to Q8_0 / 4-bit codes at load (lossy; "
                   "q4_1 is the default for a GGUF draft); "
                   "int8 = FBGEMM int8 (CPU; changes the model's numbers)")
    g.add_argument("--draft-dtype", default=None, choices=["auto", "gguf", "q8_0", "q4_1", "float32", "bfloat16",
                                                          "float16", "int8"],
                   help="weights of the draft (default: --dtype). int8 makes a CPU draft about 2x faster and "
                   "stays exact: the target verifies every token")
    g.add_argument("--max-model-len", type=int, default=4096, help="longest prompt + output in tokens")
    g.add_argument("--kv-cache-gb", type=float, default=None,
                   help="KV cache memory of the target in GiB (default 1; bench: sized to its prompts)")
    g.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="KV cache of the target in tokens (like llama.cpp's -c); replaces --kv-cache-gb")
    g.add_argument("--draft-workers", type=int, default=None,
                   help="ssd: draft workers sharing the batch (data-parallel drafts; default: one per --draft-host "
                   "address, else 1). Local workers take one core each, the last ones; the target the rest")
    g.add_argument("--draft-cores", default=None,
                   help="ssd: CPU cores of the draft worker, e.g. 1 (default: last core); one list per worker "
                   "separated by '/', e.g. 2,3/4,5")
    g.add_argument("--draft-threads", type=int, default=None, help="ssd: threads of the draft worker (default 1)")
    g.add_argument("--draft-host", default=None, help="ssd: HOST:PORT (this engine's address as the worker's host "
                   "reaches it) to wait for `ssd draft-worker --connect` instead of starting a local worker; "
                   "comma-separated, one per worker, for several")
    g.add_argument("--fanout-budget", type=int, default=None,
                   help="ssd: chains pre-drafted per sequence per round (default: sized online to fit in a verify)")
    g.add_argument("--saguaro-c", type=float, default=1.0, help="ssd: Saguaro sampling scale C in [0, 1]")
    g.add_argument("--backup", choices=["auto", "neural", "fast"], default="auto",
                   help="ssd: backup on a cache miss (auto: by batch size from measured times and hit rates)")
    g.add_argument("--worker-timeout", type=float, default=60.0,
                   help="ssd: seconds a draft worker may take to answer a message before it counts as failed")
    g.add_argument("--worker-start-timeout", type=float, default=300.0,
                   help="ssd: seconds a draft worker may take to start (join, load the draft) before start-up fails")
    g.add_argument("--auto-ssd", action=argparse.BooleanOptionalAction, default=None,
                   help="auto: also start draft workers and let auto run SSD stints where they measure faster "
                   "(the target takes the workers' cores back in the other rounds). Default: on when a draft "
                   "worker setting is given (--draft-host, --draft-cores, --draft-threads, --draft-workers)")
    g.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="shard the target over N CPU ranks (this process is rank 0; the others are started on "
                   "this host's cores, or wait for `ssd tp-rank` with --tp-host). Default %(default)s")
    g.add_argument("--tp-host", default=None, help="HOST:PORT to wait for `ssd tp-rank --connect` ranks "
                   "instead of starting them locally")
    g.add_argument("--tp-timeout", type=float, default=60.0,
                   help="seconds bounding tensor-parallel start-up and each step's collectives")
    g.add_argument("--tp-transport", choices=("auto", "gloo"), default="auto",
                   help="tensor-parallel collectives: auto = shared memory between ranks on this host, gloo "
                   "(TCP) otherwise; gloo = always gloo. Default %(default)s")


def _sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=256)
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy (default %(default)s)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence")


def parse_cores(text: str | None):
    """'1,2' -> [1, 2] (one worker); '2,3/4,5' -> [[2, 3], [4, 5]] (one list per worker)."""
    if not text:
        return None
    try:
        lists = [[int(c) for c in part.split(",") if c.strip()] for part in text.split("/")]
    except ValueError:
        raise SystemExit(f"--draft-cores {text!r}: give core numbers like 2,3 (one worker) or 2,3/4,5 (one list "
                         "per worker)") from None
    return lists[0] if len(lists) == 1 else lists


def _llm(args, **extra):
    from ssd import LLM

    return LLM(args.model, draft=args.draft, mode=args.mode, k=args.k, device=args.device,
               draft_device=args.draft_device, threads=args.threads, prefill_threads=args.prefill_threads,
               dtype=args.dtype, draft_dtype=args.draft_dtype, max_model_len=args.max_model_len,
               kv_cache_gb=1.0 if args.kv_cache_gb is None else args.kv_cache_gb,
               kv_cache_tokens=args.kv_cache_tokens, spec_max_batch=args.spec_max_batch,
               draft_cores=parse_cores(args.draft_cores), num_draft_workers=args.draft_workers,
               draft_threads=args.draft_threads, draft_host=args.draft_host, fanout_budget=args.fanout_budget,
               saguaro_c=args.saguaro_c, backup=args.backup, auto_ssd=args.auto_ssd,
               worker_timeout_s=args.worker_timeout, worker_start_timeout_s=args.worker_start_timeout,
               tensor_parallel_size=args.tensor_parallel_size, tp_host=args.tp_host, tp_timeout_s=args.tp_timeout,
               tp_transport=args.tp_transport,
               **({} if args.draft_vocab is None else {"draft_vocab": args.draft_vocab}),
               **extra)


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


def format_decisions(delta) -> str:
    """SSD's cache hit rate and auto's choices over a SpecSnapshot difference ('' when neither applies)."""
    d = delta.to_dict()
    parts = []
    if delta.cache_hit_rate is not None:
        parts.append(f"cache hit rate {delta.cache_hit_rate:.2f}")
    rows = d.get("auto_rows_by_num_draft")
    if rows and sum(rows):
        share = d.get("auto_plain_round_share")
        hist = " ".join(f"{k}:{n}" for k, n in enumerate(rows) if n)
        parts.append(f"auto: plain rounds {share:.0%}, draft length per row {hist}" if share is not None
                     else f"auto: draft length per row {hist}")
        pred, meas = d.get("auto_predicted_tokens_per_s"), d.get("auto_measured_tokens_per_s")
        if pred and meas:
            parts.append(f"predicted {pred:.1f} vs measured {meas:.1f} tok/s")
    if d.get("auto_worker_round_share") is not None:
        pruned = d.get("auto_regime_probes_pruned")
        parts.append(f"auto: SSD rounds {d['auto_worker_round_share']:.0%}, {d['auto_regime_switches']} switch(es)"
                     + (f", {pruned} visit(s) skipped as predicted slower" if pruned else "")
                     + (", draft worker lost" if d.get("auto_worker_lost") else ""))
    return " | ".join(parts)


def cmd_generate(args) -> int:
    prompt = args.prompt if args.prompt is not None else sys.stdin.read()
    prompt = prompt.encode().decode("unicode_escape") if args.escapes else prompt
    params = _params(args)      # validate before loading models
    llm = _llm(args, trace=bool(args.trace))
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
    if args.trace:
        llm.write_trace(args.trace)
        print(f"trace: {args.trace} (open in https://ui.perfetto.dev or chrome://tracing)", file=sys.stderr)
    llm.close()
    if args.metrics and final is not None:
        # this request's rounds (one request ran; the warm-up-free engine counted only these)
        extra = format_decisions(llm.engine.spec_metrics())
        extra = f" | {extra}" if extra else ""
        print(f"[{llm.config.mode}] {format_metrics(final.metrics)}{extra} | finish: {final.finish_reason}",
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


# ---- ssd chat ------------------------------------------------------------------------------------
def chat_repl(llm, params, stdin=None, stdout=None, stderr=None, system: str | None = None,
              show_metrics: bool = False) -> int:
    """Multi-turn chat on stdin/stdout: each line is a user message, the answer streams back.
    Ctrl-C stops the current answer (the session goes on); /exit, /quit or end of input quits;
    /reset clears the history."""
    import signal
    import threading

    stdin, out, err = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    interactive = stdin is sys.stdin and stdin.isatty()
    system_msgs = [{"role": "system", "content": system}] if system else []
    messages = list(system_msgs)
    seen = llm.engine.spec_metrics()        # speculation counters after the previous answer
    err.write("ssd chat: /exit or Ctrl-D quits, /reset clears the history, Ctrl-C stops an answer\n")
    while True:
        try:
            line = input("> ") if interactive else stdin.readline()
        except EOFError:
            line = ""
        except KeyboardInterrupt:
            err.write("\n(use /exit or Ctrl-D to quit)\n")
            continue
        if not line:                    # end of input
            return 0
        line = line.rstrip("\r\n")
        if line.strip() in ("/exit", "/quit"):
            return 0
        if line.strip() == "/reset":
            messages = list(system_msgs)
            err.write("(history cleared)\n")
            continue
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        stop = threading.Event()
        old = None
        if threading.current_thread() is threading.main_thread():
            old = signal.signal(signal.SIGINT, lambda *_, ev=stop: ev.set())   # stop between steps, not mid-step
        text, final = "", None
        stream = llm.stream(messages, params)
        try:
            for chunk in stream:
                out.write(chunk.text)
                out.flush()
                text += chunk.text
                final = chunk.output or final
                if stop.is_set():
                    break
        except KeyboardInterrupt:       # no handler installed (not the main thread)
            stop.set()
        except ValueError as e:         # e.g. the conversation no longer fits the context
            messages.pop()
            err.write(f"error: {e} (/reset starts over)\n")
            continue
        finally:
            stream.close()              # aborts the request if it is still running
            if old is not None:
                signal.signal(signal.SIGINT, old)
        out.write("\n[stopped]\n" if stop.is_set() else "\n")
        out.flush()
        messages.append({"role": "assistant", "content": text})
        if show_metrics:
            # SSD: this answer's share of the speculation cache's hits/misses (the SSD step's totals minus
            # those seen after the previous answer; one request runs at a time). n/a outside SSD, after a
            # worker failure, or when no round could hit (the first round after prefill never can).
            now = llm.engine.spec_metrics()
            delta = now.delta(seen)
            hit = delta.cache_hit_rate
            seen = now
            mode = llm.config.mode
            if getattr(llm.engine, "degraded_from", None):
                mode = f"{llm.engine.degraded_from} -> {llm.engine.mode}: draft worker failed"
            elif now.worker_failures:
                mode += f": {now.worker_failures} of {now.draft_workers} draft workers failed"
            if final is not None:
                auto = format_decisions(delta) if llm.config.mode == "auto" else ""
                err.write(f"[{mode}] {format_metrics(final.metrics)} | cache hit rate "
                          f"{'n/a' if hit is None else f'{hit:.2f}'}{' | ' + auto if auto else ''} | "
                          f"finish: {final.finish_reason}\n")


def cmd_chat(args) -> int:
    params = _params(args)      # validate before loading models
    llm = _llm(args)
    return chat_repl(llm, params, system=args.system, show_metrics=args.metrics)


def add_chat_parser(sub) -> None:
    c = sub.add_parser("chat", help="interactive multi-turn chat in the terminal (streams answers)")
    c.add_argument("--system", default=None, help="system message")
    c.add_argument("--metrics", action="store_true", help="print tokens/s, TTFT, acceptance and cache hit rate "
                   "after each answer")
    _engine_args(c)
    _sampling_args(c)
    c.set_defaults(func=cmd_chat)


# ---- ssd serve -----------------------------------------------------------------------------------
def cmd_serve(args) -> int:
    import os

    from ssd.server.app import build_app, make_server

    api_key = args.api_key or os.environ.get("SSD_API_KEY") or None
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        logging.getLogger("ssd.server").warning(
            "serving on %s without --api-key: anyone who can reach this address can use the model", args.host)
    llm = _llm(args)
    app = build_app(llm, served_name=args.served_model_name, api_key=api_key, max_body_bytes=args.max_body_bytes)
    name = app.state.server.name
    print(f"ssd serve: model '{name}' ({llm.config.mode}) on http://{args.host}:{args.port}/v1", file=sys.stderr)
    try:
        make_server(app, args.host, args.port, args.log_level).run()
    except KeyboardInterrupt:   # uvicorn re-raises Ctrl-C after its graceful shutdown
        pass
    return 0


def add_serve_parser(sub) -> None:
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, "
                       "/v1/models, /health, /metrics)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default %(default)s: this machine only)")
    s.add_argument("--port", type=int, default=8000, help="port (default %(default)s)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every route but /health "
                   "(default: $SSD_API_KEY, else no key)")
    s.add_argument("--served-model-name", default=None, help="the name clients pass as `model` (default: the "
                   "model folder's or file's name)")
    s.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    s.add_argument("--log-level", default="warning", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn log level; info also logs each request (default %(default)s)")
    _engine_args(s)
    s.set_defaults(func=cmd_serve)


def _tp_rank(argv: list[str]) -> int:
    from ssd.distributed.rank import main as rank_main

    rank_main(argv)
    return 0


def _draft_worker(argv: list[str]) -> int:
    from ssd.speculation.worker.serve import main as worker_main

    worker_main(argv)
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
    g.add_argument("--trace", default=None, metavar="FILE",
                   help="write a Chrome/Perfetto trace (JSON) of target and draft work to FILE")
    _engine_args(g)
    _sampling_args(g)
    g.set_defaults(func=cmd_generate)

    w = sub.add_parser("draft-worker", help="run an SSD draft worker that connects to an engine (--draft-host)",
                       add_help=False)
    w.add_argument("worker_args", nargs=argparse.REMAINDER)
    w.set_defaults(func=lambda a: _draft_worker(a.worker_args))

    r = sub.add_parser("tp-rank", help="run one rank of a tensor-parallel target that connects to an engine "
                       "(--tp-host)", add_help=False)
    r.add_argument("rank_args", nargs=argparse.REMAINDER)
    r.set_defaults(func=lambda a: _tp_rank(a.rank_args))

    m = sub.add_parser("models", help="list or prepare the built-in models")
    m.add_argument("action", choices=["list", "fetch"])
    m.add_argument("names", nargs="*", help="models to fetch (default: the default target and draft)")
    m.set_defaults(func=cmd_models)

    add_chat_parser(sub)
    add_serve_parser(sub)

    from ssd.bench.cli import add_bench_parser
    add_bench_parser(sub, _engine_args)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["draft-worker"]:           # its own parser: every flag goes to the worker
        return _draft_worker(argv[1:])
    if argv[:1] == ["tp-rank"]:                # likewise for a tensor-parallel rank
        return _tp_rank(argv[1:])
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
