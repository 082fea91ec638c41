"""The GGUF low-bit path on real models: faithful to the fp32 dequantized model, and the default
CPU path's SD equal to its AR."""
from __future__ import annotations

import pytest

from ssd import LLM, SamplingParams
from ssd.models.registry import DEFAULT_DRAFT

from conftest import all_logits

pytestmark = pytest.mark.slow
TEXT = ('def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n'
        '        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\nThe capital of France is Paris. '
        'Explain in two sentences what a KV cache is and why it speeds up decoding.')


def faithfulness(model: str) -> tuple[float, float, str]:
    low = LLM(model, progress=False, kv_cache_gb=0.1)
    assert "low-bit" in low.target.dtype_name
    ids = low.encode(TEXT)
    a = all_logits(low, ids)
    del low
    ref = all_logits(LLM(model, dtype="float32", progress=False, kv_cache_gb=0.1), ids)
    lp, lq = ref.log_softmax(-1), a.log_softmax(-1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    top1 = (ref.argmax(-1) == a.argmax(-1)).float().mean().item()
    return kl.mean().item(), top1, f"{len(ids)} positions"


@pytest.mark.parametrize("model", ["smollm2-135m", DEFAULT_DRAFT])
def test_low_bit_path_is_faithful_to_the_fp32_dequantized_model(model):
    """smollm2: Llama (permuted Q/K, tied Q8_0 head), Q4_1. The 0.5B: Q4_K, Q6_K, Q5_0, Q8_0.
    Measured here: mean KL ~1e-3 nats, top-1 agreement ~0.98 (bounds below leave room)."""
    kl, top1, where = faithfulness(model)
    assert kl < 0.02 and top1 > 0.9, (kl, top1, where)


def test_default_cpu_path_sd_equals_ar_on_the_draft_pair_of_one_model():
    """SD with the 0.5B as its own draft on the low-bit path accepts everything and equals AR."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    ar = LLM(DEFAULT_DRAFT, progress=False, kv_cache_gb=0.1)
    ids = ar.encode("import numpy as np\n\ndef moving_average(x, w):\n")
    ref = ar.generate(ids, greedy)[0].token_ids
    del ar
    sd = LLM(DEFAULT_DRAFT, draft=DEFAULT_DRAFT, mode="sd", k=4, progress=False, kv_cache_gb=0.1)
    assert sd.generate(ids, greedy)[0].token_ids == ref
    assert sd.last_stats["acceptance_rate"] > 0.9
