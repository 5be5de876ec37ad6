"""The plan of a training call: which sequences go together (`plan_microbatches`). It reads only lengths and prompt
tokens and returns `Unit`s; `policy/batching.py` then turns each planned micro-batch into tensors. The worker calls
this module once per call and batching once per micro-batch; neither calls back.

A unit is what one row (or one stretch of a packed row) holds: one sequence, or a GRPO group of G completions
sharing its prompt (group-shared prefix packing, laid out in `batching.row_layout`). A group's row is

    P[0 : p-1]  |  P[p-1] R_1[0 : r_1-1]  |  P[p-1] R_2[0 : r_2-1]  |  ...      (length (p-1) + sum_j r_j)
    shared         segment 1 (r_1 tokens)    segment 2 (r_2 tokens)

so the shared part is computed once per group and every response token keeps its own row position; a single sequence
of length L is L - 1 tokens. Which micro-batch each unit goes to is bin packing by length, balanced over DP ranks
(`policy/microbatch.py`).

Varlen (`policy.packing: varlen`): the units of a micro-batch share one packed THD row, each split into attention
segments (`Unit.segments`): a single sequence is one causal segment; a group is its shared part P[0 : p-1] (causal)
plus one segment per completion that attends its own keys causally and the shared part's in full (cascade attention,
`models/varlen_attention.py`). Each segment is padded to `segment_multiple` tokens, and the unit's length counts that
padding, so the plan's budget is what the row will hold.
"""
from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.policy.interface import RolloutBatch
from megatron_rl.policy.microbatch import SequenceTooLongError, plan


@dataclass(frozen=True)
class Unit:
    members: tuple[int, ...]  # batch indices: one sequence, or a group sharing its first `prompt_len` tokens
    prompt_len: int
    segments: tuple[int, ...]  # varlen attention segments' real lengths, in row order (sum: the unit's row tokens)
    prefix_of: tuple[int, ...]  # per segment: -1, or the index (within the unit) of the segment it attends in full
    length: int  # row tokens the plan counts: sum(segments), each padded to the multiple in varlen rows


def segment_multiple(tp: int, cp: int = 1, sequence_parallel: bool = False) -> int:
    """Megatron's length requirement on each packed segment: context parallelism splits every sequence into 2*cp
    load-balanced chunks (times tp when the sequence dimension is also split over TP); sequence parallelism alone
    needs the row divisible by tp, which padding every segment to tp gives."""
    if cp > 1:
        return 2 * cp * (tp if sequence_parallel else 1)
    return tp if sequence_parallel else 1


def resolve_mode(packing: str, platform_default: str, cp: int = 1) -> str:
    """`policy.packing` as the worker runs it: auto is the platform's default (varlen on GPU, none on CPU), and
    varlen wherever context parallelism splits rows (it needs them)."""
    if packing != "auto":
        return packing
    return "varlen" if cp > 1 else platform_default


