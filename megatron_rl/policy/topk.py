"""The vocabulary-parallel pieces of top-k distillation and filtered-sampling logprobs, from the last pipeline
stage's output (hidden states after a fused head, else this rank's shard of the logits;
`forward_pass.ForwardPass._token_stats` reads the same):

- `vocab_topk` (no gradient): the k most likely ids per position over the whole vocabulary and their logprobs,
  normalised over the whole vocabulary (the distillation teacher's; the kept set of `sampling_filter.py`). At TP > 1
  each rank holds a slice of the vocabulary: the log-normaliser is reduced over the TP group (max, then sum of
  exponentials), each rank's own top-k are gathered and the top-k of their union kept.
- `logits_at` (differentiable): the logits z_v / T for given ids v per position, computed only for those ids (their
  rows of the output layer's weight with the fused head, a few positions at a time and gathered again in the
  backward pass rather than kept: `_RowLogits`), each on the rank whose shard holds it, and summed over TP (the
  reduce-from-TP region: all-reduce forward, identity backward); the hidden state enters through the copy-to-TP
  region (identity forward, all-reduce backward), as each rank's partial gradient of it must be summed. Both regions
  come from policy/fsdp2_tp.py over the group given: megatron's TP group, or the FSDP2 backend's DTensor mesh's.
- `logprobs_at` (the distillation student, differentiable): log pi(v) as the sampled token's logprob (the kernel's,
  with its gradient) plus (z_v - z_target) / T from `logits_at`.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.buffers import VOCAB_BLOCK  # the block's size and why: buffers.py


def _logit_blocks(output: torch.Tensor, head, vocab_start: int, temperature: float, block: int):
    """(logits / T in fp32 for a block of this rank's vocabulary columns, the first id they cover), block by block."""
    fused = head is not None and head.weight is not None
    start, n = (head.vocab_start, head.weight.shape[0]) if fused else (vocab_start, output.shape[-1])
    x = output.float() if fused else None
    for c in range(0, n, block):
        if fused:
            z = x @ head.weight[c:c + block].float().t()
        else:
            z = output[..., c:c + block].float()
        yield z / temperature, start + c


@torch.no_grad()
def vocab_topk(output: torch.Tensor, head, k: int, temperature: float, tp_group=None, vocab_start: int = 0,
               block: int = VOCAB_BLOCK, scaled: bool = False):
    """(ids [..., k] long, logprobs [..., k] fp32) of the k most likely ids at each position (module doc), scored
    `block` vocabulary columns at a time: a running max and sum of exponentials make the log-normaliser (rescaled
    when the max grows), and each block's top-k is merged into a running top-k. `scaled`: (ids, logits / T of them,
    the log-normaliser [..., 1]) instead, the values exactly as each block computed them (policy/sampling_filter.py
    compares them with the same blocks recomputed)."""
    m = s = vals = ids = None
    for z, start in _logit_blocks(output, head, vocab_start, temperature, block):
        bm = z.max(-1, keepdim=True).values
        if m is None:
            m, s = bm, torch.exp(z - bm).sum(-1, keepdim=True)
        else:
            new = torch.maximum(m, bm)
            s = s * torch.exp(m - new) + torch.exp(z - new).sum(-1, keepdim=True)
            m = new
        bv, bi = z.topk(min(k, z.shape[-1]), dim=-1)
        bi = bi + start
        if vals is not None:
            bv, bi = torch.cat([vals, bv], -1), torch.cat([ids, bi], -1)
            best = bv.topk(min(k, bv.shape[-1]), dim=-1)
            bv, bi = best.values, bi.gather(-1, best.indices)
        vals, ids = bv, bi
    if tp_group is not None:  # the normaliser over the whole vocabulary: max, then the rescaled sums
        g = m.clone()
        dist.all_reduce(g, op=dist.ReduceOp.MAX, group=tp_group)
        s = s * torch.exp(m - g)
        dist.all_reduce(s, group=tp_group)
        m = g
    lse = m + torch.log(s)
    if tp_group is not None:
        world = dist.get_world_size(tp_group)
        all_vals = [torch.empty_like(vals) for _ in range(world)]
        all_ids = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(all_vals, vals.contiguous(), group=tp_group)
        dist.all_gather(all_ids, ids.contiguous(), group=tp_group)
        vals, ids = torch.cat(all_vals, -1), torch.cat(all_ids, -1)
        best = vals.topk(k, dim=-1)
        vals, ids = best.values, ids.gather(-1, best.indices)
    return (ids, vals, lse) if scaled else (ids, vals - lse)


_ROWS_BUDGET = 1 << 24  # gathered weight elements per chunk of positions (64 MB in fp32)


class _RowLogits(torch.autograd.Function):
    """x [n, h] . weight[rows] -> [n, m] for row indices `rows` [n, m] of this rank's weight (masked where
    `inside` is False), a chunk of positions at a time; the backward pass gathers the rows again instead of keeping
    [n, m, h] of them."""

    @staticmethod
    def forward(ctx, x, weight, rows, inside):
        out = torch.zeros(rows.shape, dtype=torch.float32, device=x.device)
        step = max(1, _ROWS_BUDGET // max(1, rows.shape[1] * x.shape[1]))
        for a in range(0, x.shape[0], step):
            w = weight[rows[a:a + step]].float()  # [c, m, h]
            out[a:a + step] = torch.bmm(w, x[a:a + step].float()[:, :, None])[..., 0]
        ctx.save_for_backward(x, weight, rows, inside)
        return torch.where(inside, out, torch.zeros_like(out))

    @staticmethod
    def backward(ctx, g):
        x, weight, rows, inside = ctx.saved_tensors
        g = torch.where(inside, g.float(), torch.zeros_like(g, dtype=torch.float32))
        grad_x = torch.zeros_like(x, dtype=torch.float32)
        grad_w = torch.zeros_like(weight, dtype=torch.float32)
        step = max(1, _ROWS_BUDGET // max(1, rows.shape[1] * x.shape[1]))
        for a in range(0, x.shape[0], step):
            r, gc, xc = rows[a:a + step], g[a:a + step], x[a:a + step].float()
            grad_x[a:a + step] = torch.bmm(gc[:, None, :], weight[r].float())[:, 0]
            grad_w.index_add_(0, r.reshape(-1), (gc[:, :, None] * xc[:, None, :]).reshape(-1, x.shape[1]))
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None, None


def logits_at(output, head, ids, temperature: float, tp_group=None, vocab_start: int = 0):
    """z / T [n, m] at global `ids` [n, m] of flat `output` (hidden states [n, h] with a fused `head`, else [n,
    V_local] logits from `vocab_start`), differentiable, whichever rank's shard holds each id: at TP > 1 each rank
    computes the ids of its vocabulary shard and the values are summed over `tp_group` (the reduce-from-TP region),
    the hidden state entering through the copy-to-TP region."""
    if tp_group is not None:
        from megatron_rl.policy.fsdp2_tp import copy_to_tp, reduce_from_tp
    fused = head is not None and head.weight is not None
    start, n_local = (head.vocab_start, head.weight.shape[0]) if fused else (vocab_start, output.shape[-1])
    local = ids - start
    inside = (local >= 0) & (local < n_local)
    local = local.clamp(0, n_local - 1)
    if fused:
        x = copy_to_tp(output, tp_group) if tp_group is not None else output
        z = _RowLogits.apply(x, head.weight, local, inside)
    else:
        z = output.gather(-1, local).float()  # the k + 1 columns only, not an fp32 copy of the logits
        z = torch.where(inside, z, torch.zeros_like(z))
    if tp_group is not None:
        z = reduce_from_tp(z, tp_group)
    return z / temperature


def logprobs_at(flat_output: torch.Tensor, head, ids: torch.Tensor, targets: torch.Tensor,
                target_logprobs: torch.Tensor, temperature: float, tp_size: int = 1, vocab_start: int = 0,
                tp_group=None):
    """log pi(ids) [n, k] at n flat response positions (module doc): `flat_output` [n, h] hidden states (fused head:
    `head.weight` this rank's vocabulary rows from id `head.vocab_start`) or [n, V_local] logits, `targets` [n] the
    sampled ids, `target_logprobs` [n] their (differentiable) logprobs. `tp_group`: None is megatron's TP group."""
    if tp_size > 1 and tp_group is None:
        from megatron.core import parallel_state as ps

        tp_group = ps.get_tensor_model_parallel_group()
    every = torch.cat([targets.reshape(-1, 1).to(flat_output.device), ids.to(flat_output.device)], dim=1)
    z = logits_at(flat_output, head, every, temperature, tp_group if tp_size > 1 else None, vocab_start)
    return target_logprobs.reshape(-1, 1).float() + (z[:, 1:] - z[:, :1])
