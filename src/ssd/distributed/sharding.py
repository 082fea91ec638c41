"""Pure split math for the tensor-parallel target: which heads, KV heads, intermediate columns and
vocabulary rows (embedding and LM head) each rank owns. No torch, no I/O: everything here is tested
on its own (tests/test_tensor_parallel.py).

Ranges are half-open (start, stop) pairs; splits are contiguous and as even as possible, the first
ranks taking the extra unit.
"""
from __future__ import annotations

from dataclasses import dataclass

Range = tuple[int, int]


class ShardingError(ValueError):
    """A model cannot be split the way asked (names the dimension and what would work)."""


def split_even(n: int, parts: int) -> list[Range]:
    """[0, n) in `parts` contiguous ranges whose sizes differ by at most one (first ones larger)."""
    if parts < 1:
        raise ShardingError(f"cannot split into {parts} parts")
    q, r = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + q + (1 if i < r else 0)
        out.append((start, stop))
        start = stop
    return out


def split_units(n: int, unit: int, parts: int, what: str = "dimension") -> list[Range]:
    """[0, n) in `parts` non-empty ranges whose bounds are multiples of `unit` (a quant block along
    the input dimension of a row-parallel weight), as even as possible in units."""
    if n % unit:
        raise ShardingError(f"{what}: size {n} is not a multiple of its quant block {unit}")
    units = n // unit
    if units < parts:
        raise ShardingError(f"{what}: {n} values are {units} quant block(s) of {unit}, too few for "
                            f"{parts} ranks; use tensor_parallel_size <= {units}")
    return [(a * unit, b * unit) for a, b in split_even(units, parts)]


def vocab_split(vocab_size: int, world: int) -> list[Range]:
    """The vocabulary rows of the embedding and LM head per rank: contiguous, as even as possible
    (the first vocab_size % world ranks take one row more), none empty."""
    if vocab_size < world:
        raise ShardingError(f"a vocabulary of {vocab_size} tokens cannot be split over {world} ranks")
    return split_even(vocab_size, world)


@dataclass(frozen=True)
class HeadShard:
    q: Range      # query heads of this rank
    kv: Range     # KV heads this rank's queries read (replicated on several ranks when world > num_kv_heads)

    @property
    def num_q(self) -> int:
        return self.q[1] - self.q[0]

    @property
    def num_kv(self) -> int:
        return self.kv[1] - self.kv[0]


def head_split(num_heads: int, num_kv_heads: int, world: int) -> list[HeadShard]:
    """Query heads per rank, and the KV heads they need. GQA groups (num_heads / num_kv_heads query
    heads share one KV head) are never cut when world <= num_kv_heads: KV heads are split evenly and
    each rank takes their query heads. With more ranks than KV heads, each rank serves part of one
    group and holds a copy of that group's KV head (ranks spread evenly over the groups)."""
    if world < 1 or world > num_heads:
        raise ShardingError(f"tensor_parallel_size must be in [1, {num_heads}] (the number of attention "
                            f"heads), got {world}")
    if num_heads % num_kv_heads:
        raise ShardingError(f"{num_heads} heads do not form groups over {num_kv_heads} KV heads")
    g = num_heads // num_kv_heads
    if world <= num_kv_heads:
        return [HeadShard((a * g, b * g), (a, b)) for a, b in split_even(num_kv_heads, world)]
    out = []
    for kv, (r0, r1) in enumerate(split_even(world, num_kv_heads)):
        for a, b in split_even(g, r1 - r0):      # r1 - r0 <= g since world <= num_heads
            out.append(HeadShard((kv * g + a, kv * g + b), (kv, kv + 1)))
    return out


@dataclass(frozen=True)
class RankShard:
    """Everything one rank owns of every layer (all layers are split the same way)."""

    rank: int
    world: int
    heads: HeadShard
    ffn: Range            # columns of the intermediate dimension (rows of gate/up, inputs of down)
    vocab: Range          # rows of the embedding and the LM head (this rank's logits columns)

    @property
    def is_full(self) -> bool:
        return self.world == 1


def plan(num_heads: int, num_kv_heads: int, intermediate: int, world: int, rank: int,
         ffn_unit: int = 1, vocab_size: int | None = None) -> RankShard:
    """This rank's shard; ffn_unit: the quant block of down_proj's input dimension (1 for floats);
    vocab_size: the rows of the embedding and LM head (None: vocab is the empty range)."""
    if not 0 <= rank < world:
        raise ShardingError(f"rank {rank} is outside [0, {world})")
    heads = head_split(num_heads, num_kv_heads, world)[rank]
    ffn = split_units(intermediate, ffn_unit, world, "intermediate size (mlp.down_proj input)")[rank]
    vocab = (0, 0) if vocab_size is None else vocab_split(vocab_size, world)[rank]
    return RankShard(rank, world, heads, ffn, vocab)


def check_row_split(bounds: Range, unit: int, what: str, hint: str) -> None:
    """A row-parallel weight's input split must fall on its quant blocks."""
    if bounds[0] % unit or bounds[1] % unit:
        raise ShardingError(f"{what}: this rank's input columns [{bounds[0]}, {bounds[1]}) do not fall on the "
                            f"weight's quant blocks of {unit}; {hint}")
