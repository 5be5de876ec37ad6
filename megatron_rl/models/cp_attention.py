"""Core attention of a context-parallel packed row (`policy.cp`): this rank's queries against the whole row's keys.

Context parallelism splits every packed row over the CP group (`policy/context_parallel.py`: each segment in 2·CP
chunks, rank r holding chunks r and 2·CP-1-r, the causal load balance megatron-core uses). Everything in a layer but
attention is per token, so only attention needs other ranks' tokens: each layer all-gathers K and V over the CP
group (`gather_row`; its backward returns each rank the sum of every rank's gradient for its own keys), and this
rank's queries attend the whole row. For a query chunk at columns [a, a + c) of a segment starting at s that is up
to three standard attention calls, merged exactly by log-sum-exp (as in `varlen_attention._merge`):

    its own chunk, causal          keys [a, a + c)
    the segment before it, full    keys [s, a)                (a > s)
    its cascade prefix, full       keys [p, p + n_p)          (a group's completion: the group's prompt)

The backward is exact the same way: each call's standard backward, given the merged output and lse, gives its
share of dQ and its exact dK, dV (ring attention's identity). The per-call kernels are `varlen_attention`'s: torch's
fused flash kernel on CPU, the memory-efficient one on CUDA. The all-gather costs a [row, kv heads, head dim] K and V
per layer (what the planner counts); ring attention would overlap that traffic with compute on GPUs and is a later
step. transformer-engine's own CP attention is not used: it needs megatron-core's CP groups and data layout, which
megatron-rl does not set up (module doc of `policy/context_parallel.py`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core.packed_seq_params import PackedSeqParams

from megatron_rl.models.varlen_attention import _part_backward, _part_forward


@dataclass
class ContextParallelSeqParams(PackedSeqParams):
    """This rank's share of a packed row as megatron sees it: one THD segment of the local tokens (`cu_seqlens_q` =
    [0, t_local], so megatron's THD RoPE applies one angle per token: `policy/model_hooks.py` gives the tokens' own
    positions), plus what the attention needs: the all-gather layout and this rank's attention calls."""

    per_token_positions = True  # class attribute, not a field: model_hooks.install_position_rope reads it
    order: torch.Tensor = None  # [t]: row column of each all-gathered token (every rank's columns, rank after rank)
    parts: tuple = ()  # (q start, q len, k start, k len, causal): local query rows x row key columns
    group: object = None  # the CP process group


# ----------------------------------------------------------------------------------- the K/V all-gather

def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """[n, ...] on every rank -> [world * n, ...], ranks in group order."""
    x = x.contiguous()  # empty_like below must give dense buffers, not a view's strides
    out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(out, x, group=group)
    return torch.cat(out)


def _sum_to_owner(x: torch.Tensor, group) -> torch.Tensor:
    """[world * n, ...] on every rank -> [n, ...]: this rank's block summed over the group."""
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    n = x.shape[0] // world
    if dist.get_backend(group) == "gloo":  # gloo has no reduce-scatter: sum the whole and keep this rank's block
        x = x.contiguous()
        dist.all_reduce(x, group=group)
        return x[rank * n:(rank + 1) * n]
    # NCCL (GPU only, no CPU test reaches it: gloo above is the same sum): reduce-scatter moves 1/world of it
    out = x.new_empty((n, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class _GatherRow(torch.autograd.Function):
    """[t_local, ...] -> [t, ...] in row order: every rank's tokens, placed at their columns (`order`)."""

    @staticmethod
    def forward(ctx, x, order, group):
        ctx.order, ctx.group = order, group
        gathered = _all_gather(x, group)
        out = torch.empty_like(gathered)
        out[order] = gathered
        return out

    @staticmethod
    def backward(ctx, grad):
        return _sum_to_owner(grad[ctx.order], ctx.group), None, None


def gather_row(x: torch.Tensor, params: ContextParallelSeqParams) -> torch.Tensor:
    return _GatherRow.apply(x, params.order.to(x.device), params.group)


# --------------------------------------------------------------------------- attention of the local queries

class _LocalQueries(torch.autograd.Function):
    """Local queries [tl, h, d] x the whole row's keys and values [t, h, d] -> [tl, h * d], by `parts` (module doc).
    Outputs accumulate in fp32 at least; every local row has its own causal chunk, so every row has a finite lse."""

    @staticmethod
    def forward(ctx, query, key, value, parts, scale):
        tl, h, d = query.shape
        acc = torch.promote_types(query.dtype, torch.float32)
        q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))  # [1, h, *, d] views
        out = query.new_zeros((1, h, tl, d), dtype=acc)
        lse = query.new_full((1, h, tl), float("-inf"), dtype=acc)
        rngs = []
        for qs, qn, ks, kn, causal in parts:
            o, l_part, rng = _part_forward(q[:, :, qs:qs + qn], k[:, :, ks:ks + kn], v[:, :, ks:ks + kn], causal,
                                           scale)
            rngs.append(rng)
            old = lse[:, :, qs:qs + qn]
            new = torch.logaddexp(old, l_part.to(acc))
            out[:, :, qs:qs + qn] = (torch.exp(old - new)[..., None] * out[:, :, qs:qs + qn]
                                     + torch.exp(l_part - new)[..., None] * o.to(acc))
            lse[:, :, qs:qs + qn] = new
        # saved as [tl, h * d] rows, as varlen_attention's row: the CUDA backward needs dense rows of h * d
        rows = out[0].transpose(0, 1).to(query.dtype).contiguous().view(tl, h * d)
        ctx.save_for_backward(query, key, value, rows, lse)
        ctx.parts, ctx.scale, ctx.rngs = parts, scale, rngs
        return rows

    @staticmethod
    def backward(ctx, dout):
        query, key, value, rows, lse = ctx.saved_tensors
        tl, h, d = query.shape
        acc = torch.promote_types(query.dtype, torch.float32)
        q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))
        out, do = (x.view(tl, h, d).transpose(0, 1)[None] for x in (rows, dout.contiguous()))
        dq = torch.zeros((1, h, tl, d), dtype=acc, device=query.device)
        dk = torch.zeros((1, h, key.shape[0], d), dtype=acc, device=query.device)
        dv = torch.zeros_like(dk)
        for (qs, qn, ks, kn, causal), rng in zip(ctx.parts, ctx.rngs):
            a, b, c = _part_backward(do[:, :, qs:qs + qn], q[:, :, qs:qs + qn], k[:, :, ks:ks + kn],
                                     v[:, :, ks:ks + kn], out[:, :, qs:qs + qn], lse[:, :, qs:qs + qn], causal,
                                     ctx.scale, rng)
            dq[:, :, qs:qs + qn] += a
            dk[:, :, ks:ks + kn] += b
            dv[:, :, ks:ks + kn] += c
        return (*(g[0].transpose(0, 1).to(x.dtype) for g, x in ((dq, query), (dk, key), (dv, value))), None, None)


def cp_attention(query, key, value, params: ContextParallelSeqParams, scale: float) -> torch.Tensor:
    """query [tl, hq, d], key/value [tl, hk, d] of this rank's tokens -> [tl, hq * d]."""
    key, value = gather_row(key, params), gather_row(value, params)
    hq = query.shape[1]
    if key.shape[1] != hq:  # grouped-query attention, after the gather (fewer heads travel)
        key = key.repeat_interleave(hq // key.shape[1], dim=1)
        value = value.repeat_interleave(hq // value.shape[1], dim=1)
    return _LocalQueries.apply(query, key, value, params.parts, scale)
