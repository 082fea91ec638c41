"""The draft's reduced LM head (layers/reduced_head.py): scores equal the whole head's on the kept ids,
-inf elsewhere; fed tokens join up to the cap; the shipped ranking applies to its tokenizer only.
Exactness of SD with a reduced head (and a negative control) is in test_joint_distribution.py; greedy
identity with AR on the real pair, SD and SSD with draft_vocab=8192, in test_real_models.py."""
from __future__ import annotations

import pytest
import torch

from ssd.bench.engine_runs import engine_specs
from ssd.config import EngineConfig
from ssd.layers import reduced_head as RH
from ssd.models.loader import load_model


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from conftest import make_tiny_hf

    path = tmp_path_factory.mktemp("tiny-head")
    make_tiny_hf("qwen2", path, seed=3)          # untied head, float32, plain torch Linear
    return load_model(str(path), "float32", progress=False).model


def test_kept_scores_equal_the_whole_head_and_the_rest_is_minus_inf(tiny_model):
    base = [0, 1, 5, 9, 40, 77]
    head = RH.ReducedHead(tiny_model, base, always=[100, 127], max_extra=4)
    h = torch.randn(3, tiny_model.cfg.hidden_size)
    full = tiny_model.logits(h)
    out = head(h)
    kept = head.kept()
    assert kept.tolist() == [0, 1, 5, 9, 40, 77, 100, 127]
    torch.testing.assert_close(out[:, kept], full[:, kept], rtol=1e-5, atol=1e-5)
    rest = torch.ones(out.shape[1], dtype=torch.bool)
    rest[kept] = False
    assert torch.isneginf(out[:, rest]).all()


def test_fed_tokens_join_until_the_cap(tiny_model):
    head = RH.ReducedHead(tiny_model, [0, 1, 2], max_extra=3)
    head.observe([1, 50, 50, 60])                 # 1 is in the base already; 50 once
    assert head.kept().tolist() == [0, 1, 2, 50, 60]
    head.observe([70, 80, 90])                    # room for one more only
    assert head.count == 3 and head.kept().tolist() == [0, 1, 2, 50, 60, 70]
    h = torch.randn(2, tiny_model.cfg.hidden_size)
    torch.testing.assert_close(head(h)[:, [50, 60, 70]], tiny_model.logits(h)[:, [50, 60, 70]])


def test_step_weight_bytes_counts_the_kept_rows_instead_of_the_whole_head(tiny_model):
    """What `ssd bench` reports per draft step for a `vocab=N` run (runner._reduced_draft_bytes)."""
    whole = tiny_model.weight_bytes_per_token()
    head = RH.ReducedHead(tiny_model, [0, 1, 2, 3], max_extra=8)
    head_bytes = tiny_model.lm_head.weight_bytes()
    row = head_bytes // tiny_model.cfg.vocab_size
    assert RH.step_weight_bytes(tiny_model, None) == whole
    assert RH.step_weight_bytes(tiny_model, head) == whole - head_bytes + 4 * row
    head.observe([50, 60])                        # fed rows: float32
    assert RH.step_weight_bytes(tiny_model, head) == whole - head_bytes + 4 * row + 2 * tiny_model.cfg.hidden_size * 4


def test_bad_base_and_sizes_are_refused(tiny_model):
    with pytest.raises(ValueError, match="ascending"):
        RH.ReducedHead(tiny_model, [5, 3])
    with pytest.raises(ValueError, match="draft_vocab"):
        EngineConfig(draft_vocab=-1)
    with pytest.raises(ValueError, match="draft_vocab"):
        EngineConfig(draft_vocab=1.5)
    assert RH.draft_head(tiny_model, None, 0) is None          # 0 = the whole vocabulary
    assert RH.draft_head(tiny_model, None, 10_000) is None     # as many rows as the vocabulary or more


def test_lowest_ids_without_a_ranking_for_the_tokenizer(tiny_pair):
    from ssd.models.loader import load_tokenizer

    tok = load_tokenizer(tiny_pair[0])
    ids, source = RH.base_ids(tok, 10, 128)
    assert ids == list(range(10)) and "lowest" in source


def test_bench_runs_every_draft_mode_once_per_draft_vocab():
    specs = engine_specs(["ar", "sd", "auto"], [2, 4], [0, 32768])
    assert [s.label for s in specs] == ["ar", "sd k=2 vocab=all", "sd k=4 vocab=all", "sd k=2 vocab=32768",
                                        "sd k=4 vocab=32768", "auto k<=4 vocab=all", "auto k<=4 vocab=32768"]
    assert specs[0].draft_vocab is None and specs[2].draft_vocab == 0 and specs[3].draft_vocab == 32768
    assert [s.label for s in engine_specs(["sd"], [2])] == ["sd"]


def test_real_draft_head_low_bit_rows_match_and_ranking_applies():
    """The default draft (Q8_0 head in its GGUF): the kept base rows run in the low-bit kernel and
    equal the whole head's scores bitwise (a column's result does not depend on the others); the
    shipped Qwen2 ranking is the one used, and it keeps the tokens a chat answer starts with."""
    from ssd.models.registry import resolve_model

    try:
        resolve_model("qwen2.5-coder-0.5b", progress=False)
    except Exception as e:   # noqa: BLE001 - not installed here
        pytest.skip(f"qwen2.5-coder-0.5b not installed: {e}")
    loaded = load_model("qwen2.5-coder-0.5b", progress=False)
    model, tok = loaded.model, loaded.tokenizer
    head = RH.draft_head(model, tok, 32768)
    assert head is not None and head.prefix.backend.startswith("gguf:")
    assert len(head.base) == 32768 and tok.convert_tokens_to_ids("```") in head.base.tolist()
    assert tok.convert_tokens_to_ids("<|im_end|>") in head.kept().tolist()
    h = torch.randn(2, model.cfg.hidden_size)
    full, out = model.logits(h), head(h)
    assert torch.equal(out[:, head.base], full[:, head.base])
    assert head.weight_bytes() < 0.25 * model.lm_head.weight_bytes()
