"""Tests for the paged-KV block manager: unit tests plus a stateful hypothesis model check."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ssd.engine.block_manager import BlockManager, NoFreeBlocksError


def snapshot(bm: BlockManager) -> tuple:
    """Everything observable about the manager (for 'state unchanged' checks)."""
    seqs = sorted(bm._seqs)
    return (
        bm.num_free_blocks,
        bm.stats(),
        {s: (bm.block_table(s), bm.num_tokens(s), bm.num_committed(s)) for s in seqs},
        [bm.ref_count(b) for b in range(bm.num_blocks)],
        [bm.cached_tokens(b) for b in range(bm.num_blocks)],
        list(bm._clean),
        list(bm._lru),
    )


# ---------------------------------------------------------------- construction and simple queries


def test_constructor_validation():
    with pytest.raises(ValueError):
        BlockManager(4, 0)
    with pytest.raises(ValueError):
        BlockManager(-1, 4)
    bm = BlockManager(0, 4)
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate([1])
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(0, [1])


def test_blocks_needed():
    bm = BlockManager(8, 4)
    assert [bm.blocks_needed(n) for n in range(10)] == [0, 1, 1, 1, 1, 2, 2, 2, 2, 3]
    with pytest.raises(ValueError):
        bm.blocks_needed(-1)


def test_allocate_basic_and_slots():
    bm = BlockManager(8, 4)
    assert bm.num_free_blocks == 8
    assert bm.allocate(7, list(range(6))) == 0
    assert bm.has(7) and not bm.has(8)
    table = bm.block_table(7)
    assert len(table) == 2 and len(set(table)) == 2
    assert bm.num_tokens(7) == 6 and bm.num_committed(7) == 0
    assert bm.num_free_blocks == 6
    assert bm.slots(7, 0, 6) == [table[i // 4] * 4 + i % 4 for i in range(6)]
    assert bm.slots(7, 3, 5) == [table[0] * 4 + 3, table[1] * 4]
    assert bm.slots(7, 2, 2) == []
    for bad in [(-1, 2), (3, 2), (0, 7)]:
        with pytest.raises(ValueError):
            bm.slots(7, *bad)
    # The returned table is a copy.
    bm.block_table(7).append(99)
    assert bm.block_table(7) == table
    bm.check_invariants()


def test_empty_prompt_and_double_allocate_rejected():
    bm = BlockManager(8, 4)
    assert not bm.can_allocate([])
    with pytest.raises(ValueError, match="empty"):
        bm.allocate(0, [])
    assert not bm.has(0)
    bm.allocate(0, [1, 2])
    before = snapshot(bm)
    with pytest.raises(ValueError, match="already"):
        bm.allocate(0, [1, 2])
    assert snapshot(bm) == before


def test_unknown_seq_errors():
    bm = BlockManager(8, 4)
    calls = [
        lambda: bm.append(3, 1), lambda: bm.can_append(3, 1), lambda: bm.rollback(3, 0),
        lambda: bm.commit(3, []), lambda: bm.free(3), lambda: bm.block_table(3),
        lambda: bm.num_tokens(3), lambda: bm.num_committed(3), lambda: bm.slots(3, 0, 0),
    ]
    for call in calls:
        with pytest.raises(ValueError, match="unknown sequence 3"):
            call()


def test_bad_counts_rejected():
    bm = BlockManager(8, 4)
    bm.allocate(0, [1, 2, 3])
    for n in (-1, 1.5, True):
        with pytest.raises(ValueError):
            bm.append(0, n)
        with pytest.raises(ValueError):
            bm.rollback(0, n)
        with pytest.raises(ValueError):
            bm.can_append(0, n)


# ---------------------------------------------------------------- prefix caching


def test_prefix_reuse_from_live_sequence():
    bm = BlockManager(16, 4)
    prompt = list(range(10))
    assert bm.allocate(0, prompt) == 0
    bm.commit(0, prompt)
    t0 = bm.block_table(0)
    # Shares the two full blocks of the live sequence 0.
    assert bm.allocate(1, prompt[:8] + [50, 51]) == 8
    t1 = bm.block_table(1)
    assert t1[:2] == t0[:2] and t1[2] != t0[2]
    assert bm.ref_count(t0[0]) == 2 and bm.ref_count(t0[2]) == 1
    assert bm.cached_tokens(t0[0]) == (0, 1, 2, 3) and bm.cached_tokens(t0[1]) == (4, 5, 6, 7)
    assert bm.cached_tokens(t0[2]) is None  # partial block: never cached
    assert bm.num_committed(1) == 8
    # Only the first block matches here.
    assert bm.allocate(2, [0, 1, 2, 3, 4, 5, 6, 99, 1]) == 4
    bm.check_invariants()
    st_ = bm.stats()
    assert st_["prefix_cache_hit_tokens"] == 12
    assert st_["prefix_cache_query_tokens"] == 10 + 10 + 9
    assert st_["cached_blocks"] == 2 and st_["cached_free_blocks"] == 0


def test_prompt_of_exact_block_multiple_keeps_one_token_to_compute():
    bm = BlockManager(16, 4)
    prompt = list(range(12))
    bm.allocate(0, prompt)
    bm.commit(0, prompt)
    assert len(bm.block_table(0)) == 3
    cached = bm.allocate(1, prompt)
    assert cached == 8 <= len(prompt) - 1
    t0, t1 = bm.block_table(0), bm.block_table(1)
    assert t1[:2] == t0[:2] and t1[2] != t0[2]
    # block_size 1: everything but the last token is cached.
    bm1 = BlockManager(8, 1)
    bm1.allocate(0, [5, 6, 7])
    bm1.commit(0, [5, 6, 7])
    assert bm1.allocate(1, [5, 6, 7]) == 2
    assert bm1.allocate(2, [5]) == 0
    bm1.check_invariants()


def test_same_block_tokens_under_different_parent_do_not_match():
    bm = BlockManager(16, 2)
    bm.allocate(0, [1, 2, 3, 4, 0])
    bm.commit(0, [1, 2, 3, 4, 0])
    assert bm.allocate(1, [9, 9, 3, 4, 0]) == 0  # block (3, 4) exists, but after (1, 2)
    assert bm.allocate(2, [1, 2, 3, 5, 0]) == 2
    assert bm.allocate(3, [1, 2, 3, 4, 0]) == 4
    bm.check_invariants()


def test_freed_blocks_stay_cached_until_evicted():
    bm = BlockManager(4, 2)
    bm.allocate(0, [1, 2, 3, 4, 5])
    bm.commit(0, [1, 2, 3, 4, 5])
    bm.free(0)
    assert bm.num_free_blocks == 4
    assert bm.stats()["cached_free_blocks"] == 2 and bm.stats()["used_blocks"] == 0
    assert bm.allocate(1, [1, 2, 3, 4, 9]) == 4
    assert bm.num_free_blocks == 1
    bm.free(1)
    # Fill the whole pool with unrelated content: the cached blocks get evicted and their entries removed.
    bm.allocate(2, [7] * 8)
    assert bm.stats()["cached_blocks"] == 0
    assert all(bm.cached_tokens(b) is None for b in range(4))
    bm.free(2)
    assert bm.allocate(3, [1, 2, 3, 4, 9]) == 0
    bm.check_invariants()


def test_clean_blocks_used_before_evicting_and_lru_order():
    bm = BlockManager(6, 2)
    for sid, first in enumerate([10, 20]):
        p = [first, first + 1, first + 2]
        bm.allocate(sid, p)
        bm.commit(sid, p)
    bm.free(0)
    bm.free(1)  # LRU (oldest first): block of seq 0, then of seq 1; 4 clean blocks left
    assert bm.stats()["cached_free_blocks"] == 2
    bm.allocate(2, [0] * 8)  # 4 blocks: all clean ones, nothing evicted
    assert bm.stats()["evictions"] == 0
    assert bm.allocate(3, [99, 98]) == 0  # evicts the least recently freed: seq 0's block
    assert bm.stats()["evictions"] == 1
    bm.free(3)
    assert bm.allocate(4, [20, 21, 0]) == 2
    bm.free(2)
    assert bm.allocate(5, [10, 11, 0]) == 0
    bm.check_invariants()


def test_lru_evicts_deeper_blocks_before_their_prefix():
    bm = BlockManager(4, 1)
    bm.allocate(0, [1, 2, 3, 4])
    bm.commit(0, [1, 2, 3, 4])
    bm.free(0)
    bm.allocate(1, [9, 9])  # evicts the blocks of tokens 4 and 3
    bm.free(1)
    assert bm.allocate(2, [1, 2, 3, 4]) == 2
    bm.check_invariants()


def test_concurrent_duplicates_keep_prefix_available():
    bm = BlockManager(8, 2)
    prompt = [1, 2, 3, 4, 5]
    bm.allocate(0, prompt)
    bm.allocate(1, prompt)  # nothing committed yet: computed twice
    bm.commit(0, prompt)
    bm.commit(1, prompt)
    assert bm.stats()["cached_blocks"] == 4
    bm.free(0)
    bm.allocate(2, [8] * 6)  # 3 blocks: the 3 clean ones
    bm.allocate(3, [7] * 4)  # 2 blocks: evicts seq 0's cached blocks
    assert bm.num_free_blocks == 0 and bm.stats()["evictions"] == 2 and bm.stats()["cached_blocks"] == 2
    # Seq 1 still holds identical content, so the prefix is still a hit (through its blocks).
    bm.free(3)
    assert bm.allocate(4, prompt) == 4
    assert bm.block_table(4)[:2] == bm.block_table(1)[:2]
    bm.check_invariants()


def test_can_allocate_counts_cache_hits():
    bm = BlockManager(3, 2)
    bm.allocate(0, [1, 2, 3, 4, 5])
    bm.commit(0, [1, 2, 3, 4])
    # 3 blocks needed, 2 of them shared with the live sequence, 0 free.
    assert bm.num_free_blocks == 0
    assert not bm.can_allocate([1, 2, 3, 4, 6])
    bm.rollback(0, 1)
    assert bm.num_free_blocks == 1
    assert bm.can_allocate([1, 2, 3, 4, 6]) and not bm.can_allocate([1, 2, 3, 5, 6])
    assert bm.allocate(1, [1, 2, 3, 4, 6]) == 4
    bm.check_invariants()


def test_cached_but_unreferenced_hits_are_not_double_counted():
    bm = BlockManager(3, 2)
    bm.allocate(0, [1, 2, 3, 4, 5])
    bm.commit(0, [1, 2, 3, 4])
    bm.free(0)  # 2 cached free blocks + 1 clean
    assert bm.num_free_blocks == 3
    # 3 blocks: the 2 hits are free blocks themselves, so only 1 other free block remains -> 1 new: fits.
    assert bm.can_allocate([1, 2, 3, 4, 5, 6])
    assert not bm.can_allocate([1, 2, 3, 4, 5, 6, 7])  # needs 2 new, only 1 left once the hits are taken
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(1, [1, 2, 3, 4, 5, 6, 7])
    assert snapshot(bm) == before and not bm.has(1)
    assert bm.allocate(1, [1, 2, 3, 4, 5, 6]) == 4
    bm.check_invariants()


def test_allocation_failure_leaves_state_unchanged():
    bm = BlockManager(4, 4)
    bm.allocate(0, list(range(9)))
    bm.commit(0, list(range(8)))
    before = snapshot(bm)
    assert not bm.can_allocate(list(range(20, 29)))
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(1, list(range(20, 29)))
    assert snapshot(bm) == before and not bm.has(1)
    bm.check_invariants()


def test_prefix_caching_disabled():
    bm = BlockManager(8, 2, enable_prefix_caching=False)
    bm.allocate(0, [1, 2, 3, 4, 5])
    bm.commit(0, [1, 2, 3, 4, 5])
    assert bm.allocate(1, [1, 2, 3, 4, 5]) == 0
    assert bm.stats()["cached_blocks"] == 0
    bm.free(0)
    bm.free(1)
    assert bm.stats()["cached_free_blocks"] == 0 and bm.num_free_blocks == 8
    bm.check_invariants()


# ---------------------------------------------------------------- append / rollback / commit / free


def test_append_across_block_boundary_and_failure():
    bm = BlockManager(3, 4)
    bm.allocate(0, [1, 2, 3])
    assert bm.can_append(0, 1)
    bm.append(0, 1)
    assert len(bm.block_table(0)) == 1 and bm.num_tokens(0) == 4
    bm.append(0, 0)
    assert bm.num_tokens(0) == 4
    bm.append(0, 5)
    assert len(bm.block_table(0)) == 3 and bm.num_tokens(0) == 9
    assert bm.num_free_blocks == 0
    bm.append(0, 3)  # fills the tail block: no new block needed
    assert not bm.can_append(0, 1)
    before = snapshot(bm)
    with pytest.raises(NoFreeBlocksError):
        bm.append(0, 1)
    assert snapshot(bm) == before
    bm.check_invariants()


def test_rollback_across_block_boundary_frees_block():
    bm = BlockManager(4, 4)
    bm.allocate(0, list(range(5)))
    bm.commit(0, list(range(3)))
    bm.append(0, 4)  # 9 tokens -> 3 blocks
    t = bm.block_table(0)
    assert len(t) == 3 and bm.num_free_blocks == 1
    bm.rollback(0, 1)  # 8 tokens -> 2 blocks
    assert bm.block_table(0) == t[:2] and bm.num_free_blocks == 2 and bm.ref_count(t[2]) == 0
    bm.rollback(0, 4)  # 4 tokens -> 1 block
    assert bm.block_table(0) == t[:1] and bm.num_free_blocks == 3
    bm.rollback(0, 0)
    with pytest.raises(ValueError, match="uncommitted"):
        bm.rollback(0, 2)  # would reach committed token 2
    assert bm.num_tokens(0) == 4
    bm.rollback(0, 1)
    assert bm.num_tokens(0) == 3 and bm.num_committed(0) == 3
    bm.check_invariants()


def test_rollback_to_zero_tokens():
    bm = BlockManager(2, 2)
    bm.allocate(0, [1, 2, 3])
    bm.rollback(0, 3)
    assert bm.block_table(0) == [] and bm.num_tokens(0) == 0 and bm.num_free_blocks == 2
    bm.append(0, 1)
    assert len(bm.block_table(0)) == 1
    bm.free(0)
    assert bm.num_free_blocks == 2


def test_commit_bounds():
    bm = BlockManager(8, 2)
    bm.allocate(0, [1, 2, 3])
    with pytest.raises(ValueError, match="allocated"):
        bm.commit(0, [1, 2, 3, 4])  # beyond num_tokens
    bm.commit(0, [1, 2])
    assert bm.num_committed(0) == 2 and bm.stats()["cached_blocks"] == 1
    bm.commit(0, [1, 2])  # idempotent
    assert bm.stats()["cached_blocks"] == 1
    with pytest.raises(ValueError, match="already committed"):
        bm.commit(0, [1])
    bm.append(0, 2)
    bm.commit(0, [1, 2, 3, 4, 5])
    assert bm.num_committed(0) == 5 and bm.stats()["cached_blocks"] == 2
    bm.check_invariants()


def test_free_everything_returns_all_blocks():
    bm = BlockManager(10, 3)
    bm.allocate(0, list(range(7)))
    bm.commit(0, list(range(7)))
    bm.allocate(1, list(range(7)) + [1])
    bm.append(1, 4)
    bm.allocate(2, [4, 4])
    for s in (1, 0, 2):
        bm.free(s)
    assert bm.num_free_blocks == 10
    assert all(bm.ref_count(b) == 0 for b in range(10))
    assert bm.stats()["used_blocks"] == 0 and bm.stats()["num_sequences"] == 0
    with pytest.raises(ValueError):
        bm.free(0)
    bm.check_invariants()


# ---------------------------------------------------------------- stateful model check

TOKENS = st.integers(0, 2)  # tiny alphabet: prefixes collide often


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocate/append/rollback/commit/free against a reference model.

    Reference state: each live sequence's logical token list and committed count; a simulated KV cache
    (slot -> token written there); and, per physical block, the full prefix (all tokens up to the block's end)
    it was committed with, dropped when the block is handed out fresh (i.e. overwritten). The latter predicts
    exactly which prefixes must be cache hits.
    """

    @initialize(num_blocks=st.integers(1, 20), block_size=st.integers(1, 4), caching=st.booleans())
    def setup(self, num_blocks, block_size, caching):
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.bs = block_size
        self.caching = caching
        self.seqs: dict[int, list] = {}  # sid -> [tokens, committed]
        self.next_sid = 0
        self.kv: dict[int, int] = {}
        self.recorded: dict[int, tuple[int, ...]] = {}
        self.history: list[list[int]] = []

    # -- helpers

    def _write(self, sid: int, start: int, tokens: list[int]) -> None:
        for slot, tok in zip(self.bm.slots(sid, start, start + len(tokens)), tokens):
            self.kv[slot] = tok

    def _fresh(self, blocks: list[int]) -> None:
        for b in blocks:
            self.recorded.pop(b, None)

    def _expected_cached(self, prompt: list[int]) -> int:
        if not self.caching:
            return 0
        present = set(self.recorded.values())
        k = 0
        while k < (len(prompt) - 1) // self.bs and tuple(prompt[: (k + 1) * self.bs]) in present:
            k += 1
        return k * self.bs

    # -- rules

    @rule(data=st.data())
    def allocate(self, data):
        sources = self.history + [s[0][: s[1]] for s in self.seqs.values()]
        if sources and data.draw(st.booleans(), label="share"):
            src = data.draw(st.sampled_from(sources), label="source")
            cut = data.draw(st.integers(0, len(src)), label="cut")
            prompt = src[:cut] + data.draw(st.lists(TOKENS, max_size=4), label="ext")
        else:
            prompt = data.draw(st.lists(TOKENS, max_size=12), label="prompt")
        sid = self.next_sid
        if not prompt:
            with pytest.raises(ValueError):
                self.bm.allocate(sid, prompt)
            assert not self.bm.has(sid)
            return
        expected = self._expected_cached(prompt)
        ok = self.bm.can_allocate(prompt)
        if not ok:
            before = snapshot(self.bm)
            with pytest.raises(NoFreeBlocksError):
                self.bm.allocate(sid, prompt)
            assert snapshot(self.bm) == before and not self.bm.has(sid)
            return
        cached = self.bm.allocate(sid, prompt)
        self.next_sid += 1
        assert cached == expected, (cached, expected, prompt)
        assert cached % self.bs == 0 and cached <= len(prompt) - 1
        table = self.bm.block_table(sid)
        k = cached // self.bs
        for j in range(k):
            b = table[j]
            assert self.bm.cached_tokens(b) == tuple(prompt[j * self.bs:(j + 1) * self.bs])
            assert self.recorded[b] == tuple(prompt[: (j + 1) * self.bs])
        # The reused KV must already be the prompt's.
        assert [self.kv.get(s) for s in self.bm.slots(sid, 0, cached)] == prompt[:cached]
        self._fresh(table[k:])
        self._write(sid, cached, prompt[cached:])
        self.seqs[sid] = [list(prompt), cached]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def append(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)), label="sid")
        new = data.draw(st.lists(TOKENS, max_size=6), label="new")
        tokens = self.seqs[sid][0]
        old_blocks = len(self.bm.block_table(sid))
        if not self.bm.can_append(sid, len(new)):
            before = snapshot(self.bm)
            with pytest.raises(NoFreeBlocksError):
                self.bm.append(sid, len(new))
            assert snapshot(self.bm) == before
            return
        start = len(tokens)
        self.bm.append(sid, len(new))
        self._fresh(self.bm.block_table(sid)[old_blocks:])
        self._write(sid, start, new)
        tokens.extend(new)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def rollback(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)), label="sid")
        tokens, committed = self.seqs[sid]
        n = data.draw(st.integers(0, len(tokens) - committed + 1), label="n")
        if n > len(tokens) - committed:
            before = snapshot(self.bm)
            with pytest.raises(ValueError):
                self.bm.rollback(sid, n)
            assert snapshot(self.bm) == before
            return
        self.bm.rollback(sid, n)
        del tokens[len(tokens) - n:]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def commit(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)), label="sid")
        tokens, committed = self.seqs[sid]
        k = data.draw(st.integers(committed, len(tokens)), label="k")
        self.bm.commit(sid, tokens[:k])
        if self.caching:
            table = self.bm.block_table(sid)
            for j in range(committed // self.bs, k // self.bs):
                self.recorded[table[j]] = tuple(tokens[: (j + 1) * self.bs])
        self.seqs[sid][1] = k

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def bad_commit(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)), label="sid")
        tokens, committed = self.seqs[sid]
        before = snapshot(self.bm)
        with pytest.raises(ValueError):
            self.bm.commit(sid, tokens + [0])
        if committed:
            with pytest.raises(ValueError):
                self.bm.commit(sid, tokens[: committed - 1])
        assert snapshot(self.bm) == before

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def free(self, data):
        sid = data.draw(st.sampled_from(sorted(self.seqs)), label="sid")
        tokens, committed = self.seqs.pop(sid)
        self.bm.free(sid)
        if committed:
            self.history.append(tokens[:committed])
        with pytest.raises(ValueError):
            self.bm.num_tokens(sid)

    # -- invariants

    @invariant()
    def consistent(self):
        if not hasattr(self, "bm"):
            return
        bm, bs = self.bm, self.bs
        bm.check_invariants()
        holders: dict[int, list[tuple[int, int]]] = {}
        for sid, (tokens, committed) in self.seqs.items():
            assert bm.num_tokens(sid) == len(tokens) and bm.num_committed(sid) == committed
            table = bm.block_table(sid)
            assert len(table) == bm.blocks_needed(len(tokens))
            for j, b in enumerate(table):
                holders.setdefault(b, []).append((sid, j))
            # Simulated KV: reading the sequence through its table yields its own tokens.
            assert [self.kv.get(s) for s in bm.slots(sid, 0, len(tokens))] == tokens
        for b, hs in holders.items():
            assert bm.ref_count(b) == len(hs)
            if len(hs) > 1:
                recorded = bm.cached_tokens(b)
                assert recorded is not None
                for sid, j in hs:
                    tokens, committed = self.seqs[sid]
                    assert (j + 1) * bs <= committed
                    assert tuple(tokens[j * bs:(j + 1) * bs]) == recorded
        used = len(holders)
        assert bm.num_free_blocks == bm.num_blocks - used
        s = bm.stats()
        assert s["used_blocks"] == used and s["free_blocks"] == bm.num_blocks - used
        assert all(bm.ref_count(b) == 0 for b in range(bm.num_blocks) if b not in holders)
        # The reference's view of the prefix cache matches the manager's.
        for b in range(bm.num_blocks):
            rec = self.recorded.get(b)
            assert bm.cached_tokens(b) == (None if rec is None else rec[-bs:])

    def teardown(self):
        if not hasattr(self, "bm"):
            return
        for sid in list(self.seqs):
            self.bm.free(sid)
        assert self.bm.num_free_blocks == self.bm.num_blocks
        assert self.bm.stats()["used_blocks"] == 0
        self.bm.check_invariants()


BlockManagerMachine.TestCase.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestBlockManagerMachine = BlockManagerMachine.TestCase
