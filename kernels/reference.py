"""Naive plain-torch references — for tests only (they materialise fp32 [tokens, V] tensors on purpose).

TP is handled the obvious way: all-gather the vocab shards into full logits on every rank and compute there.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


class _GatherVocab(torch.autograd.Function):
    """All-gather equal vocab shards along the last dim. Every rank then computes the same (replicated) loss, so
    the gradient of this rank's shard is just its own slice of the full gradient — no reduction in backward."""

    @staticmethod
    def forward(ctx, x, group):
        world = dist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x.contiguous(), group=group)  # logit shards: already on the TP group's device
        ctx.rank, ctx.v = dist.get_rank(group), x.shape[-1]
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, g):
        return g[..., ctx.rank * ctx.v:(ctx.rank + 1) * ctx.v], None


def full_logits(logits, tp_group=None):
    if tp_group is None or dist.get_world_size(tp_group) == 1:
        return logits
    return _GatherVocab.apply(logits, tp_group)


def _log_softmax(logits, tp_group, temperature):
    z = full_logits(logits, tp_group).float() / temperature
    return torch.log_softmax(z, dim=-1)


def ref_token_logprobs(logits, targets, *, tp_group=None, temperature=1.0):
    """log_softmax + gather; negative targets (ignore index) give 0 and no gradient."""
    logp = _log_softmax(logits, tp_group, temperature)
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.where(targets < 0, torch.zeros_like(picked), picked)


def ref_token_entropy(logits, *, tp_group=None, temperature=1.0):
    """-sum p log p. Entries with p = 0 (-inf logits) are replaced by 0 * 0: p * log p there is 0 * -inf = NaN
    in forward, and masking the log (not the product) also keeps NaN out of the backward."""
    logp = _log_softmax(logits, tp_group, temperature)
    safe = torch.where(torch.isneginf(logp), torch.zeros_like(logp), logp)
    return -(logp.exp() * safe).sum(-1)


def ref_linear_token_logprobs(hidden, weight, targets, *, tp_group=None, temperature=1.0):
    """Full logits = hidden @ weight.T in the inputs' dtype, then ref_token_logprobs."""
    return ref_token_logprobs(hidden @ weight.t(), targets, tp_group=tp_group, temperature=temperature)
