"""Token logprobs under the sampler's top-k / top-p filter, so that the trainer and the engine describe one
distribution.

With `generation.top_k` / `generation.top_p` set, vLLM samples each token from softmax(z / T) restricted to the kept
set K (the k largest logits, then the smallest prefix of them, by probability renormalised over those k, whose mass
reaches p) and returns that distribution's logprob (`logprobs_mode="processed_logprobs"`). The trainer's token
logprob log softmax(z / T)[y] describes another distribution: the importance ratio of an on-policy sample is then
pi_K(y) / pi(y) = 1 / (mass of K) instead of 1 (vLLM #42259 and NeMo-RL's mismatch reports). So the trainer applies
the same filter:

    log pi_K(y) = z_y / T - logsumexp_{j in K} z_j / T

which involves only the kept tokens' logits, so neither it nor its gradient needs a pass over the vocabulary:

1. no gradient: the kept set per position, as ids: the k (or `max_kept` for top-p alone) largest scaled logits
   (`topk.vocab_topk`, a vocabulary block at a time, TP-aware), then the top-p prefix of them;
2. with gradient: the logits of the sampled token and of the kept ids only, from the rows of the head's weight
   they need (`_RowLogits`, a few positions at a time, recomputed in the backward pass) or gathered from the logits;
   at TP > 1 each rank computes the ids of its vocabulary shard and the values are summed over the group (megatron's
   reduce-from-TP region), the hidden state entering through the copy-to-TP region, as `topk.logprobs_at` does.

The sampled token always counts as kept: the engine sampled it, so it was in the engine's K, even where the trainer's
logits put it a rounding error outside. Top-p alone looks at the `max_kept` most likely tokens: a position whose
first `max_kept` tokens do not reach the mass p (a nearly flat distribution) keeps those, and is counted (the second
value `log_kept` returns).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.policy.interface import TokenScoring, as_scoring  # noqa: F401  (re-exported for the workers)

_ROWS_BUDGET = 1 << 24  # gathered weight elements per chunk of positions (64 MB in fp32)


@torch.no_grad()
def kept_set(output, head, scoring: TokenScoring, tp_group=None, vocab_start: int = 0):
    """(ids [n, k], kept [n, k] bool, number of positions whose top-p set was cut at `max_kept`) for flat `output`
    [n, h] (fused `head`) or [n, V_local] logits; the kept ids are a prefix of `ids` (most likely first)."""
    from megatron_rl.policy.topk import vocab_topk

    k = scoring.top_k if scoring.top_k > 0 else scoring.max_kept
    vocab = head.weight.shape[0] if head is not None and head.weight is not None else output.shape[-1]
    if tp_group is not None:
        vocab *= dist.get_world_size(tp_group)
    k = min(k, vocab)
    ids, vals, lse = vocab_topk(output, head, k, scoring.temperature, tp_group, vocab_start, scaled=True)
    keep = torch.ones_like(vals, dtype=torch.bool)
    truncated = 0
    if scoring.top_p < 1.0:
        probs = torch.exp(vals - lse)
        if scoring.top_k > 0:  # the sampler applies top-p to the probabilities renormalised over the top-k
            probs = probs / probs.sum(-1, keepdim=True)
        above = probs.cumsum(-1) - probs  # the mass of the tokens ranked above each one
        keep = above < scoring.top_p
        keep[:, 0] = True
        if scoring.top_k <= 0 and k < vocab:
            truncated = int(keep[:, -1].sum())
    return ids, keep, truncated


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


def _scaled_logits_at(output, head, ids, temperature: float, tp_group, vocab_start: int):
    """z / T at global `ids` [n, m] of flat `output`, differentiable, whichever rank's shard holds each id."""
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


def log_kept(output, head, targets, scoring: TokenScoring, tp_group=None, vocab_start: int = 0):
    """(log pi_K(targets) [n], differentiable; positions cut at max_kept) at flat positions: `output` [n, h] hidden
    states with a fused `head` (its `weight`, this rank's vocabulary rows from `head.vocab_start`), else [n, V_local]
    logits from `vocab_start`; `targets` [n] the sampled ids."""
    targets = targets.to(output.device).long()
    ids, keep, truncated = kept_set(output.detach(), head, scoring, tp_group, vocab_start)
    every = torch.cat([targets[:, None], ids], dim=1)
    # the sampled token counts once, kept whatever its rank among the candidates
    keep = torch.cat([torch.ones_like(keep[:, :1]), keep & (ids != targets[:, None])], dim=1)
    z = _scaled_logits_at(output, head, every, float(scoring.temperature), tp_group, vocab_start)
    lse_kept = torch.logsumexp(z.masked_fill(~keep, float("-inf")), dim=-1)
    return z[:, 0] - lse_kept, truncated


def filter_logprobs(lp, output, head, targets, scoring, tp_group=None, vocab_start: int = 0):
    """The kernels' token logprobs `lp` [...] replaced by the filtered distribution's when `scoring` filters (else
    `lp` itself): `output` [..., h] hidden states with a fused `head`, else [..., V_local] logits."""
    scoring = as_scoring(scoring)
    if not scoring.filtered:
        return lp
    out, _ = log_kept(output.reshape(-1, output.shape[-1]), head, targets.reshape(-1), scoring, tp_group,
                      vocab_start)
    return out.view(lp.shape).to(lp.dtype)
