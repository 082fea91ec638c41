"""`ssd bench --kernels` (run_kernel_bench) end to end on a tiny GGUF: every (threads, M) cell timed and
reported, against the bound of the bandwidth it measured, and the process's settings it changes on the
way (the GEMM's prefetch distance, torch's thread count) given back. The bandwidth measurement (512 MiB
read 15 times) is stubbed at 20 GB/s per thread; the attention and decode-step parts run for real, on
small sizes."""
from __future__ import annotations

import json

import torch

from conftest import make_tiny_hf


def test_kernel_bench_times_every_cell_and_restores_the_process_settings(tmp_path, monkeypatch):
    from test_gguf_convert import write_quantized_tiny_gguf

    from ssd.bench import kernels, machine
    from ssd.kernels.build import load_qgemm

    model = make_tiny_hf("llama", tmp_path / "hf", vocab=2048)      # decode_step_share feeds ids from 1000
    path = write_quantized_tiny_gguf(model, tmp_path / "tiny.gguf", "Q4_0")
    monkeypatch.setattr(machine, "measure_bandwidth_gbps", lambda threads: 20.0 * threads)
    real_attention, real_step = kernels.attention_bench, kernels.decode_step_share
    monkeypatch.setattr(kernels, "attention_bench", lambda contexts: real_attention([64], layers=2, repeats=1))
    monkeypatch.setattr(kernels, "decode_step_share", lambda m: real_step(m, context=32, repeats=1))

    ops = load_qgemm()
    default = ops.set_prefetch(512)          # a distance of our own, to see it given back
    threads = torch.get_num_threads()
    try:
        res = kernels.run_kernel_bench(str(path), threads=[1, 2], rows=[1, 3], repeats=1)
        assert ops.set_prefetch(512) == 512, "the bench left another prefetch distance behind"
    finally:
        ops.set_prefetch(default)
    assert torch.get_num_threads() == threads
    assert res["prefetch_bytes"] == 512
    assert "gguf:Q4_0" in res["formats"] and res["linears"] > 0 and res["weight_bytes"] > 0
    cells = [(r["threads"], r["rows"]) for r in res["results"]]
    assert cells == [(1, 1), (1, 3), (2, 1), (2, 3)]
    for r in res["results"]:
        assert r["ms"] > 0 and r["ms_no_prefetch"] > 0
        assert abs(r["bound_ms"] - res["weight_bytes"] / (20e9 * r["threads"]) * 1e3) < 1e-9
        assert abs(r["x_bound"] - r["ms"] / r["bound_ms"]) < 1e-9
        first = next(x for x in res["results"] if x["threads"] == r["threads"])
        assert abs(r["t_over_t1"] - r["ms"] / first["ms"]) < 1e-9
    assert [(a["context"], a["rows"]) for a in res["attention"]] == [(64, 1), (64, 5)]
    assert 0.0 <= res["decode_step"]["outside_linears_share"] <= 1.0

    md = kernels.kernel_markdown(res)
    assert md.count("\n| 1 | ") == 2 and md.count("\n| 2 | ") == 2 and "Kernel path: " + res["isa"] in md
    written = kernels.write_kernel_report(res, tmp_path / "out", "k")
    data = json.loads(next(p for p in written if str(p).endswith(".json")).read_text())
    assert data["results"] == res["results"]
