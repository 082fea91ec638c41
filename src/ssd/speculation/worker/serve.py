"""The draft worker process: join the engine's link as rank 1, take the whole configuration from its
first message, load the draft, then alternate pre-drafting with answering until Shutdown.

Started by the engine (a local worker), or by hand on another host:
    ssd draft-worker --connect ENGINE_HOST:PORT [--threads N] [--cores 2,3] [--device cuda:0] [--model PATH]
Only host-local settings are options here; everything else comes from the engine.
"""
from __future__ import annotations

import argparse
import logging
import os

import torch

from ssd.speculation.worker import messages as m
from ssd.speculation.worker.transport import Channel

log = logging.getLogger(__name__)

IDLE_FOREVER_S = 30 * 24 * 3600.0


def build_worker(cfg: m.WorkerConfig, device: str = "cpu", model_override: str | None = None):
    """Load the draft and size its KV pool: the target's block count for sequences, plus the chain
    pool's scratch regions (sized for a full batch)."""
    from ssd.engine.model_runner import ModelRunner
    from ssd.layers.reduced_head import draft_head
    from ssd.models.loader import load_model
    from ssd.speculation.worker.worker import DraftWorker, pool_size

    loaded = load_model(model_override or cfg.model, cfg.dtype, device, cfg.max_model_len + 32, progress=False)
    blocks, regions = pool_size(cfg.num_blocks, cfg.k, cfg.block_size, cfg.max_num_seqs, cfg.chains_per_seq)
    head = draft_head(loaded.model, loaded.tokenizer, cfg.draft_vocab)
    runner = ModelRunner(loaded.model, blocks, cfg.block_size, torch.device(device), head)
    worker = DraftWorker(runner, cfg.target_vocab, cfg.k, cfg.fanout_budget, cfg.saguaro_c, cfg.backup, regions)
    return worker, loaded.config.vocab_size


def serve(host: str, port: int, device: str = "cpu", timeout_s: float = 60.0, threads: int | None = None,
          cores: list[int] | None = None, model_override: str | None = None) -> None:
    if cores:
        os.sched_setaffinity(0, cores)
    if threads:
        torch.set_num_threads(threads)
    # the engine may be idle for hours between requests: the worker's receives wait without a limit
    # (a dead engine closes the connection, which ends them at once)
    chan = Channel(host, port, rank=1, timeout_s=timeout_s, op_timeout_s=IDLE_FOREVER_S)
    cfg = chan.recv()
    if isinstance(cfg, m.Shutdown):
        return
    try:
        if not isinstance(cfg, m.WorkerConfig):
            raise RuntimeError(f"expected the configuration first, got {type(cfg).__name__}")
        worker, vocab = build_worker(cfg, device, model_override)
    except Exception as e:  # report, then exit: the engine turns it into a clear start-up error
        chan.send(m.Error(f"draft worker could not load {model_override or getattr(cfg, 'model', '?')!r}: {e}"))
        raise
    chan.send(m.Hello(vocab, os.getpid()))
    log.info("draft worker ready (pid %d, %s, cores %s, threads %d)", os.getpid(), device, cores,
             torch.get_num_threads())
    with torch.inference_mode():
        while True:
            worker.predraft(poll=chan.pending)
            msg = chan.recv()
            if isinstance(msg, m.Shutdown):
                break
            handle(worker, chan, msg)
    chan.close()


def handle(worker, chan: Channel, msg) -> None:
    if isinstance(msg, m.Add):
        worker.add(msg)
    elif isinstance(msg, m.Free):
        for seq_id in msg.seq_ids:
            worker.free(seq_id)
    elif isinstance(msg, m.Speculate):
        worker.observe_verify(msg.verify_s)
        replies = worker.speculate(msg.requests)
        chan.send(m.Speculation(replies, worker.chains_drafted, worker.busy_s, worker.take_spans(),
                                worker.prefill_tokens, worker.prefill_s))
    else:
        raise RuntimeError(f"draft worker got unexpected message {type(msg).__name__}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="ssd draft-worker",
                                description="ssd draft worker: joins an engine started with draft_host / --draft-host "
                                            "and takes its configuration from it")
    p.add_argument("--connect", required=True, help="HOST:PORT of the engine's rendezvous")
    p.add_argument("--device", default="cpu", help="cpu or cuda:N: where the draft model runs on this host")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for the draft")
    p.add_argument("--cores", default=None, help="comma-separated CPU cores to pin to")
    p.add_argument("--model", default=None, help="load the draft from this path on this host instead of the "
                                                 "engine's (same model, another location)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds to wait for the engine to accept the connection")
    p.add_argument("-v", "--verbose", action="store_true")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if a.verbose else logging.WARNING,
                        format="%(levelname)s draft-worker: %(message)s")
    host, port = a.connect.rsplit(":", 1)
    cores = [int(c) for c in a.cores.split(",")] if a.cores else None
    serve(host, int(port), a.device, a.timeout, a.threads, cores, a.model)
