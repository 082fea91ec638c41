"""Shared fixtures: tiny random HF models of each supported family, saved as HF folders."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(int(os.environ.get("SSD_TEST_THREADS", "2")))


def make_tiny_hf(kind: str, path, seed: int = 0, vocab: int = 128):
    """Build a tiny random transformers model of family `kind` and save it (fp32 safetensors)."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  rms_norm_eps=1e-6, initializer_range=0.25, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if kind == "llama":
        cfg = tf.LlamaConfig(**common, rope_theta=10000.0, tie_word_embeddings=True,
                             rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                           "high_freq_factor": 4.0, "original_max_position_embeddings": 32})
        model = tf.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = tf.Qwen2Config(**common, rope_theta=1e6, tie_word_embeddings=False)
        model = tf.Qwen2ForCausalLM(cfg)
    elif kind == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=32, rope_theta=1e6, tie_word_embeddings=False)
        model = tf.Qwen3ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    with torch.no_grad():  # random init of biases/norms too, so those code paths matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    model = model.float().eval()
    model.save_pretrained(str(path), safe_serialization=True)
    return model


@pytest.fixture(params=["llama", "qwen2", "qwen3"])
def tiny_hf(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    model = make_tiny_hf(request.param, path)
    return request.param, path, model


CHARS = [chr(c) for c in range(32, 127)][:92] + ["\n"]   # ids 3..95


def make_char_tokenizer(path):
    """A tiny real HF tokenizer (one token per printable ASCII char, ids 3..95) with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = ("{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
                          "{% if add_generation_prompt %}a:{% endif %}")
    path = Path(path)
    fast.save_pretrained(str(path))
    cfg_file = path / "tokenizer_config.json"   # keep AutoTokenizer from picking the model family's class
    cfg = json.loads(cfg_file.read_text())
    cfg["tokenizer_class"] = "TokenizersBackend"
    cfg_file.write_text(json.dumps(cfg))
    return fast


@pytest.fixture(scope="session")
def tiny_pair(tmp_path_factory):
    """A tiny target and a tiny draft (different random weights, same char tokenizer), as HF folders."""
    t = tmp_path_factory.mktemp("tiny-target")
    d = tmp_path_factory.mktemp("tiny-draft")
    make_tiny_hf("qwen2", t, seed=0)
    make_tiny_hf("qwen2", d, seed=1)
    make_char_tokenizer(t)
    make_char_tokenizer(d)
    return t, d


def perturbed_copy(src, path, scale: float, seed: int):
    """An HF folder at `path`: the model at `src` with every weight moved by `scale` times its std
    (a draft close to the target), with the same tokenizer files."""
    import shutil

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for prm in hf.parameters():
            prm.add_(scale * prm.std() * torch.randn(prm.shape, generator=g))
    hf.save_pretrained(str(path))
    for f in src.glob("tokenizer*"):
        shutil.copy(f, path)
    return path


@pytest.fixture(autouse=True, scope="module")
def _free_engines_after_each_module():
    """Engines hold their KV caches (1 GB each by default): collect cyclic garbage between modules so
    the suite's memory stays bounded on a 24 GB machine."""
    yield
    import gc

    gc.collect()


def all_logits(lm, ids: list[int]) -> torch.Tensor:
    """The target's logits at every position of `ids` (one forward over a scratch sequence)."""
    from ssd.engine.model_runner import ForwardItem

    runner = lm.engine.target
    runner.block_manager.allocate(10_000, ids)
    try:
        return runner.forward([ForwardItem(10_000, ids, 0, len(ids))])[0]
    finally:
        runner.block_manager.free(10_000)
