"""Token logprobs under the sampler's top-k / top-p filter, so that the trainer and the engine describe one
distribution.

With `generation.top_k` / `generation.top_p` set, vLLM samples each token from softmax(z / T) restricted to the kept
set K (the k largest logits, then the smallest prefix of them, by probability renormalised over those k, whose mass
reaches p) and returns that distribution's logprob (`logprobs_mode="processed_logprobs"`). The trainer's token
logprob log softmax(z / T)[y] describes another distribution: the importance ratio of an on-policy sample is then
pi_K(y) / pi(y) = 1 / (mass of K) instead of 1 (vLLM #42259 and NeMo-RL's mismatch reports). So the trainer applies
the same filter:

    log pi_K(y) = log pi(y) - log sum_{j in K} pi(j)

`log pi(y)` is what the logprob kernels already give (fused head or not, TP or not). The second term is computed
here in two passes over the vocabulary, a block of it at a time as the kernels do (no [tokens, vocab] tensor):

1. no gradient: the kept set's threshold per position, as a logit: the k (or `max_kept` for top-p alone) largest
   scaled logits (`topk.vocab_topk`, TP-aware), the top-p prefix of them, and the smallest kept value;
2. `_LogKeptMass`: log sum over {z_j / T >= threshold} of exp(z_j / T) minus the log-normaliser over the whole
   vocabulary, with its gradient (each block recomputed in the backward pass; at TP > 1 the sums are reduced over
   the group, and with a fused head the hidden state's gradient is summed over it, as the kernels do).

The sampled token is always counted as kept: the engine sampled it, so it was in the engine's K, even where the
trainer's logits put it a rounding error below the threshold. Ties at the threshold are kept with it. Top-p alone
looks at the `max_kept` most likely tokens: a position whose first `max_kept` tokens do not reach the mass p (a
nearly flat distribution) keeps those, and is counted (`filter_truncated` in the returned stats).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.buffers import VOCAB_BLOCK
from megatron_rl.policy.interface import TokenScoring, as_scoring  # noqa: F401  (re-exported for the workers)


@torch.no_grad()
def kept_thresholds(output, head, scoring: TokenScoring, tp_group=None, vocab_start: int = 0):
    """(threshold [n] as a scaled logit, number of positions whose top-p set was cut at `max_kept`) for flat
    `output` [n, h] (fused `head`) or [n, V_local] logits."""
    from megatron_rl.policy.topk import vocab_topk

    k = scoring.top_k if scoring.top_k > 0 else scoring.max_kept
    vocab = head.weight.shape[0] if head is not None and head.weight is not None else output.shape[-1]
    if tp_group is not None:
        vocab *= dist.get_world_size(tp_group)
    k = min(k, vocab)
    _, vals, lse = vocab_topk(output, head, k, scoring.temperature, tp_group, vocab_start, scaled=True)
    kept = k * torch.ones(vals.shape[0], dtype=torch.long, device=vals.device)
    truncated = 0
    if scoring.top_p < 1.0:
        probs = torch.exp(vals - lse)
        if scoring.top_k > 0:  # the sampler applies top-p to the probabilities renormalised over the top-k
            probs = probs / probs.sum(-1, keepdim=True)
        above = probs.cumsum(-1) - probs  # the mass of the tokens ranked above each one
        keep = above < scoring.top_p
        keep[:, 0] = True
        kept = keep.sum(-1)
        if scoring.top_k <= 0 and k < vocab:
            truncated = int(keep[:, -1].sum())
    return vals.gather(-1, (kept - 1)[:, None])[:, 0], truncated


def _blocks(x, weight, start: int, temperature: float, block: int):
    n = weight.shape[0] if weight is not None else x.shape[-1]
    xf = x.float() if weight is not None else None
    for c in range(0, n, block):
        z = xf @ weight[c:c + block].float().t() if weight is not None else x[:, c:c + block].float()
        yield c, z / temperature, start + c


def _merge(m, s, bm, bs):
    if m is None:
        return bm, bs
    new = torch.maximum(m, bm)
    return new, s * torch.exp(m - new) + bs * torch.exp(bm - new)


def _block_sums(z, keep):
    """(max, sum of exp(z - max)) over a block, all columns and kept columns; -inf max for none kept."""
    zk = torch.where(keep, z, torch.full_like(z, float("-inf")))
    m_all = z.max(-1).values
    m_k = zk.max(-1).values
    safe = torch.where(torch.isfinite(m_k), m_k, torch.zeros_like(m_k))
    return (m_all, torch.exp(z - m_all[:, None]).sum(-1)), (m_k, torch.exp(zk - safe[:, None]).sum(-1))


class _LogKeptMass(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, targets, threshold, temperature, start, block, tp_group):
        acc_all = acc_k = (None, None)
        for _, z, first in _blocks(x, weight, start, temperature, block):
            cols = torch.arange(first, first + z.shape[-1], device=z.device)
            keep = (z >= threshold[:, None]) | (cols[None, :] == targets[:, None])
            (ma, sa), (mk, sk) = _block_sums(z, keep)
            acc_all = _merge(*acc_all, ma, sa)
            acc_k = _merge(*acc_k, torch.where(torch.isfinite(mk), mk, torch.full_like(mk, -1e30)), sk)
        lse_all, lse_k = (_reduce_lse(*acc, tp_group) for acc in (acc_all, acc_k))
        ctx.save_for_backward(x, weight if weight is not None else torch.empty(0), targets, threshold, lse_all, lse_k)
        ctx.fused, ctx.temperature, ctx.start, ctx.block, ctx.tp_group = (weight is not None, temperature, start,
                                                                          block, tp_group)
        return lse_k - lse_all

    @staticmethod
    def backward(ctx, g):
        x, weight, targets, threshold, lse_all, lse_k = ctx.saved_tensors
        weight = weight if ctx.fused else None
        grad_x = torch.zeros_like(x, dtype=torch.float32)
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if weight is not None else None
        g = g.float()
        for c, z, first in _blocks(x, weight, ctx.start, ctx.temperature, ctx.block):
            cols = torch.arange(first, first + z.shape[-1], device=z.device)
            keep = (z >= threshold[:, None]) | (cols[None, :] == targets[:, None])
            # d(lse_K - lse_all)/dz_j = (pi_K(j) - pi(j)) / T, pi_K zero outside K
            dz = torch.where(keep, torch.exp(z - lse_k[:, None]), torch.zeros_like(z)) - torch.exp(z - lse_all[:, None])
            dz = dz * (g[:, None] / ctx.temperature)
            if weight is not None:
                wb = weight[c:c + ctx.block].float()
                grad_x += dz @ wb
                grad_w[c:c + ctx.block] = dz.t() @ x.float()
            else:
                grad_x[:, c:c + ctx.block] = dz
        if weight is not None and ctx.tp_group is not None:
            dist.all_reduce(grad_x, group=ctx.tp_group)  # every rank's vocabulary shard contributes to the hidden's
        return (grad_x.to(x.dtype), grad_w.to(weight.dtype) if grad_w is not None else None,
                None, None, None, None, None, None)


def _reduce_lse(m, s, tp_group):
    if tp_group is not None:
        g = m.clone()
        dist.all_reduce(g, op=dist.ReduceOp.MAX, group=tp_group)
        s = s * torch.exp(m - g)
        dist.all_reduce(s, group=tp_group)
        m = g
    return m + torch.log(s)


def log_kept_mass(output, head, targets, scoring: TokenScoring, tp_group=None, vocab_start: int = 0,
                  block: int = VOCAB_BLOCK):
    """(log sum_{j in K} pi(j) [n], differentiable; positions cut at max_kept) at flat positions: `output` [n, h]
    hidden states with a fused `head` (its `weight`, this rank's vocabulary rows from `head.vocab_start`), else [n,
    V_local] logits from `vocab_start`; `targets` [n] the sampled ids."""
    fused = head is not None and head.weight is not None
    start = head.vocab_start if fused else vocab_start
    threshold, truncated = kept_thresholds(output.detach(), head, scoring, tp_group, vocab_start)
    mass = _LogKeptMass.apply(output, head.weight if fused else None, targets.to(output.device), threshold,
                              float(scoring.temperature), int(start), int(block), tp_group)
    return mass, truncated


def filter_logprobs(lp, output, head, targets, scoring, tp_group=None, vocab_start: int = 0):
    """The kernels' token logprobs `lp` [...] turned into the filtered distribution's when `scoring` filters (else
    `lp` itself): `output` [..., h] hidden states with a fused `head`, else [..., V_local] logits."""
    scoring = as_scoring(scoring)
    if not scoring.filtered:
        return lp
    mass, _ = log_kept_mass(output.reshape(-1, output.shape[-1]), head, targets.reshape(-1), scoring, tp_group,
                            vocab_start)
    return lp - mass.view(lp.shape).to(lp.dtype)
