"""Draft/target compatibility: both must speak the same tokenizer."""
from __future__ import annotations


class VocabMismatchError(ValueError):
    pass


def check_vocab_compatible(target_tok, draft_tok, target_vocab: int, draft_vocab: int) -> None:
    """Raise VocabMismatchError unless every token the tokenizers know maps to the same id.
    Embedding rows beyond the tokenizer (padding) may differ in count."""
    tv, dv = target_tok.get_vocab(), draft_tok.get_vocab()
    if tv != dv:
        only_t = len(set(tv) - set(dv))
        only_d = len(set(dv) - set(tv))
        moved = sum(1 for t, i in tv.items() if t in dv and dv[t] != i)
        raise VocabMismatchError(
            f"draft and target tokenizers differ ({len(dv)} vs {len(tv)} tokens; {only_t} only in the target, "
            f"{only_d} only in the draft, {moved} with different ids): speculative decoding needs a draft from "
            "the same model family and tokenizer (e.g. qwen2.5-coder-0.5b for qwen2.5-coder-1.5b)")
    n = len(tv)
    if target_vocab < n or draft_vocab < n:
        raise VocabMismatchError(
            f"a model's embedding has fewer rows than its tokenizer has tokens (target {target_vocab}, "
            f"draft {draft_vocab}, tokenizer {n}): the checkpoint and tokenizer do not belong together")
    if target_tok.eos_token_id != draft_tok.eos_token_id:
        raise VocabMismatchError(f"draft eos id {draft_tok.eos_token_id} != target eos id {target_tok.eos_token_id}")
