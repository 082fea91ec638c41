"""How faithful a weight/activation format is to the fp32 model of the same (dequantized) weights.

For real prompts (HumanEval, GSM8K, MT-Bench) plus the greedy continuation the fp32 model writes,
every position's next-token distribution is compared with the fp32 reference: mean and p99 KL
divergence (nats), top-1 agreement, and the share of the greedy continuation a format reproduces
token for token. `ssd bench --faithfulness` runs it for our default CPU path and, with
`--peers llama.cpp`, for llama.cpp on the same GGUF file and the same token ids.
"""
from __future__ import annotations

import logging
from pathlib import Path

import torch

log = logging.getLogger(__name__)


def _all_logits(lm, ids: list[int]) -> torch.Tensor:
    from ssd.engine.model_runner import ForwardItem

    runner = lm.engine.target
    runner.block_manager.allocate(987_654, ids)
    try:
        return runner.forward([ForwardItem(987_654, ids, 0, len(ids))])[0].float()
    finally:
        runner.block_manager.free(987_654)


def _compare(ref: torch.Tensor, got: torch.Tensor, starts: list[tuple[int, int]]) -> dict:
    lp, lq = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1).clamp_min(0)
    top1 = (ref.argmax(-1) == got.argmax(-1)).float()
    # greedy agreement: share of each continuation until the first disagreement
    runs = []
    for a, b in starts:
        same = top1[a:b].tolist()
        n = next((i for i, s in enumerate(same) if s < 1), len(same))
        runs.append(n / max(1, len(same)))
    return {"positions": int(kl.numel()), "kl_mean": kl.mean().item(), "kl_p99": kl.quantile(0.99).item(),
            "top1_agreement": top1.mean().item(), "greedy_prefix_share": sum(runs) / len(runs)}


def run_faithfulness(model: str, num_prompts: int = 2, continuation: int = 48, peers: list[str] | None = None,
                     threads: int | None = None) -> dict:
    from ssd import LLM, SamplingParams
    from ssd.bench.datasets import load_prompts, render_prompt
    from ssd.bench.machine import machine_info
    from ssd.models.registry import gguf_source

    ref_lm = LLM(model, dtype="float32", progress=False, kv_cache_gb=0.25, threads=threads)
    seqs, spans = [], []
    for ds in ("humaneval", "gsm8k", "mtbench"):
        for p in load_prompts(ds, num_prompts, seed=0):
            ids = render_prompt(p, ref_lm.tokenizer)[:256]
            out = ref_lm.generate(ids, SamplingParams(temperature=0, max_tokens=continuation, ignore_eos=True))[0]
            seqs.append(ids + out.token_ids)
            spans.append((len(ids) - 1, len(ids) - 1 + len(out.token_ids)))
    refs = [_all_logits(ref_lm, s) for s in seqs]
    del ref_lm
    formats: dict[str, list[torch.Tensor]] = {}
    low = LLM(model, progress=False, kv_cache_gb=0.25, threads=threads)
    name = f"ssd {low.target.dtype_name}"
    formats[name] = [_all_logits(low, s) for s in seqs]
    del low
    if peers and "llama.cpp" in peers:
        from llama_cpp import Llama

        src = gguf_source(model, progress=False)
        llm = Llama(model_path=str(src), n_ctx=1024, logits_all=True, verbose=False, n_threads=threads or 2)
        outs = []
        for s in seqs:
            llm.reset()
            llm.eval(s)
            outs.append(torch.from_numpy(llm.scores[: len(s)].copy()).float())
        formats["llama.cpp (same GGUF)"] = outs
    res = {"model": model, "reference": "our decoder, fp32, on the GGUF's dequantized weights",
           "sequences": len(seqs), "machine": machine_info(), "formats": {}}
    for fname, outs in formats.items():
        offset, cat_spans = 0, []
        for s, (a, b) in zip(seqs, spans):
            cat_spans.append((offset + a, offset + b))
            offset += len(s)
        res["formats"][fname] = _compare(torch.cat(refs), torch.cat(outs), cat_spans)
        log.info("%s: %s", fname, res["formats"][fname])
    return res


def faithfulness_markdown(res: dict) -> str:
    lines = [f"# Faithfulness to the fp32 model: {res['model']}", "",
             f"Reference: {res['reference']}. {res['sequences']} sequences (prompt + 48-token fp32 greedy "
             "continuation), every position compared.", "",
             "| format | positions | mean KL (nats) | p99 KL | top-1 agreement | greedy prefix kept |",
             "|---|---:|---:|---:|---:|---:|"]
    for name, r in res["formats"].items():
        lines.append(f"| {name} | {r['positions']} | {r['kl_mean']:.2e} | {r['kl_p99']:.2e} | "
                     f"{r['top1_agreement']:.4f} | {r['greedy_prefix_share']:.3f} |")
    return "\n".join(lines) + "\n"


def write_faithfulness_report(res: dict, out_dir: Path, stem: str) -> list[Path]:
    from ssd.bench.report import write_json_and_markdown

    return write_json_and_markdown(res, faithfulness_markdown(res), out_dir, stem)
