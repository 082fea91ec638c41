"""Paged KV-cache bookkeeping: physical blocks, per-sequence block tables and a prefix cache.

The KV cache is a pool of ``num_blocks`` physical blocks of ``block_size`` token slots each. A sequence owns a
block table (a list of physical block ids); token position ``i`` of the sequence lives in slot
``table[i // block_size] * block_size + i % block_size``. This module only does the bookkeeping (no torch).

Token lifecycle of a sequence::

    allocate(prompt) / append(n)   reserve room: num_tokens grows (KV not yet written)
    commit(tokens)                 the KV of tokens[:k] is written and final: num_committed = k
    rollback(n)                    forget uncommitted tokens (e.g. rejected speculative tokens)
    free()                         release the table

Prefix cache. Every *full, committed* block is registered under a key ``(parent_node_id, block_tokens)``, where
``parent_node_id`` names the cache entry of the previous block of the same sequence (0 for the first block).
Because a key contains the exact tokens and an id that is never reused, a lookup verifies token equality of the
whole prefix through dict equality, with no risk of hash collisions. A cache entry (``_Node``) is a content
identity; several physical blocks may hold the same content (two sequences computed the same prompt
concurrently), so an entry keeps a small set of blocks and disappears only when the last of them is evicted.

Invariants (checked by :meth:`BlockManager.check_invariants`):

* a block referenced by more than one table is full, committed and registered in the cache, so no sequence
  ever writes into a block another sequence reads: a sequence only writes positions ``>= num_committed`` and
  those live in its own exclusive tail blocks;
* ref counts equal the number of tables holding each block;
* every block is exactly one of: referenced (used), free-and-clean, free-and-cached (LRU-evictable);
* evicting a cached block for reuse removes it from its cache entry (and the entry, when it was the last).

All operations are O(blocks touched) (plus hashing the tokens of the blocks touched).
"""
from __future__ import annotations

import itertools
import logging
from collections import OrderedDict
from collections.abc import Sequence

logger = logging.getLogger(__name__)

__all__ = ["BlockManager", "NoFreeBlocksError"]

_ROOT_NODE_ID = 0

_Key = tuple[int, tuple[int, ...]]


class NoFreeBlocksError(RuntimeError):
    """Not enough free KV-cache blocks for the request; the manager's state is unchanged."""


class _Node:
    """A prefix-cache entry: one block's worth of tokens after a given parent entry."""

    __slots__ = ("node_id", "key", "blocks")

    def __init__(self, node_id: int, key: _Key) -> None:
        self.node_id = node_id
        self.key = key
        # Physical blocks holding exactly this content (insertion-ordered set).
        self.blocks: dict[int, None] = {}


class _Seq:
    __slots__ = ("table", "num_tokens", "num_committed")

    def __init__(self, table: list[int], num_tokens: int, num_committed: int) -> None:
        self.table = table
        self.num_tokens = num_tokens
        self.num_committed = num_committed


