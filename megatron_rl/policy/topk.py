"""Top-k distillation's two vocabulary-parallel pieces, from the last pipeline stage's output (hidden states after a
fused head, else this rank's shard of the logits; `forward_pass.ForwardPass._token_stats` reads the same):

- `vocab_topk` (the teacher, no gradient): the k most likely ids per position over the whole vocabulary and their
  logprobs, normalised over the whole vocabulary. At TP > 1 each rank holds a slice of the vocabulary: the
  log-normaliser is reduced over the TP group (max, then sum of exponentials), each rank's own top-k are gathered
  and the top-k of their union kept.
- `logprobs_at` (the student, differentiable): log pi(v) for given ids v per position, as the sampled token's
  logprob (the kernel's, with its gradient) plus (z_v - z_target) / T; the logits z_v are computed only for those ids
  (k + 1 rows of the output layer's weight per position with the fused head), each on the rank whose shard holds it,
  and summed over TP (megatron's reduce-from-TP region: all-reduce forward, identity backward); the hidden state
  enters through megatron's copy-to-TP region (identity forward, all-reduce backward), as each rank's partial
  gradient of it must be summed. The FSDP2 backend has no megatron parallel state: it passes its DTensor mesh's TP
  group, and the same two regions come from policy/fsdp2_tp.py over that group.
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


def logprobs_at(flat_output: torch.Tensor, head, ids: torch.Tensor, targets: torch.Tensor,
                target_logprobs: torch.Tensor, temperature: float, tp_size: int = 1, vocab_start: int = 0,
                tp_group=None):
    """log pi(ids) [n, k] at n flat response positions (module doc): `flat_output` [n, h] hidden states (fused head:
    `head.weight` this rank's vocabulary rows from id `head.vocab_start`) or [n, V_local] logits, `targets` [n] the
    sampled ids, `target_logprobs` [n] their (differentiable) logprobs. `tp_group`: None is megatron's TP group."""
    if tp_group is None:
        from megatron.core.tensor_parallel.mappings import (copy_to_tensor_model_parallel_region as copy_in,
                                                            reduce_from_tensor_model_parallel_region as reduce_out)
    else:
        from megatron_rl.policy.fsdp2_tp import copy_to_tp, reduce_from_tp

        def copy_in(x):
            return copy_to_tp(x, tp_group)

        def reduce_out(x):
            return reduce_from_tp(x, tp_group)

    dev = flat_output.device
    every = torch.cat([targets.reshape(-1, 1).to(dev), ids.to(dev)], dim=1)
    fused = head is not None and head.weight is not None
    start, n_local = (head.vocab_start, head.weight.shape[0]) if fused else (vocab_start, flat_output.shape[-1])
    local = every - start
    inside = (local >= 0) & (local < n_local)
    local = local.clamp(0, n_local - 1)
    if fused:
        h = copy_in(flat_output) if tp_size > 1 else flat_output
        z = (h.float()[:, None, :] * head.weight[local].float()).sum(-1)  # only the k + 1 rows per position
    else:
        z = flat_output.float().gather(-1, local)
    z = torch.where(inside, z, torch.zeros_like(z))
    if tp_size > 1:
        z = reduce_out(z)
    z = z / temperature
    return target_logprobs.reshape(-1, 1).float() + (z[:, 1:] - z[:, :1])
