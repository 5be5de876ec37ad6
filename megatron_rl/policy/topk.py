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


def _local_logits(output: torch.Tensor, head, vocab_start: int, temperature: float):
    """(this rank's logits / T in fp32, the first vocabulary id they cover)."""
    if head is not None and head.weight is not None:
        return (output.float() @ head.weight.float().t()) / temperature, head.vocab_start
    return output.float() / temperature, vocab_start


@torch.no_grad()
def vocab_topk(output: torch.Tensor, head, k: int, temperature: float, tp_group=None, vocab_start: int = 0):
    """(ids [..., k] long, logprobs [..., k] fp32) of the k most likely ids at each position (module doc)."""
    z, start = _local_logits(output, head, vocab_start, temperature)
    m = z.max(-1, keepdim=True).values
    if tp_group is not None:
        dist.all_reduce(m, op=dist.ReduceOp.MAX, group=tp_group)
    s = torch.exp(z - m).sum(-1, keepdim=True)
    if tp_group is not None:
        dist.all_reduce(s, group=tp_group)
    lse = m + torch.log(s)
    vals, ids = z.topk(min(k, z.shape[-1]), dim=-1)
    ids = ids + start
    if tp_group is not None:
        world = dist.get_world_size(tp_group)
        all_vals = [torch.empty_like(vals) for _ in range(world)]
        all_ids = [torch.empty_like(ids) for _ in range(world)]
        dist.all_gather(all_vals, vals.contiguous(), group=tp_group)
        dist.all_gather(all_ids, ids.contiguous(), group=tp_group)
        vals, ids = torch.cat(all_vals, -1), torch.cat(all_ids, -1)
        best = vals.topk(k, dim=-1)
        vals, ids = best.values, ids.gather(-1, best.indices)
    return ids, vals - lse


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
