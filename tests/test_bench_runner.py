"""`ssd bench`: the runner on the tiny model pair (injected prompts) and the CLI parser."""
from __future__ import annotations

import json
import math

import pytest

from ssd.bench.datasets import BenchPrompt
from ssd.bench.runner import BenchConfig, geomean, run_bench, summarize, write_bench_report
from ssd.cli import build_parser

from conftest import CHARS

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# The char tokenizer only knows printable ASCII and "\n" (others become <pad>), so the real prompt
# sets are replaced by injected prompts: one completion set, one chat set.
PROMPTS = {
    "code": [BenchPrompt("code", "code-0", "def add(a, b):\n    return", None),
             BenchPrompt("code", "code-1", "for i in range(10):", None)],
    "chat": [BenchPrompt("chat", "chat-0", None, [{"role": "user", "content": "What is 2 + 3?"}]),
             BenchPrompt("chat", "chat-1", None, [{"role": "user", "content": "Say hi."}])],
}
RUN_KEYS = {"dataset", "mode", "label", "tokens_per_s", "tokens_per_s_median", "decode_tokens_per_s",
            "decode_tokens_per_s_median", "ttft_ms_median", "acceptance_rate", "mean_accepted_len",
            "acceptance_by_position", "num_prompts", "generated_tokens"}
MAX_TOKENS = 12


def test_injected_prompts_use_only_known_chars():
    for ps in PROMPTS.values():
        for p in ps:
            text = p.text if p.text is not None else "".join(m["content"] for m in p.messages)
            assert set(text) <= set(CHARS)


def _cfg(tiny_pair, tmp_path, **kw) -> BenchConfig:
    target, draft = tiny_pair
    base = dict(model=str(target), draft=str(draft), modes=["ar", "sd"], k=3, prompts=PROMPTS,
                max_tokens=MAX_TOKENS, dtype="float32", threads=1, bandwidth=True, bandwidth_mb=8,
                progress=False, out_dir=str(tmp_path), stem="tiny")
    base.update(kw)
    return BenchConfig(**base)


@pytest.fixture(scope="module")
def result(tiny_pair, tmp_path_factory):
    cfg = _cfg(tiny_pair, tmp_path_factory.mktemp("bench"), peers=["hf", "hf-assisted"],
               peer_assistant_tokens=3)
    return run_bench(cfg)


def test_schema_and_runs(result):
    assert set(result) >= {"machine", "config", "runs", "summary"}
    assert result["machine"]["bandwidth_gbps"] > 0
    runs = {(r["dataset"], r["label"]): r for r in result["runs"]}
    assert set(runs) == {(d, m) for d in PROMPTS for m in ("ar", "sd", "hf", "hf-assisted")}
    for r in runs.values():
        assert RUN_KEYS <= set(r), RUN_KEYS - set(r)
        assert r["num_prompts"] == 2
        assert r["generated_tokens"] == 2 * MAX_TOKENS
        assert r["tokens_per_s"] > 0 and r["tokens_per_s_median"] > 0
        assert r["ttft_ms_median"] > 0
    for d in PROMPTS:
        ar, sd = runs[(d, "ar")], runs[(d, "sd")]
        assert ar["acceptance_rate"] is None and ar["mean_accepted_len"] == pytest.approx(1.0)
        assert ar["bandwidth_bound_ms_per_token"] > 0 and ar["measured_ms_per_token"] > 0
        assert sd["k"] == 3 and 0 <= sd["acceptance_rate"] <= 1
        assert len(sd["acceptance_by_position"]) == 3
        assert sd["mean_accepted_len"] >= 1.0
        assert sd["matches_ar"] == 1.0                       # greedy SD is exact
        # same weights and dtype (float32): transformers' greedy tokens equal ours
        assert runs[(d, "hf")]["matches_ar"] == 1.0
        assert runs[(d, "hf-assisted")]["matches_hf"] == 1.0
    cfg = result["config"]
    assert cfg["max_new_tokens"] == MAX_TOKENS and cfg["k"] == [3] and cfg["peer_dtype"] == "float32"
    assert cfg["target_weight_bytes_per_token"] > 0


