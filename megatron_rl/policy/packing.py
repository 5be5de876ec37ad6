"""The plan, first step of a training call's layout (`plan_microbatches`; then `policy/batching.py` builds the rows
and gathers per token): which sequences form a unit, the units' row layouts and lengths, and which units form each
micro-batch (bin packing by length in `policy/microbatch.py`).

Group-shared prefix packing: a GRPO group (G completions of one prompt) as ONE unit.

Unshared, sequence j = P + R_j (prompt length p, response length r_j) is fed as its first L_j - 1 tokens, and its
response token k is predicted at the position holding token p - 1 + k. Packed, a group's row is

    P[0 : p-1]  |  P[p-1] R_1[0 : r_1-1]  |  P[p-1] R_2[0 : r_2-1]  |  ...      (length (p-1) + sum_j r_j)
    shared         segment 1 (r_1 tokens)    segment 2 (r_2 tokens)

Every segment starts with its own copy of the last prompt token. That token's output predicts the completion's first
token, so every response token gets its own row position and the logprob kernel runs once over the row with one
target per position (no position has to predict G different tokens). The copy costs one extra token per completion
and keeps the computation graph identical to the unshared one: the copy sits at position p - 1 and sees exactly
P[0 : p-1] and itself, as the last prompt token does unshared. So the shared part P[0 : p-1] is computed once per
group and its gradient accumulates from all G segments.

Attention (True = masked, megatron's and TE's convention): a token may attend key k when k is at or before it and k is
either shared or in its own segment. RoPE positions restart per segment: segment j's t-th token has position p-1+t,
exactly its unshared position, so the model needs position-indexed rotary frequencies (`policy/rope.py`).

A single-sequence unit laid out by the same rule is the plain unshared row (tokens ids[:-1], positions 0..L-2, causal
mask), so one builder serves both.

Varlen (`policy.packing: varlen`): several units share one packed THD row (`batching.varlen_row`), each unit split
into attention segments (`unit_segments`): a single sequence is one causal segment; a group is its shared part
P[0 : p-1] (causal) plus one segment per completion that attends its own keys causally and the shared part's in full
(cascade attention, `models/varlen_attention.py`), so no mask is built. Segments are padded to `segment_multiple`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.policy.interface import RolloutBatch
from megatron_rl.policy.microbatch import SequenceTooLongError, plan

SHARED = -1  # segment id of the shared prompt part (and of padding, which no real token can see: it comes last)


@dataclass
class RowLayout:
    tokens: list[int]
    positions: list[int]
    targets: list[int]  # -1 where the position predicts nothing that is trained
    segments: list[int]  # SHARED, or the member's index within the row
    spans: list[tuple[int, int]]  # per member: (first column, number of response tokens)


def row_layout(seqs: list[list[int]], prompt_len: int) -> RowLayout:
    """Layout of one row holding `seqs`, which all start with the same `prompt_len` prompt tokens."""
    p = prompt_len
    tokens = list(seqs[0][:p - 1])
    positions = list(range(p - 1))
    targets = [-1] * (p - 1)
    segments = [SHARED] * (p - 1)
    spans = []
    for j, ids in enumerate(seqs):
        r = len(ids) - p
        spans.append((len(tokens), r))
        tokens += ids[p - 1:len(ids) - 1]
        positions += range(p - 1, len(ids) - 1)
        targets += ids[p:]
        segments += [j] * r
    return RowLayout(tokens, positions, targets, segments, spans)


def attention_mask(segments: torch.Tensor) -> torch.Tensor:
    """[b, s] segment ids -> [b, 1, s, s] bool, True = masked."""
    s = segments.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=segments.device).tril()
    same = segments[:, :, None] == segments[:, None, :]
    shared_key = (segments == SHARED)[:, None, :]
    return ~(causal & (same | shared_key))[:, None]


def segment_multiple(tp: int, cp: int = 1, sequence_parallel: bool = False) -> int:
    """Megatron's length requirement on each packed segment: context parallelism splits every sequence into 2*cp
    load-balanced chunks (times tp when the sequence dimension is also split over TP); sequence parallelism alone
    needs the row divisible by tp, which padding every segment to tp gives."""
    if cp > 1:
        return 2 * cp * (tp if sequence_parallel else 1)
    return tp if sequence_parallel else 1


def padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def unit_segments(lay: RowLayout) -> tuple[list[int], list[int]]:
    """(segment lengths, prefix of each segment: -1 or the index of the segment it attends in full) of a laid-out
    unit, in row order. An empty shared part (prompt of one token) gives no segment."""
    if len(lay.spans) == 1:  # a single sequence: prompt and response are one causal segment
        return [len(lay.tokens)], [-1]
    shared = sum(1 for g in lay.segments if g == SHARED)
    head = [shared] if shared else []
    return head + [r for _, r in lay.spans], [-1] * len(head) + [0 if shared else -1] * len(lay.spans)


def _same_prompt(batch: RolloutBatch, members: list[int]) -> bool:
    p = batch.prompt_lens[members[0]]
    first = batch.input_ids[members[0]][:p]
    return all(batch.prompt_lens[i] == p and batch.input_ids[i][:p] == first for i in members[1:])


def unit_length(batch: RolloutBatch, unit: list[int], multiple: int = 0) -> int:
    """Row length of a unit: (p-1) + sum of response lengths; for one sequence that is L - 1. With `multiple` > 0
    (varlen rows), the length with each of its segments padded to that multiple."""
    p = batch.prompt_lens[unit[0]]
    resp = [len(batch.input_ids[i]) - p for i in unit]
    if multiple <= 0:
        return p - 1 + sum(resp)
    if len(unit) == 1:
        return padded(p - 1 + resp[0], multiple)
    return padded(p - 1, multiple) + sum(padded(r, multiple) for r in resp)


def plan_units(batch: RolloutBatch, *, shared: bool, max_tokens: int, dp_size: int = 1,
               multiple: int = 0) -> list[list[int]]:
    """The rows to feed: one per packable group, one per other sequence. Every rank computes the same plan.

    A group is packed when it has >= 2 members with identical prompt tokens and its row fits `max_tokens`; otherwise
    its sequences are fed unshared. If packing would leave fewer rows than data-parallel ranks, the whole batch is
    fed unshared (every DP rank needs work). Units are listed by their first member's batch position. Lengths are
    `unit_length(..., multiple)` (varlen rows: padded segments).
    """
    for i in range(len(batch)):
        n = unit_length(batch, [i], multiple)
        if n > max_tokens:
            raise SequenceTooLongError(
                f"sequence {i} has {n} tokens, more than policy.max_tokens_per_microbatch={max_tokens}; "
                "raise the budget or lower generation.max_new_tokens / data.max_prompt_tokens")
    singles = [[i] for i in range(len(batch))]
    if not shared or batch.group_ids is None:
        return singles
    if len(batch.group_ids) != len(batch):
        raise ValueError(f"batch has {len(batch)} sequences but {len(batch.group_ids)} group ids")
    groups: dict = {}
    for i, g in enumerate(batch.group_ids):
        groups.setdefault(g, []).append(i)
    units = []
    for members in groups.values():
        if len(members) > 1 and _same_prompt(batch, members) and unit_length(batch, members, multiple) <= max_tokens:
            units.append(members)
        else:
            units += [[i] for i in members]
    if len(units) < dp_size:
        return singles
    return sorted(units, key=lambda u: u[0])


def plan_microbatches(batch: RolloutBatch, *, shared: bool, varlen: bool, max_tokens: int, dp_size: int,
                      dp_rank: int, multiple: int = 1, equal_counts: bool = False) -> list[list[list[int]]]:
    """The plan of one training call on one DP rank: its micro-batches, each a list of units (a unit: the batch
    indices of one sequence, or of a group sharing its prompt). Dense rows cost rows x longest row, a varlen row
    the sum of its units' padded lengths (`policy/microbatch.py`). Every rank computes the same plan. With
    `equal_counts` every DP rank gets the same number of micro-batches, the short ones padded with empty ones (no
    units, at the end)."""
    m = multiple if varlen else 0
    units = plan_units(batch, shared=shared, max_tokens=max_tokens, dp_size=dp_size, multiple=m)
    lengths = [unit_length(batch, u, m) for u in units]
    mbs = plan(lengths, dp_size, dp_rank, max_tokens, packed=varlen, equal_counts=equal_counts)
    return [[units[k] for k in mb.indices] for mb in mbs]
