"""llama.cpp as a benchmark peer (optional: `pip install llama-cpp-python`, see README for the
build flags): the same GGUF file, the same prompt token ids, greedy, on the same thread count."""
from __future__ import annotations

import logging
import time
from pathlib import Path

from ssd.bench.peers import PeerResult

log = logging.getLogger(__name__)

INSTALL_HINT = ('pip install llama-cpp-python (on this kind of VM build it with CMAKE_ARGS="-DGGML_NATIVE=OFF '
                '-DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON")')


def llamacpp_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("llama_cpp") is not None


def llamacpp_generate(gguf_path: str | Path, prompts: list[list[int]], max_new_tokens: int, threads: int | None,
                      *, warmup: bool = True, progress: bool = True, n_ctx: int = 4096) -> PeerResult:
    from tqdm.auto import tqdm

    try:
        from llama_cpp import Llama
    except ImportError as e:
        raise RuntimeError(f"the llama.cpp peer needs llama-cpp-python: {INSTALL_HINT}") from e
    import os

    th = threads or len(os.sched_getaffinity(0))
    t0 = time.perf_counter()
    llm = Llama(model_path=str(gguf_path), n_ctx=n_ctx, n_threads=th, n_threads_batch=th, verbose=False)
    res = PeerResult(mode="llama.cpp", model_dir=str(gguf_path), assistant_dir=None, dtype="as stored (GGUF)",
                     threads=th, max_new_tokens=max_new_tokens, load_s=time.perf_counter() - t0)

    def run(ids, n):
        llm.reset()                         # no prefix reuse between prompts
        times, toks = [], []
        start = time.perf_counter()
        for tok in llm.generate(ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, reset=True):
            toks.append(int(tok))
            times.append(time.perf_counter())
            if len(toks) >= n:
                break
        return start, times, toks

    if warmup and prompts:
        run(prompts[0][-64:], min(4, max_new_tokens))
    for ids in tqdm(prompts, desc="llama.cpp", unit="prompt", disable=not progress):
        start, times, toks = run(ids, max_new_tokens)
        end = times[-1] if times else time.perf_counter()
        res.generated.append(toks)
        res.ttft_s.append((times[0] if times else end) - start)
        res.wall_s.append(end - start)
        res.total_tokens_per_s.append(len(toks) / (end - start) if end > start else 0.0)
        dec = (times[-1] - times[0]) if len(times) > 1 else 0.0
        res.decode_s.append(dec)
        res.decode_tokens.append(max(0, len(toks) - 1))
        res.decode_tokens_per_s.append((len(toks) - 1) / dec if dec > 0 else 0.0)
        res.target_forwards.append(len(toks))
    log.info("llama.cpp: %d prompts, %.2f tok/s decode", len(res.generated), res.decode_tokens_per_s_aggregate)
    return res