def test_the_kv_cache_is_sized_to_the_runs_prompts(result, tiny_pair):
    """Without --kv-cache-gb/--kv-cache-tokens every engine gets the slots of the run's longest contexts
    (a bench holds all its engines at once); a given size is kept."""
    from ssd.bench.runner import _render, bench_kv_tokens
    from ssd.models.loader import load_tokenizer

    rendered = _render(PROMPTS, load_tokenizer(tiny_pair[0]), 4096, MAX_TOKENS)
    want = bench_kv_tokens(rendered, 1, MAX_TOKENS, 3)
    assert result["config"]["kv_cache_gb"] is None and result["config"]["kv_cache_tokens"] == want
    lens = sorted(len(i) for v in rendered.values() for i in v)
    assert want == -(-(lens[-1] + MAX_TOKENS + 5) // 16) * 16 * 5 // 4 + 64
    two = {"a": [[1] * 10, [1] * 40], "b": [[1] * 20]}
    assert bench_kv_tokens(two, 2, 8, 4, block_size=16) == 64 + 48 + 28 + 64    # (64 + 48) * 1.25 + 4 blocks


def test_summary(result):
    s = result["summary"]
    assert set(s) == {"ar", "sd", "hf", "hf-assisted"}
    ar_tps = {r["dataset"]: r["tokens_per_s"] for r in result["runs"] if r["label"] == "ar"}
    assert s["ar"]["tokens_per_s_geomean"] == pytest.approx(geomean(list(ar_tps.values())))
    assert "vs_ar" not in s["ar"] and s["sd"]["vs_ar"] > 0 and s["sd"]["vs_hf"] > 0
    assert s["sd"]["matches_ar"] == 1.0
    assert s["hf"]["vs_ar"] > 0 and s["ar"]["vs_hf-assisted"] > 0


def test_report_files(result, tmp_path):
    paths = write_bench_report(result, tmp_path, "tiny")
    assert {"json", "md", "png_tokens_per_s", "png_acceptance_by_position"} <= set(paths)
    assert json.loads(paths["json"].read_text())["runs"] == json.loads(json.dumps(result["runs"]))
    md = paths["md"].read_text()
    assert "## Summary" in md and "| sd |" in md and "bandwidth bound" in md
    for key in ("png_tokens_per_s", "png_acceptance_by_position"):
        assert paths[key].read_bytes()[:8] == PNG_MAGIC


def test_k_sweep_batched(tiny_pair, tmp_path):
    cfg = _cfg(tiny_pair, tmp_path, k=[1, 2], batch_size=2, bandwidth=False, warmup=False,
               prompts={"code": PROMPTS["code"]})
    res = run_bench(cfg)
    labels = [r["label"] for r in res["runs"]]
    assert labels == ["ar", "sd k=1", "sd k=2"]
    for r in res["runs"][1:]:
        assert r["matches_ar"] == 1.0 and len(r["acceptance_by_position"]) == r["k"]
        assert r["batch_size"] == 2
    assert "bandwidth_gbps" not in res["machine"]
    assert set(res["summary"]) == {"ar", "sd k=1", "sd k=2"}


def test_sampling_has_no_exactness_canary(tiny_pair, tmp_path):
    res = run_bench(_cfg(tiny_pair, tmp_path, temperature=0.8, bandwidth=False, warmup=False,
                         prompts={"chat": PROMPTS["chat"][:1]}))
    sd = [r for r in res["runs"] if r["mode"] == "sd"][0]
    assert sd["matches_ar"] is None and sd["generated_tokens"] == MAX_TOKENS


def test_summarize_ratios():
    runs = [{"dataset": d, "mode": m, "tokens_per_s": v} for d, m, v in
            [("a", "ar", 2.0), ("b", "ar", 8.0), ("a", "sd", 4.0), ("b", "sd", 32.0), ("a", "hf", 1.0)]]
    s = summarize(runs)
    assert s["ar"]["tokens_per_s_geomean"] == pytest.approx(4.0)
    assert s["sd"]["vs_ar"] == pytest.approx(8 ** 0.5)     # ratios 2 and 4
    assert s["sd"]["vs_hf"] == pytest.approx(4.0)          # only dataset a is shared


@pytest.mark.parametrize("kw, match", [
    (dict(modes=["xx"]), "unknown mode"),
    (dict(peers=["vllm"]), "unknown peer"),
    (dict(draft=None), "need a draft"),
    (dict(k=0), "k must be"),
    (dict(prompts=None, datasets=["nope"]), "dataset"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(placement="nowhere"), "placement"),
    (dict(modes=["ar", "ssd"], placement="equal", threads=1), "needs --threads larger"),
])
def test_config_validation(tiny_pair, tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(tiny_pair, tmp_path, **kw)


def test_placement_sets_ssd_target_threads(tiny_pair, tmp_path):
    from ssd.bench.runner import mode_threads

    paper = _cfg(tiny_pair, tmp_path, modes=["ar", "sd", "ssd"], threads=2)
    assert [mode_threads(paper, m) for m in ("ar", "sd", "ssd")] == [2, 2, 2]
    equal = _cfg(tiny_pair, tmp_path, modes=["ar", "sd", "ssd"], threads=3, placement="equal",
                 ssd_options={"draft_threads": 2})
    assert [mode_threads(equal, m) for m in ("ar", "sd", "ssd")] == [3, 3, 1]
    two = _cfg(tiny_pair, tmp_path, modes=["ar", "ssd"], threads=4, placement="equal",
               ssd_options={"num_draft_workers": 2})
    assert [mode_threads(two, m) for m in ("ar", "ssd")] == [4, 2]          # one thread per draft worker


def test_cli_parser(capsys):
    parser = build_parser()
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    for opt in ("--modes", "--k", "--datasets", "--num-prompts", "--max-tokens", "--batch-size", "--peers",
                "--no-bandwidth", "--quick", "--placement", "--out-dir", "--stem", "--model", "--draft", "--threads", "--dtype"):
        assert opt in out

    from ssd.bench.cli import config_from_args

    args = parser.parse_args(["bench", "--quick"])
    assert args.func is not None
    cfg = config_from_args(args)
    assert cfg.modes == ["ar", "sd"] and cfg.datasets == ["humaneval", "gsm8k", "mtbench"]
    assert cfg.num_prompts == 2 and cfg.max_tokens == 32 and cfg.peers == [] and cfg.ks == [4]
    assert cfg.draft == "qwen2.5-coder-0.5b"

    cfg = config_from_args(parser.parse_args(["bench", "--k", "2,4,8", "--peers", "hf,hf-assisted",
                                              "--datasets", "gsm8k", "--no-bandwidth", "--max-tokens", "16"]))
    assert cfg.ks == [2, 4, 8] and cfg.peers == ["hf", "hf-assisted"] and cfg.datasets == ["gsm8k"]
    assert cfg.bandwidth is False and cfg.max_tokens == 16 and cfg.num_prompts == 4
    assert len(cfg.datasets) == 1

    cfg = config_from_args(parser.parse_args(["bench"]))
    assert cfg.datasets == ["humaneval", "gsm8k", "mtbench", "sharegpt"] and cfg.max_tokens == 64


def test_cli_end_to_end(tiny_pair, tmp_path, capsys, monkeypatch):
    """`ssd bench` through main(), with the prompt loader swapped for injected prompts."""
    import ssd.bench.runner as runner
    from ssd.cli import main

    monkeypatch.setattr(runner, "load_prompts", lambda name, n, seed=0: PROMPTS["code"][:n])
    target, draft = tiny_pair
    rc = main(["bench", "--model", str(target), "--draft", str(draft), "--dtype", "float32", "--threads", "1",
               "--datasets", "humaneval", "--num-prompts", "1", "--max-tokens", "6", "--k", "2",
               "--no-bandwidth", "--no-warmup", "--out-dir", str(tmp_path), "--stem", "cli"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| humaneval | sd |" in out and "json:" in out
    assert (tmp_path / "cli.json").exists() and (tmp_path / "cli.md").exists()


def test_ssd_mode_reports_cache_metrics(tiny_pair, tmp_path):
    """The SSD bench path with a real worker process: exact tokens and the cache metrics in JSON and Markdown."""
    cfg = _cfg(tiny_pair, tmp_path, modes=["ar", "ssd"], prompts={"code": PROMPTS["code"]}, bandwidth=False,
               ssd_options={"worker_timeout_s": 30})
    res = run_bench(cfg)
    assert res["config"]["ssd_options"] == {"worker_timeout_s": 30}     # the SSD settings are on record
    ssd = [r for r in res["runs"] if r["mode"] == "ssd"][0]
    assert ssd["matches_ar"] == 1.0 and ssd["degraded_from"] is None
    assert 0 <= ssd["cache_hit_rate"] <= 1 and len(ssd["cache_hit_rate_by_k"]) == 4
    assert ssd["ms_per_round"] >= ssd["verify_ms_per_round"] > 0
    assert 0 <= ssd["target_idle_fraction"] <= 1 and 0 < ssd["draft_busy_fraction"] <= 1
    assert ssd["chains_drafted"] > 0
    summary = res["summary"]["ssd"]
    assert summary["cache_hit_rate"] == pytest.approx(ssd["cache_hit_rate"])
    paths = write_bench_report(res, tmp_path, "ssd")
    md = paths["md"].read_text()
    assert "SSD speculation cache" in md and "draft busy" in md and "| code | ssd |" in md
    assert paths["png_timeline"].read_bytes().startswith(PNG_MAGIC)


def test_engine_specs_and_rotation():
    from ssd.bench.engine_runs import engine_specs, rotation

    specs = engine_specs(["sd", "auto", "ar", "ssd"], [2, 4])
    assert [(s.label, s.mode, s.k) for s in specs] == [
        ("ar", "ar", 2), ("sd k=2", "sd", 2), ("sd k=4", "sd", 4), ("auto k<=4", "auto", 4),
        ("ssd k=2", "ssd", 2), ("ssd k=4", "ssd", 4)]
    assert [s.label for s in engine_specs(["auto"], [3])] == ["auto"]
    labels = ["a", "b", "c"]
    orders = [rotation(labels, t) for t in range(6)]
    assert orders[:3] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]] and orders[3] == orders[0]
    firsts = [o[0] for o in orders]
    assert all(firsts.count(x) == 2 for x in labels)        # every configuration goes first equally often


def test_interleaved_batch_sweep(tiny_pair, tmp_path, monkeypatch):
    """Two batch sizes with the engines alive at once: runs alternate per batch, entries are per
    (configuration, batch size, dataset), greedy stays exact, and the report has the by-batch plot
    and the auto-vs-best table."""
    import ssd.bench.engine_runs as er

    calls = []
    real = er.run_chunk
    monkeypatch.setattr(er, "run_chunk", lambda llm, cell, chunk, plist: (
        calls.append((llm.config.mode, len(chunk))), real(llm, cell, chunk, plist)))
    cfg = _cfg(tiny_pair, tmp_path, modes=["ar", "sd", "auto"], k=2, batch_size=[1, 2], bandwidth=False,
               warmup=False, prompts={"code": PROMPTS["code"]})
    res = run_bench(cfg)
    # batch 1: two batches, each over the 3 engines, in rotating order; batch 2: one batch
    assert calls[:3] == [("ar", 1), ("sd", 1), ("auto", 1)]
    assert calls[3:6] == [("sd", 1), ("auto", 1), ("ar", 1)]
    assert [m for m, n in calls[6:]] == ["auto", "ar", "sd"] and all(n == 2 for _, n in calls[6:])
    cells = [(r["label"], r["batch_size"]) for r in res["runs"]]
    assert cells == [("ar", 1), ("ar", 2), ("sd", 1), ("sd", 2), ("auto", 1), ("auto", 2)]
    assert all(r["matches_ar"] == 1.0 for r in res["runs"] if r["mode"] != "ar")
    assert all(r["num_prompts"] == 2 for r in res["runs"])
    # one decode rate per batch of prompts, for the paired auto-vs-best interval
    assert [len(r["batch_decode_tokens_per_s"]) for r in res["runs"]] == [2, 1] * 3
    assert all(x > 0 for r in res["runs"] for x in r["batch_decode_tokens_per_s"])
    # and the target's mean forward per batch (trace spans), to tell a mode's own costs from the machine's
    assert [len(r["batch_target_forward_ms"]) for r in res["runs"]] == [2, 1] * 3
    assert all(x > 0 for r in res["runs"] for x in r["batch_target_forward_ms"])
    assert all(r["draft_prefill_s"] == 0 for r in res["runs"] if r["mode"] == "ar")
    assert any(r["draft_prefill_s"] > 0 for r in res["runs"] if r["mode"] == "sd")
    assert res["config"]["interleaved"] is True and res["config"]["batch_size"] == [1, 2]
    assert set(res["summary_by_batch_size"]) == {"1", "2"} and "summary" not in res
    auto = [r for r in res["runs"] if r["mode"] == "auto"]
    assert "auto_plain_round_share" in auto[0]
    # a cell's decisions are its own (not counted on to the end of the run): a row commits >= 1 token
    assert all(0 < sum(r["auto_rows_by_num_draft"]) <= r["generated_tokens"] - r["num_prompts"] for r in auto)
    paths = write_bench_report(res, tmp_path, "sweep")
    assert paths["png_by_batch_size"].read_bytes()[:8] == PNG_MAGIC
    md = paths["md"].read_text()
    assert "Batch size 2:" in md and "auto against the best fixed configuration" in md
    assert "| code | 2 | sd |" in md


def test_span_stats_counts_forwards_after_the_first_token_and_draft_prefills():
    from ssd.bench.engine_runs import span_stats
    from ssd.engine.trace import Span

    spans = [Span("target", "prefill", 0.0, 1.0), Span("draft", "prefill", 1.0, 1.5),
             Span("target", "decode", 0.5, 0.6),           # before the first token: not a decode step
             Span("target", "decode", 2.0, 2.1), Span("draft", "draft", 2.1, 2.2),
             Span("target", "verify", 2.2, 2.5), Span("target", "wait", 2.5, 3.0),
             Span("draft", "worker prefill", 2.5, 2.9)]    # the SSD worker's, on its own cores: not counted
    ms, prefill = span_stats(spans, first_token=1.6)
    assert ms == pytest.approx(200.0) and prefill == pytest.approx(0.5)
    assert span_stats([], 0.0) == (None, 0.0)


def test_auto_vs_best_picks_the_best_fixed_cell():
    from ssd.bench.summary import auto_markdown, auto_vs_best

    runs = [{"dataset": "c", "mode": m, "label": lab, "batch_size": 1, "decode_tokens_per_s": v}
            for m, lab, v in [("ar", "ar", 10.0), ("sd", "sd k=2", 14.0), ("sd", "sd k=4", 12.0),
                              ("auto", "auto k<=4", 13.3), ("hf", "hf", 99.0)]]
    runs[3].update(auto_worker_round_share=0.75, auto_rows_by_num_draft=[1, 0, 3])
    (row,) = auto_vs_best(runs)
    assert row["best_fixed"] == "sd k=2" and row["auto_vs_best"] == pytest.approx(0.95)   # peers are not ours
    line = auto_markdown([row])[-1]           # the shares of SSD rounds and of each chosen K are shown
    assert line.endswith("| - | 0.75 | 0.25 0.00 0.75 |"), line
    row["auto_worker_rows_by_num_draft"] = [0, 0, 3]       # with a worker: local and SSD rounds apart
    assert auto_markdown([row])[-1].endswith("| local 1.00 0.00 0.00; SSD 0.00 0.00 1.00 |")


def test_auto_runs_keep_the_chooser_counters_and_the_cache_hits():
    from ssd.bench.engine_runs import spec_stats
    from ssd.speculation.stats import SpecSnapshot

    before = SpecSnapshot()
    after = SpecSnapshot(rounds=10, hits=3, misses=1, hits_by_k=(1, 2), misses_by_k=(1, 0), worker_rounds=4,
                         rows_by_num_draft=(6, 4), worker_rows_by_num_draft=(0, 4), plain_rounds=6, wait_s=1.0,
                         verify_s=2.0)
    got = spec_stats(None, "auto", before, after)
    assert got["cache_hit_rate"] == 0.75 and got["cache_hit_rate_by_k"] == [0.5, 1.0]
    assert got["auto_worker_round_share"] == 0.4 and got["auto_plain_round_share"] == 0.6
    assert got["auto_worker_rows_by_num_draft"] == [0, 4]
    assert "ms_per_round" not in got            # the SSD-only keys stay out of auto's runs


def test_paired_ratio_and_its_verdict():
    from ssd.bench.summary import auto_vs_best, goal_verdict, paired_ratio

    p = paired_ratio([9.0, 11.0, 10.0], [10.0, 10.0, 10.0])
    logs = [math.log(0.9), math.log(1.1), 0.0]
    m = sum(logs) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / 2)
    assert p["n"] == 3 and p["ratio"] == pytest.approx(math.exp(m))
    assert p["lo"] == pytest.approx(math.exp(m - 2.920 * sd / math.sqrt(3)))     # t(0.95, 2 df)
    assert p["hi"] == pytest.approx(math.exp(m + 2.920 * sd / math.sqrt(3)))
    assert goal_verdict(p) == "within noise"
    assert goal_verdict(paired_ratio([10.0, 10.2, 9.9, 10.1], [10.0] * 4)) == "met"
    assert goal_verdict(paired_ratio([9.0, 9.1, 8.9, 9.05], [10.0] * 4)) == "missed"
    one = paired_ratio([9.0], [10.0])
    assert one["ratio"] == pytest.approx(0.9) and one["lo"] is None and goal_verdict(one) == "one batch"
    assert paired_ratio([1.0, 2.0], [1.0]) is None and paired_ratio(None, [1.0]) is None
    runs = [{"dataset": "c", "mode": m, "label": m, "batch_size": 1, "decode_tokens_per_s": v,
             "batch_decode_tokens_per_s": b} for m, v, b in [("ar", 10.0, [10.0, 10.0]), ("auto", 9.0, [9.0, 9.0])]]
    (row,) = auto_vs_best(runs)
    assert row["paired"]["n"] == 2 and row["paired"]["ratio"] == pytest.approx(0.9) and row["verdict"] == "missed"


def test_mixed_prompt_set_alternates_code_and_chat():
    from ssd.bench.datasets import load_prompts

    ps = load_prompts("mixed", 5)
    assert [p.dataset for p in ps] == ["humaneval", "mtbench", "humaneval", "mtbench", "humaneval"]
    assert [p.id for p in ps[::2]] == [p.id for p in load_prompts("humaneval", 3)]


def test_reduced_head_runs_report_what_a_draft_step_reads(tiny_pair, tmp_path):
    """`--draft-vocab`: a `vocab=N` run reports the reduced head's draft bytes per step, in process (SD)
    and for a worker's head (SSD, built on the shared weights); the config keeps the whole draft's."""
    cfg = _cfg(tiny_pair, tmp_path, modes=["ar", "sd", "ssd"], k=2, draft_vocabs=[0, 32],
               prompts={"code": PROMPTS["code"]}, bandwidth=False, warmup=False,
               ssd_options={"worker_timeout_s": 30})
    res = run_bench(cfg)
    runs = {r["label"]: r for r in res["runs"]}
    whole = res["config"]["draft_weight_bytes_per_token"]
    assert "draft_weight_bytes_per_token" not in runs["sd vocab=all"]
    cut = runs["sd vocab=32"]["draft_weight_bytes_per_token"]
    assert 0 < cut < whole and runs["ssd vocab=32"]["draft_weight_bytes_per_token"] == cut
    assert all(r["matches_ar"] == 1.0 for r in res["runs"] if r["mode"] != "ar")
