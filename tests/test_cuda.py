"""CUDA paths: device validation (runs everywhere) and the engine on a GPU (skipped without one).

The GPU tests are the prepared device check (`scripts/cuda_check.sh`): they have not run in CI,
which has no GPU. Tiny fp32 models keep greedy comparisons exact up to GEMM-shape rounding."""
from __future__ import annotations

import time

import pytest
import torch

from ssd import LLM, EngineConfig, SamplingParams

CUDA = torch.cuda.is_available()
gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run scripts/cuda_check.sh on one)")
PROMPTS = ["hello world", "abc", "def f(x):\n    return", "abab abab abab", "The quick brown fox"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.mark.skipif(CUDA, reason="checks the error on a machine without CUDA")
def test_cuda_device_without_cuda_is_a_clear_error():
    for kw in (dict(device="cuda:0"), dict(draft="d", draft_device="cuda"),
               dict(draft="d", mode="ssd", draft_device="cuda:1")):
        with pytest.raises(ValueError, match="CUDA is not available"):
            EngineConfig(model="t", **kw)


def test_bad_device_names_are_clear_errors():
    with pytest.raises(ValueError, match="not a device"):
        EngineConfig(model="t", device="gpu0")
    with pytest.raises(ValueError, match="only 'cpu' and 'cuda:N'"):
        EngineConfig(model="t", device="meta")
    with pytest.raises(ValueError, match="remote worker"):
        EngineConfig(model="t", draft="d", mode="ssd", draft_host="10.0.0.2:29500", draft_device="cpu")
    EngineConfig(model="t", device="cpu", draft="d", draft_device="cpu")


@pytest.fixture(scope="module")
def ar_cpu(tiny_pair):
    llm = LLM(str(tiny_pair[0]), dtype="float32", progress=False)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@gpu
@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_target_on_cuda_matches_cpu(tiny_pair, ar_cpu, mode):
    target, draft = tiny_pair
    kw = dict(mode="sd", draft=str(draft), k=3) if mode == "sd" else {}
    llm = LLM(str(target), device="cuda:0", dtype="float32", progress=False, **kw)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_cpu


@gpu
@pytest.mark.parametrize("target_device", ["cpu", "cuda:0"])
def test_ssd_worker_on_cuda_equals_ar(tiny_pair, ar_cpu, target_device, monkeypatch):
    target, draft = tiny_pair
    # The worker pre-drafts while the target verifies. A tiny target verifies in well under a
    # millisecond, faster than a GPU worker launches a draft step: on the first GPU run (an H200)
    # every lookup missed (15 of 20 partial chains). Each target forward in this (the engine's)
    # process is given 20 ms, a real model's verify time; the worker process is not slowed.
    from ssd.engine.model_runner import ModelRunner

    forward = ModelRunner.forward
    monkeypatch.setattr(ModelRunner, "forward", lambda self, items: (time.sleep(0.02), forward(self, items))[1])
    llm = LLM(str(target), draft=str(target), mode="ssd", k=3, device=target_device, draft_device="cuda:0",
              dtype="float32", progress=False, kv_cache_gb=0.05, worker_timeout_s=120)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_cpu
        stats = llm.engine.spec_metrics()
        assert llm.engine.degraded_from is None and stats.hits > 0     # self-draft: the cache serves rounds
        sampled = llm.generate(PROMPTS, SamplingParams(temperature=1.0, max_tokens=20, seed=3, ignore_eos=True))
        assert all(len(o.token_ids) == 20 for o in sampled)
    finally:
        llm.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallel on CUDA needs two GPUs (NCCL refuses "
                    "two ranks on one); no machine of this workplace has had two")
@pytest.mark.parametrize("mode", ["ar", "sd"])
def test_tensor_parallel_on_two_gpus_over_nccl_equals_cpu(tiny_pair, ar_cpu, mode):
    target, draft = tiny_pair
    kw = dict(mode="sd", draft=str(draft), k=3) if mode == "sd" else {}
    llm = LLM(str(target), device="cuda:0", dtype="float32", progress=False, tensor_parallel_size=2, **kw)
    try:
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ar_cpu
        stats = llm.tensor_parallel_stats()
        assert stats["transport"] == "nccl" and all(r["allreduces"] > 0 for r in stats["ranks"])
    finally:
        llm.close()
