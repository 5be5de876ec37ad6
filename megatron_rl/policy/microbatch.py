"""Split a batch of variable-length sequences into token-budget micro-batches, balanced over data-parallel ranks.

The items are rows: single sequences, or whole GRPO groups packed into one row (`policy/packing.py` decides which and
their lengths), so with shared-prefix packing DP balancing and packing move whole groups.

1. `balance_over_dp`: sequences go to DP ranks longest-first, each to the rank with the fewest tokens so far
   (greedy LPT), so every rank does about the same work.
2. `pack_microbatches`: within a rank, first-fit-decreasing into bins whose *padded* cost (rows x longest row) stays
   within `max_tokens`. Padded cost is what a dense [b, s] micro-batch actually computes.
   With varlen packing (`packed=True`) a micro-batch is one packed row with no padding between units, so the
   cost of a bin is the sum of its lengths instead.
3. Outputs are written back by the original indices, so callers see results in batch order.
4. With `equal_counts` (a model with experts at DP > 1, `policy/megatron_worker.py`), ranks with fewer micro-batches
   than the busiest one get empty ones appended: megatron's token dispatcher runs an all-to-all over the expert-
   parallel group (data-parallel ranks) in every MoE layer of every micro-batch, so a rank that runs fewer leaves
   the others waiting forever. Splitting bins instead cannot always even the counts (lengths [700, 400, 350] at a
   700 budget need three micro-batches however they are dealt to two ranks); an empty one costs one tiny forward
   and backward, runs the same collectives and contributes nothing (the worker feeds it a filler row).

The update must not depend on this split: losses are normalised by global counts (see `policy/loss_api.py`), never
by micro-batch or rank sizes.
"""
from __future__ import annotations

from dataclasses import dataclass


class SequenceTooLongError(ValueError):
    pass


@dataclass
class MicroBatch:
    indices: list[int]  # positions in the original batch
    max_len: int
    total: int = 0  # sum of the lengths

    @property
    def padded_tokens(self) -> int:
        return len(self.indices) * self.max_len


def balance_over_dp(lengths: list[int], dp_size: int) -> list[list[int]]:
    if dp_size < 1:
        raise ValueError("dp_size must be >= 1")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    loads = [0] * dp_size
    shards: list[list[int]] = [[] for _ in range(dp_size)]
    for i in order:
        r = min(range(dp_size), key=lambda k: (loads[k], len(shards[k]), k))
        shards[r].append(i)
        loads[r] += lengths[i]
    return [sorted(s) for s in shards]


def pack_microbatches(indices: list[int], lengths: list[int], max_tokens: int,
                      packed: bool = False) -> list[MicroBatch]:
    """First-fit-decreasing by padded cost (rows x longest), or by total length when `packed`. Raises
    SequenceTooLongError naming the sequence if one cannot fit."""
    for i in indices:
        if lengths[i] > max_tokens:
            raise SequenceTooLongError(
                f"sequence {i} has {lengths[i]} tokens, more than policy.max_tokens_per_microbatch={max_tokens}; "
                "raise the budget or lower generation.max_new_tokens / data.max_prompt_tokens")
    bins: list[MicroBatch] = []
    for i in sorted(indices, key=lambda k: (-lengths[k], k)):
        for b in bins:
            # longest-first: the bin's max_len never grows, so the cost of one more row is max_len
            cost = b.total + lengths[i] if packed else (len(b.indices) + 1) * b.max_len
            if cost <= max_tokens:
                b.indices.append(i)
                b.total += lengths[i]
                break
        else:
            bins.append(MicroBatch(indices=[i], max_len=lengths[i], total=lengths[i]))
    return bins


def plan(lengths: list[int], dp_size: int, dp_rank: int, max_tokens: int, packed: bool = False,
         equal_counts: bool = False) -> list[MicroBatch]:
    """The micro-batches of one DP rank. Every rank computes the same plan from the same lengths, so each also knows
    the others' micro-batch counts without communicating; with `equal_counts` the plan ends with as many empty
    micro-batches (no indices) as this rank is short of the busiest rank's count."""
    shards = balance_over_dp(lengths, dp_size)
    if not equal_counts:
        return pack_microbatches(shards[dp_rank], lengths, max_tokens, packed)
    per_rank = [pack_microbatches(s, lengths, max_tokens, packed) for s in shards]
    most = max(len(p) for p in per_rank)
    own = per_rank[dp_rank]
    return own + [MicroBatch(indices=[], max_len=0) for _ in range(most - len(own))]