def padded(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple if multiple > 1 else n


def make_unit(batch: RolloutBatch, members: list[int], multiple: int = 0) -> Unit:
    """The unit of `members` (one sequence, or a group with identical prompts). `multiple` > 0: a varlen row's
    segment padding, counted in `length`. An empty shared part (a one-token prompt) is no segment."""
    p = batch.prompt_lens[members[0]]
    resp = [len(batch.input_ids[i]) - p for i in members]
    if len(members) == 1:  # prompt and response are one causal segment
        segments, prefix_of = (p - 1 + resp[0],), (-1,)
    else:
        head = (p - 1,) if p > 1 else ()
        segments = head + tuple(resp)
        prefix_of = (-1,) * len(head) + ((0 if head else -1),) * len(resp)
    return Unit(tuple(members), p, segments, prefix_of, sum(padded(n, multiple) for n in segments))


def _same_prompt(batch: RolloutBatch, members: list[int]) -> bool:
    p = batch.prompt_lens[members[0]]
    first = batch.input_ids[members[0]][:p]
    return all(batch.prompt_lens[i] == p and batch.input_ids[i][:p] == first for i in members[1:])


def plan_units(batch: RolloutBatch, *, shared: bool, max_tokens: int, dp_size: int = 1,
               multiple: int = 0) -> list[Unit]:
    """The units to feed: one per packable group, one per other sequence. Every rank computes the same plan.

    A group is packed when it has >= 2 members with identical prompt tokens and its row fits `max_tokens`; otherwise
    its sequences are fed unshared. If packing would leave fewer units than data-parallel ranks, the whole batch is
    fed unshared (every DP rank needs work). Units are listed by their first member's batch position.
    """
    singles = [make_unit(batch, [i], multiple) for i in range(len(batch))]
    for i, u in enumerate(singles):
        if u.length > max_tokens:
            raise SequenceTooLongError(
                f"sequence {i} has {u.length} tokens, more than policy.max_tokens_per_microbatch={max_tokens}; "
                "raise the budget or lower generation.max_new_tokens / data.max_prompt_tokens")
    if not shared or batch.group_ids is None:
        return singles
    if len(batch.group_ids) != len(batch):
        raise ValueError(f"batch has {len(batch)} sequences but {len(batch.group_ids)} group ids")
    groups: dict = {}
    for i, g in enumerate(batch.group_ids):
        groups.setdefault(g, []).append(i)
    units = []
    for members in groups.values():
        group = make_unit(batch, members, multiple) if len(members) > 1 and _same_prompt(batch, members) else None
        units += [group] if group is not None and group.length <= max_tokens else [singles[i] for i in members]
    if len(units) < dp_size:
        return singles
    return sorted(units, key=lambda u: u.members[0])


def plan_microbatches(batch: RolloutBatch, *, shared: bool, varlen: bool, max_tokens: int, dp_size: int,
                      dp_rank: int, multiple: int = 1, equal_counts: bool = False) -> list[list[Unit]]:
    """The plan of one training call on one DP rank: its micro-batches, each a list of units. Dense rows cost rows x
    longest row, a varlen row the sum of its units' padded lengths (`policy/microbatch.py`). Every rank computes the
    same plan. With `equal_counts` every DP rank gets the same number of micro-batches, the short ones padded with
    empty ones (no units, at the end)."""
    units = plan_units(batch, shared=shared, max_tokens=max_tokens, dp_size=dp_size,
                       multiple=multiple if varlen else 0)
    if batch.keep_groups and batch.group_ids is not None:
        return _plan_bundles(batch, units, varlen=varlen, max_tokens=max_tokens, dp_size=dp_size, dp_rank=dp_rank,
                             equal_counts=equal_counts)
    mbs = plan([u.length for u in units], dp_size, dp_rank, max_tokens, packed=varlen, equal_counts=equal_counts)
    return [[units[k] for k in mb.indices] for mb in mbs]


def plan_split_rows(batch: RolloutBatch, *, max_tokens: int, ranks: int, key: str, **kw) -> list[list[Unit]]:
    """`plan_microbatches` for rows split over `ranks` ranks (`key`: policy.cp or policy.sp): the budget
    (policy.max_tokens_per_microbatch) is what one rank holds, so a row may hold `ranks` times it."""
    try:
        return plan_microbatches(batch, max_tokens=max_tokens * ranks, **kw)
    except SequenceTooLongError as e:
        if ranks == 1:
            raise
        said = f"policy.max_tokens_per_microbatch={max_tokens * ranks}"
        raise SequenceTooLongError(str(e).replace(said, f"{key}={ranks} x policy.max_tokens_per_microbatch="
                                                       f"{max_tokens}")) from None


def _plan_bundles(batch: RolloutBatch, units: list[Unit], *, varlen: bool, max_tokens: int, dp_size: int,
                  dp_rank: int, equal_counts: bool) -> list[list[Unit]]:
    """`keep_groups`: the units of one group (its packed row, or its sequences when it is not packed) form one
    bundle that the plan places whole, so a loss over the group (DPO's pair) sees all of it in one micro-batch.
    A bundle costs its total length packed; dense, it is planned as one row of rows x longest row, which is what
    its rows cost in a padded bin when bundles have equal row counts (DPO: a packed pair is one row, an unpacked one
    two, so all bundles of a batch agree unless some pairs are too long to pack)."""
    bundles: dict = {}
    for u in units:
        bundles.setdefault(batch.group_ids[u.members[0]], []).append(u)
    members = list(bundles.values())
    if len(members) < dp_size:
        raise ValueError(f"batch of {len(members)} groups cannot feed {dp_size} data-parallel ranks (a group's "
                         "sequences stay together)")
    cost = [sum(u.length for u in b) if varlen else len(b) * max(u.length for u in b) for b in members]
    for b, c in zip(members, cost):
        if c > max_tokens:
            raise SequenceTooLongError(
                f"group of sequences {[i for u in b for i in u.members]} needs {c} tokens in one micro-batch, more "
                f"than policy.max_tokens_per_microbatch={max_tokens}; raise the budget")
    mbs = plan(cost, dp_size, dp_rank, max_tokens, packed=varlen, equal_counts=equal_counts)
    return [[u for k in mb.indices for u in members[k]] for mb in mbs]