class BlockManager:
    """Allocates KV-cache blocks to sequences, with optional prefix caching (see module docstring)."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 0:
            raise ValueError(f"num_blocks must be a non-negative int, got {num_blocks!r}")
        if not isinstance(block_size, int) or isinstance(block_size, bool) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.num_blocks: int = num_blocks
        self.block_size: int = block_size
        self.enable_prefix_caching: bool = bool(enable_prefix_caching)

        self._ref: list[int] = [0] * num_blocks
        self._node_of: list[_Node | None] = [None] * num_blocks
        # Free blocks holding no cached content; a stack so that low ids are handed out first.
        self._clean: list[int] = list(range(num_blocks - 1, -1, -1))
        # Free blocks holding cached content, least recently freed first (evicted first).
        self._lru: OrderedDict[int, None] = OrderedDict()
        self._cache: dict[_Key, _Node] = {}
        self._node_ids = itertools.count(_ROOT_NODE_ID + 1)
        self._num_cached_blocks = 0  # blocks registered in some _Node (referenced or not)
        self._seqs: dict[int, _Seq] = {}

        self._hit_tokens = 0
        self._query_tokens = 0
        self._num_evictions = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: never used / clean ones plus cached-but-unreferenced ones."""
        return len(self._clean) + len(self._lru)

    def blocks_needed(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return -(-num_tokens // self.block_size)

    def has(self, seq_id: int) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id: int) -> list[int]:
        """A copy of the sequence's block table."""
        return list(self._get(seq_id).table)

    def num_tokens(self, seq_id: int) -> int:
        return self._get(seq_id).num_tokens

    def num_committed(self, seq_id: int) -> int:
        return self._get(seq_id).num_committed

    def slots(self, seq_id: int, start: int, end: int) -> list[int]:
        """Physical slot ids of positions ``[start, end)`` of the sequence."""
        seq = self._get(seq_id)
        if not 0 <= start <= end <= seq.num_tokens:
            raise ValueError(
                f"slot range [{start}, {end}) out of bounds for sequence {seq_id} with {seq.num_tokens} tokens")
        bs = self.block_size
        table = seq.table
        return [table[i // bs] * bs + i % bs for i in range(start, end)]

    def ref_count(self, block_id: int) -> int:
        """Number of block tables holding ``block_id`` (debugging / tests)."""
        return self._ref[block_id]

    def cached_tokens(self, block_id: int) -> tuple[int, ...] | None:
        """The tokens recorded for ``block_id`` in the prefix cache, or None if it is not cached."""
        node = self._node_of[block_id]
        return None if node is None else node.key[1]

    def stats(self) -> dict:
        free = self.num_free_blocks
        q = self._query_tokens
        return {
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "used_blocks": self.num_blocks - free,
            "free_blocks": free,
            "cached_blocks": self._num_cached_blocks,
            "cached_free_blocks": len(self._lru),
            "num_sequences": len(self._seqs),
            "prefix_cache_hit_tokens": self._hit_tokens,
            "prefix_cache_query_tokens": q,
            "prefix_cache_hit_rate": (self._hit_tokens / q) if q else 0.0,
            "evictions": self._num_evictions,
        }

    # ------------------------------------------------------------------ allocation

    def can_allocate(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether :meth:`allocate` of this prompt would succeed now (prefix-cache hits cost nothing)."""
        n = len(prompt_token_ids)
        if n == 0:
            return False
        hits, hits_free = self._match_prefix(prompt_token_ids)
        return self.blocks_needed(n) - len(hits) <= self.num_free_blocks - hits_free

    def allocate(self, seq_id: int, prompt_token_ids: Sequence[int]) -> int:
        """New sequence holding the prompt (``num_tokens = len(prompt)``).

        Reuses prefix-cached full blocks and returns the number of leading prompt tokens whose KV is already
        present: a multiple of ``block_size`` and at most ``len(prompt) - 1``, so that at least one token is
        computed to get logits. Those tokens count as committed. Raises :class:`NoFreeBlocksError` with the
        state unchanged when there is not enough room.
        """
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id} is already allocated")
        n = len(prompt_token_ids)
        if n == 0:
            raise ValueError(f"cannot allocate sequence {seq_id} with an empty prompt")
        hits, hits_free = self._match_prefix(prompt_token_ids)
        num_new = self.blocks_needed(n) - len(hits)
        if num_new > self.num_free_blocks - hits_free:
            raise NoFreeBlocksError(
                f"sequence {seq_id}: prompt of {n} tokens needs {num_new} new blocks "
                f"({len(hits)} cached), only {self.num_free_blocks - hits_free} free")
        # Take the hit blocks first so that the evictions below cannot pick them.
        for b in hits:
            if self._ref[b] == 0:
                del self._lru[b]
            self._ref[b] += 1
        table = hits + self._take(num_new)
        cached = len(hits) * self.block_size
        self._seqs[seq_id] = _Seq(table, n, cached)
        if self.enable_prefix_caching:
            self._hit_tokens += cached
            self._query_tokens += n
        logger.debug("allocate seq %d: %d tokens, %d cached, %d new blocks", seq_id, n, cached, num_new)
        return cached

    def can_append(self, seq_id: int, n: int) -> bool:
        seq = self._get(seq_id)
        self._check_count(n)
        return self.blocks_needed(seq.num_tokens + n) - len(seq.table) <= self.num_free_blocks

    def append(self, seq_id: int, n: int) -> None:
        """Make room for ``n`` more tokens (``num_tokens += n``); NoFreeBlocksError leaves the state unchanged."""
        seq = self._get(seq_id)
        self._check_count(n)
        num_new = self.blocks_needed(seq.num_tokens + n) - len(seq.table)
        if num_new > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"sequence {seq_id}: appending {n} tokens needs {num_new} new blocks, "
                f"only {self.num_free_blocks} free")
        if num_new > 0:
            seq.table.extend(self._take(num_new))
        seq.num_tokens += n

    def rollback(self, seq_id: int, n: int) -> None:
        """Forget the last ``n`` (uncommitted) tokens; blocks no longer needed are freed."""
        seq = self._get(seq_id)
        self._check_count(n)
        if n > seq.num_tokens - seq.num_committed:
            raise ValueError(
                f"sequence {seq_id}: cannot roll back {n} tokens, only "
                f"{seq.num_tokens - seq.num_committed} of {seq.num_tokens} are uncommitted")
        seq.num_tokens -= n
        keep = self.blocks_needed(seq.num_tokens)
        table = seq.table
        while len(table) > keep:
            b = table.pop()
            # These blocks hold uncommitted positions only, so they are exclusive and not cached.
            self._release(b)

    def commit(self, seq_id: int, token_ids: Sequence[int]) -> None:
        """``token_ids`` is the sequence's full token list whose KV is written and final.

        Marks ``token_ids[:len(token_ids)]`` committed and registers every newly completed full block in the
        prefix cache. ``len(token_ids)`` must lie in ``[num_committed, num_tokens]``; the already committed part
        is assumed unchanged (it is not re-read, to keep this O(new blocks)).
        """
        seq = self._get(seq_id)
        k = len(token_ids)
        if k > seq.num_tokens:
            raise ValueError(
                f"sequence {seq_id}: cannot commit {k} tokens, only {seq.num_tokens} are allocated")
        if k < seq.num_committed:
            raise ValueError(
                f"sequence {seq_id}: cannot commit {k} tokens, {seq.num_committed} are already committed")
        bs = self.block_size
        if self.enable_prefix_caching:
            table = seq.table
            for j in range(seq.num_committed // bs, k // bs):
                b = table[j]
                parent_id = _ROOT_NODE_ID if j == 0 else self._node_of[table[j - 1]].node_id
                key = (parent_id, tuple(token_ids[j * bs:(j + 1) * bs]))
                node = self._cache.get(key)
                if node is None:
                    node = _Node(next(self._node_ids), key)
                    self._cache[key] = node
                node.blocks[b] = None
                self._node_of[b] = node
                self._num_cached_blocks += 1
        seq.num_committed = k

    def free(self, seq_id: int) -> None:
        """Release the sequence; its cached full blocks stay reusable (LRU-evictable) until their slot is needed."""
        seq = self._seqs.pop(seq_id, None)
        if seq is None:
            raise ValueError(f"unknown sequence {seq_id}")
        # Tail first: deeper blocks become older in the LRU and are evicted before their prefixes.
        for b in reversed(seq.table):
            self._release(b)

    # ------------------------------------------------------------------ checking

    def check_invariants(self) -> None:
        """Full O(num_blocks + table sizes) consistency check; raises AssertionError on a violation."""

        def fail(msg: str) -> None:
            raise AssertionError(f"BlockManager invariant violated: {msg}")

        bs = self.block_size
        refs = [0] * self.num_blocks
        for sid, seq in self._seqs.items():
            if not 0 <= seq.num_committed <= seq.num_tokens:
                fail(f"seq {sid}: committed {seq.num_committed} / tokens {seq.num_tokens}")
            if len(seq.table) != self.blocks_needed(seq.num_tokens):
                fail(f"seq {sid}: {len(seq.table)} blocks for {seq.num_tokens} tokens")
            if len(set(seq.table)) != len(seq.table):
                fail(f"seq {sid}: block repeated in its table")
            for j, b in enumerate(seq.table):
                refs[b] += 1
                full_committed = (j + 1) * bs <= seq.num_committed
                if self.enable_prefix_caching and full_committed and self._node_of[b] is None:
                    fail(f"seq {sid}: full committed block {b} is not cached")
                if not full_committed and self._node_of[b] is not None:
                    fail(f"seq {sid}: block {b} holding uncommitted positions is cached")
        if refs != self._ref:
            fail("reference counts differ from the block tables")
        for b, r in enumerate(refs):
            if r > 1 and self._node_of[b] is None:
                fail(f"block {b} is shared by {r} sequences but not a cached full block")
        clean, lru = set(self._clean), set(self._lru)
        if len(clean) != len(self._clean) or clean & lru:
            fail("free lists overlap")
        for b in range(self.num_blocks):
            used = refs[b] > 0
            if used + (b in clean) + (b in lru) != 1:
                fail(f"block {b} is not in exactly one of used/clean/lru")
            if b in clean and self._node_of[b] is not None:
                fail(f"clean block {b} is cached")
            if b in lru and self._node_of[b] is None:
                fail(f"LRU block {b} is not cached")
        n_cached = 0
        for key, node in self._cache.items():
            if node.key != key or not node.blocks:
                fail(f"bad cache entry {key!r}")
            for b in node.blocks:
                if self._node_of[b] is not node:
                    fail(f"block {b} listed in a cache entry it does not belong to")
            n_cached += len(node.blocks)
        if n_cached != self._num_cached_blocks or n_cached != sum(x is not None for x in self._node_of):
            fail("cached block count mismatch")

    # ------------------------------------------------------------------ internals

    def _get(self, seq_id: int) -> _Seq:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise ValueError(f"unknown sequence {seq_id}")
        return seq

    @staticmethod
    def _check_count(n: int) -> None:
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise ValueError(f"token count must be a non-negative int, got {n!r}")

    def _match_prefix(self, prompt: Sequence[int]) -> tuple[list[int], int]:
        """Cached blocks covering the longest cached prefix (at most len(prompt) - 1 tokens).

        Returns the blocks and how many of them are currently unreferenced (they count as free until taken).
        """
        if not self.enable_prefix_caching:
            return [], 0
        bs = self.block_size
        hits: list[int] = []
        num_unreferenced = 0
        parent_id = _ROOT_NODE_ID
        for j in range((len(prompt) - 1) // bs):
            node = self._cache.get((parent_id, tuple(prompt[j * bs:(j + 1) * bs])))
            if node is None:
                break
            block = -1
            for b in node.blocks:  # prefer a block already in use: it costs no free block
                if self._ref[b] > 0:
                    block = b
                    break
            if block < 0:
                block = next(iter(node.blocks))
                num_unreferenced += 1
            hits.append(block)
            parent_id = node.node_id
        return hits, num_unreferenced

    def _take(self, n: int) -> list[int]:
        """Hand out ``n`` free blocks (caller checked there are enough): clean ones first, then evict LRU."""
        out: list[int] = []
        for _ in range(n):
            if self._clean:
                b = self._clean.pop()
            else:
                b, _ = self._lru.popitem(last=False)
                self._evict(b)
            self._ref[b] = 1
            out.append(b)
        return out

    def _evict(self, b: int) -> None:
        node = self._node_of[b]
        del node.blocks[b]
        if not node.blocks:
            del self._cache[node.key]
        self._node_of[b] = None
        self._num_cached_blocks -= 1
        self._num_evictions += 1

    def _release(self, b: int) -> None:
        self._ref[b] -= 1
        if self._ref[b] == 0:
            if self._node_of[b] is None:
                self._clean.append(b)
            else:
                self._lru[b] = None
