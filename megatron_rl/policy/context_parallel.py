"""Context parallelism on the Megatron backend (`policy.cp`): one packed row split over CP ranks.

Layout. Every attention segment of a varlen row is padded to a multiple of 2·CP (`packing.segment_multiple`) and cut
into 2·CP equal chunks; rank r of the CP group holds chunks r and 2·CP-1-r of every segment (megatron-core's causal
load balance, `get_thd_batch_on_this_cp_rank`: a rank's early chunk attends little, its late one much). Its local
row is those chunks in row order, so a rank's columns increase along the row (`RowShare.cols`). The model runs on the
local row: embeddings, MLPs, norms and the lm_head per token, RoPE from each token's own position, attention over
the whole row (`models/cp_attention.py`: K/V all-gathered per layer).

Loss. Each rank computes the token statistics (logprobs, entropy, a value model's values) of its own response
positions; `gather_responses` assembles the whole row's on every CP rank (its backward hands each rank the gradient
of its own positions, no communication), so every loss and metric is computed as at CP = 1, by every algorithm,
unchanged. Each CP rank's backward then reaches the weights only through its own tokens; summed over the CP group
that is the whole gradient.

Process groups. megatron-core's own CP (`initialize_model_parallel(context_parallel_size=...)`) is not used: its
attention refuses CP without transformer-engine, which CPUs do not have. megatron-core is given the CP ranks as
data-parallel ranks instead, in its own order (tp-cp-dp-pp: CP varies fastest inside its data-parallel group). Its
gradient reduction then sums over DP x CP, which is what CP needs (megatron's DDP reduces over the same dp-cp group
when it runs CP itself), and the distributed optimizer shards over the same ranks. This module makes the CP groups
(consecutive blocks of each megatron data-parallel group) and tells the worker the true data-parallel size and rank,
which plan the micro-batches: the ranks of one CP group plan the same ones.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CPCoords:
    size: int
    rank: int  # in the CP group
    group: object  # the CP process group (None at CP = 1)
    dp_size: int  # data-parallel replicas (megatron's data-parallel size / CP)
    dp_rank: int


def init_cp(cp: int) -> CPCoords:
    """After megatron's `initialize_model_parallel` (given the CP ranks as data-parallel ones): this rank's CP group
    and true data-parallel coordinates. Every rank of the world calls it (group creation is collective)."""
    from megatron.core import parallel_state as ps

    mdp_size, mdp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    if cp == 1:
        return CPCoords(1, 0, None, mdp_size, mdp_rank)
    if mdp_size % cp:
        raise ValueError(f"policy.cp={cp} does not divide the {mdp_size} ranks left after policy.tp and policy.pp")
    mine = tuple(dist.get_process_group_ranks(ps.get_data_parallel_group()))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    blocks = sorted({g[i:i + cp] for g in set(every) for i in range(0, len(g), cp)})
    group = None
    for block in blocks:  # every rank creates every group, in one order
        g = dist.new_group(list(block))
        if dist.get_rank() in block:
            group = g
    return CPCoords(cp, mdp_rank % cp, group, mdp_size // cp, mdp_rank // cp)


# ------------------------------------------------------------------------------------------- the row split

@dataclass
class RowShare:
    """A CP rank's share of a packed row (`split_row`)."""
    cols: torch.Tensor  # [t_local] row columns this rank holds, increasing
    order: torch.Tensor  # [t] every rank's cols, rank after rank: the all-gathered layout
    parts: tuple  # this rank's attention calls (models/cp_attention.py)
    resp_local: torch.Tensor  # local positions that predict a response token (the lm_head's window)
    resp_at: list  # per rank: LongTensor of its response positions' indices in the row's response order
    rank: int
    group: object


