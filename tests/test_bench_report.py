"""Benchmark report writing, machine description and the transformers peers (tiny random models)."""
from __future__ import annotations

import json

import pytest
import torch

from ssd.bench.machine import machine_info, measure_bandwidth_gbps
from ssd.bench.report import markdown_table, write_report

torch.set_num_threads(1)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def synthetic_result() -> dict:
    runs = []
    for ds, base in (("humaneval", 4.0), ("mtbench", 3.5)):
        runs.append({"dataset": ds, "mode": "hf", "tokens_per_s": base * 0.9, "tokens_per_s_median": base * 0.92,
                     "ttft_ms_median": 210.0, "acceptance_rate": None, "mean_accepted_len": 1.0,
                     "acceptance_by_position": None, "num_prompts": 4, "generated_tokens": 256})
        runs.append({"dataset": ds, "mode": "ssd", "tokens_per_s": base * 2.1, "tokens_per_s_median": base * 2.0,
                     "ttft_ms_median": 190.0, "acceptance_rate": 0.81, "mean_accepted_len": 3.4,
                     "acceptance_by_position": [0.95, 0.85, 0.7, 0.55], "num_prompts": 4,
                     "generated_tokens": 256})
        runs.append({"dataset": ds, "mode": "ar", "tokens_per_s": base, "tokens_per_s_median": base * 1.01,
                     "ttft_ms_median": 180.0, "acceptance_rate": None, "mean_accepted_len": 1.0,
                     "acceptance_by_position": None, "num_prompts": 4, "generated_tokens": 256})
        runs.append({"dataset": ds, "mode": "sd", "tokens_per_s": base * 1.8, "tokens_per_s_median": base * 1.7,
                     "ttft_ms_median": 185.0, "acceptance_rate": 0.78, "mean_accepted_len": 3.1,
                     "acceptance_by_position": [0.93, 0.8, 0.66, 0.5], "num_prompts": 4,
                     "generated_tokens": 256})
    return {"machine": {"cpu": {"model": "Test CPU", "logical_cpus": 2, "flags": ["avx2"]},
                        "memory": {"total_gib": 16.0, "available_gib": 12.0}, "bandwidth_gbps": 20.5,
                        "torch": {"version": "2.x", "cpu_capability": "AVX2"}, "torch_threads": 2,
                        "python": "3.11", "platform": "Linux", "date": "2026-01-01T00:00:00+00:00"},
            "config": {"title": "unit test", "target": "qwen2.5-coder-1.5b", "draft": "qwen2.5-coder-0.5b",
                       "dtype": "bfloat16", "max_new_tokens": 64, "k": 4},
            "runs": runs}


def test_write_report_files(tmp_path):
    result = synthetic_result()
    paths = write_report(result, tmp_path / "out", "bench1")
    assert set(paths) == {"json", "md", "png_tokens_per_s", "png_acceptance_by_position"}
    assert paths["json"].name == "bench1.json" and paths["md"].name == "bench1.md"
    assert json.loads(paths["json"].read_text()) == result
    for key in ("png_tokens_per_s", "png_acceptance_by_position"):
        data = paths[key].read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 2000
    md = paths["md"].read_text()
    assert md.startswith("# unit test")
    assert "Test CPU" in md and "20.5 GB/s" in md and "| k | 4 |" in md
    assert "](bench1_tokens_per_s.png)" in md and "](bench1_acceptance_by_position.png)" in md
    assert markdown_table(result) in md


def test_markdown_table_rows_and_ratios():
    table = markdown_table(synthetic_result())
    lines = table.strip().splitlines()
    assert len(lines) == 2 + 8
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]
    # grouped by dataset in first-seen order, modes in canonical order
    assert [(r[0], r[1]) for r in rows[:4]] == [("humaneval", m) for m in ("ar", "sd", "ssd", "hf")]
    ar, sd, ssd, hf = rows[:4]
    assert ar[4] == "4.00" and ar[6] == "1.00x"
    assert ssd[6] == "2.10x" and hf[6] == "0.90x"
    assert sd[7] == "0.780" and sd[8] == "3.10" and sd[9] == "185.0"
    assert ar[7] == "-"
    assert rows[4][0] == "mtbench" and rows[5][6] == "1.80x"


def test_report_tolerates_missing_fields(tmp_path):
    result = {"runs": [{"dataset": "gsm8k", "mode": "hf", "tokens_per_s": 3.0},
                       {"dataset": "gsm8k", "mode": "sd", "tokens_per_s": 5.0, "decode_tokens_per_s": 6.0}]}
    table = markdown_table(result)
    assert "decode tok/s" in table and table.count("-") > 5
    paths = write_report(result, tmp_path, "partial")
    assert "png_tokens_per_s" in paths and "png_acceptance_by_position" not in paths
    assert write_report({"runs": []}, tmp_path, "empty").keys() == {"json", "md"}


def test_machine_info_and_bandwidth():
    info = machine_info()
    json.dumps(info)
    assert info["cpu"]["logical_cpus"] >= 1
    assert info["torch"]["version"] == torch.__version__
    assert isinstance(info["cpu"]["flags"], list) and isinstance(info["cuda_devices"], list)
    before = torch.get_num_threads()
    bw = measure_bandwidth_gbps(1, size_mb=16, repeats=2, passes=1)
    assert bw > 0.1 and torch.get_num_threads() == before


# --------------------------------------------------------------------------- transformers peers

def make_tiny_llama(path, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0)
    model = LlamaForCausalLM(cfg).float().eval()
    model.save_pretrained(str(path))
    return model


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    a = tmp_path_factory.mktemp("peer-target")
    b = tmp_path_factory.mktemp("peer-other")
    make_tiny_llama(a, 0)
    make_tiny_llama(b, 1)
    return a, b


PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10, 11, 12, 13, 14, 15, 16], [1, 2, 40]]


def _reference_greedy(path, prompts, n):
    """Plain argmax decoding with full recomputation, never stopping at EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = list(p)
            for _ in range(n):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            outs.append(ids[len(p):])
    return outs


def test_hf_generate_plain_and_assisted(tiny_models):
    from ssd.bench.peers import hf_generate

    target, other = tiny_models
    n = 20
    plain = hf_generate(target, PROMPTS, n, "float32", 1, progress=False)
    assert plain.mode == "hf" and plain.threads == 1 and plain.dtype == "float32"
    assert [len(g) for g in plain.generated] == [n] * len(PROMPTS)
    assert plain.generated == _reference_greedy(target, PROMPTS, n)
    assert plain.target_forwards == [n] * len(PROMPTS) and plain.mean_accepted_len == 1.0
    assert all(t > 0 for t in plain.ttft_s) and all(v > 0 for v in plain.decode_tokens_per_s)
    assert plain.tokens_per_s > 0 and plain.decode_tokens_per_s_aggregate > 0

    same = hf_generate(target, PROMPTS, n, "float32", 1, assistant_dir=target, num_assistant_tokens=4,
                       progress=False)
    assert same.mode == "hf-assisted"
    assert same.generated == plain.generated
    assert same.mean_accepted_len > 3.0  # an identical draft is always accepted: ~k+1 per forward

    diff = hf_generate(target, PROMPTS, n, "float32", 1, assistant_dir=other, progress=False, warmup=False)
    assert diff.generated == plain.generated  # greedy assisted generation is exact

    run = same.to_run("humaneval")
    assert run["mode"] == "hf-assisted" and run["num_prompts"] == 3 and run["generated_tokens"] == 3 * n
    assert run["tokens_per_s"] > 0 and run["ttft_ms_median"] > 0
    json.dumps(run)


def test_hf_generate_ignores_eos(tiny_models, tmp_path):
    """Declare the first greedy token as EOS: generation must still run to max_new_tokens."""
    from transformers import AutoModelForCausalLM

    from ssd.bench.peers import hf_generate

    target, _ = tiny_models
    expected = _reference_greedy(target, PROMPTS[:1], 8)[0]
    model = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32)
    model.config.eos_token_id = expected[0]
    model.generation_config.eos_token_id = expected[0]
    model.save_pretrained(str(tmp_path / "eos"))
    res = hf_generate(tmp_path / "eos", PROMPTS[:1], 8, "float32", 1, progress=False, warmup=False)
    assert res.generated[0] == expected


def test_pooled_auto_vs_best_pairs_batches_within_each_report():
    """Replicates pooled: run 2 ran at twice the speed of run 1, but auto / SSD is 0.9 in every pair of
    both, so the pooled paired ratio is 0.9 with no spread; a cell not in every report is left out."""
    import math

    from ssd.bench.pool import pooled_auto_vs_best

    def run(label, mode, xs, ds="code"):
        return {"label": label, "mode": mode, "dataset": ds, "batch_size": 1, "batch_decode_tokens_per_s": xs}

    one = {"runs": [run("ar", "ar", [5.0, 6.0]), run("ssd k=2", "ssd", [8.0, 10.0]),
                    run("auto k<=2", "auto", [7.2, 9.0]), run("ar", "ar", [5.0], ds="chat"),
                    run("auto k<=2", "auto", [6.0], ds="chat")]}
    two = {"runs": [run("ar", "ar", [10.0, 12.0]), run("ssd k=2", "ssd", [16.0, 20.0]),
                    run("auto k<=2", "auto", [14.4, 18.0])]}
    rows = pooled_auto_vs_best([one, two])
    assert [(r["dataset"], r["best_fixed"]) for r in rows] == [("code", "ssd k=2")]
    p = rows[0]["paired"]
    assert p["n"] == 4 and p["ratio"] == pytest.approx(0.9) and p["lo"] == pytest.approx(0.9)
    assert rows[0]["verdict"] == "missed"
    assert rows[0]["geomeans"]["ssd k=2"] == pytest.approx(math.exp(sum(map(math.log, [8, 10, 16, 20])) / 4))
    # a replicate of only AR and auto (--k 4: auto's label has no K): auto is matched by its mode, and
    # SSD, missing from it, is left out of the pooled cell
    three = {"runs": [run("ar", "ar", [6.0, 6.0]), run("auto", "auto", [6.6, 6.6])]}
    rows = pooled_auto_vs_best([one, three])
    assert [(r["dataset"], r["best_fixed"], r["paired"]["n"]) for r in rows] == [("code", "ar", 4)]
    assert rows[0]["paired"]["ratio"] == pytest.approx(math.exp((math.log(1.44) + math.log(1.5) + 2 * math.log(1.1)) / 4))


def test_ssd_bench_pool_prints_the_pooled_table(tmp_path, capsys):
    """`ssd bench --pool A.json B.json` through the CLI: one row per cell with the pooled paired ratio."""
    import json

    from ssd.cli import main

    def run(label, mode, xs):
        return {"label": label, "mode": mode, "dataset": "code", "batch_size": 1, "batch_decode_tokens_per_s": xs}

    files = []
    for i, scale in enumerate((1.0, 2.0)):
        f = tmp_path / f"r{i}.json"
        f.write_text(json.dumps({"runs": [run("ssd k=2", "ssd", [8.0 * scale, 10.0 * scale]),
                                          run("auto k<=2", "auto", [8.8 * scale, 11.0 * scale])]}))
        files.append(str(f))
    assert main(["bench", "--pool", *files]) in (0, None)
    out = capsys.readouterr().out
    assert "| 1 | code | ssd k=2 | 1.100x [1.100, 1.100] n=4 | met |" in out