def _segments(params, t: int) -> list[tuple[int, int, int, int]]:
    """(start, padded length, prefix start, prefix real length) of each segment of a packed row."""
    from megatron_rl.models.varlen_attention import segments_of

    starts, lengths, prefix_of = segments_of(params)
    ends = list(starts[1:]) + [t]
    return [(s, e - s, starts[p] if p >= 0 else 0, lengths[p] if p >= 0 else 0)
            for s, e, p in zip(starts, ends, prefix_of)]


def _rank_chunks(segs, cp: int, r: int):
    """(segment start, chunk start, chunk length, prefix start, prefix length) of rank r's chunks, in row order."""
    out = []
    for s, n, ps, pn in segs:
        if n % (2 * cp):
            raise ValueError(f"a packed segment of {n} tokens cannot be split into 2*policy.cp={2 * cp} chunks")
        c = n // (2 * cp)
        for j in sorted({r, 2 * cp - 1 - r}):
            out.append((s, s + j * c, c, ps, pn))
    return out


def split_row(params, resp_mask: torch.Tensor, cp: int, rank: int, group) -> RowShare:
    """This rank's share of a packed row [1, t]: `params` its PackedSeqParams (every segment padded to 2·CP),
    `resp_mask` [1, t] its response-predicting columns."""
    t = resp_mask.shape[1]
    segs = _segments(params, t)
    cols_of, parts = [], ()
    for r in range(cp):
        chunks = _rank_chunks(segs, cp, r)
        cols_of.append(torch.cat([torch.arange(a, a + c) for _, a, c, _, _ in chunks]))
        if r == rank:
            calls, at = [], 0
            for s, a, c, ps, pn in chunks:
                calls.append((at, c, a, c, True))  # its own chunk, causal
                if a > s:
                    calls.append((at, c, s, a - s, False))  # the segment before it
                if pn:
                    calls.append((at, c, ps, pn, False))  # a completion's prompt (cascade)
                at += c
            parts = tuple(calls)
    resp = resp_mask[0]
    index = torch.cumsum(resp.long(), 0) - 1  # a response column's place in the row's response order
    resp_at = [index[cols][resp[cols]] for cols in cols_of]
    mine = cols_of[rank]
    return RowShare(mine, torch.cat(cols_of), parts, resp[mine].nonzero()[:, 0], resp_at, rank, group)


def local_row(mb, share: RowShare):
    """The micro-batch's model inputs on this rank: (tokens, positions, ContextParallelSeqParams), [1, t_local]."""
    from megatron_rl.models.cp_attention import ContextParallelSeqParams

    n = int(share.cols.numel())
    cu = torch.tensor([0, n], dtype=torch.int32)
    params = ContextParallelSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=n,
                                      max_seqlen_kv=n, order=share.order, parts=share.parts, group=share.group)
    return mb.tokens[:, share.cols], mb.position_ids[:, share.cols], params


# ------------------------------------------------------------------------------- per-token outputs, whole row

class _GatherResponses(torch.autograd.Function):
    """[1, n_local, ...] of this rank's response positions -> [1, n, ...] of the row's, on every CP rank."""

    @staticmethod
    def forward(ctx, x, resp_at, rank, group):
        ctx.mine = resp_at[rank]
        width = max(int(i.numel()) for i in resp_at)
        pad = x.new_zeros((1, width, *x.shape[2:]))
        pad[:, :x.shape[1]] = x
        got = [torch.empty_like(pad) for _ in resp_at]
        dist.all_gather(got, pad.contiguous(), group=group)
        out = x.new_empty((1, sum(int(i.numel()) for i in resp_at), *x.shape[2:]))
        for g, at in zip(got, resp_at):
            out[:, at.to(x.device)] = g[:, :at.numel()]
        return out

    @staticmethod
    def backward(ctx, grad):
        # every CP rank computes the same loss from the whole row, so each takes its own positions' gradient
        return grad[:, ctx.mine.to(grad.device)], None, None, None


def gather_responses(x: torch.Tensor, share: RowShare) -> torch.Tensor:
    return _GatherResponses.apply(x, share.resp_at, share.rank, share.group)
