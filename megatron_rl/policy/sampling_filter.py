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
   they need or gathered from the logits (`topk.logits_at`, shared with top-k distillation's student logprobs).

The sampled token always counts as kept: the engine sampled it, so it was in the engine's K, even where the trainer's
logits put it a rounding error outside. Top-p alone looks at the `max_kept` most likely tokens: a position whose
first `max_kept` tokens do not reach the mass p (a nearly flat distribution) keeps those, and is counted (the second
value `log_kept` returns).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.policy.interface import TokenScoring, as_scoring  # noqa: F401  (re-exported for the workers)
from megatron_rl.policy.topk import logits_at, vocab_topk


@torch.no_grad()
def kept_set(output, head, scoring: TokenScoring, tp_group=None, vocab_start: int = 0):
    """(ids [n, k], kept [n, k] bool, number of positions whose top-p set was cut at `max_kept`) for flat `output`
    [n, h] (fused `head`) or [n, V_local] logits; the kept ids are a prefix of `ids` (most likely first)."""
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


def log_kept(output, head, targets, scoring: TokenScoring, tp_group=None, vocab_start: int = 0):
    """(log pi_K(targets) [n], differentiable; positions cut at max_kept) at flat positions: `output` [n, h] hidden
    states with a fused `head` (its `weight`, this rank's vocabulary rows from `head.vocab_start`), else [n, V_local]
    logits from `vocab_start`; `targets` [n] the sampled ids."""
    targets = targets.to(output.device).long()
    ids, keep, truncated = kept_set(output.detach(), head, scoring, tp_group, vocab_start)
    every = torch.cat([targets[:, None], ids], dim=1)
    # the sampled token counts once, kept whatever its rank among the candidates
    keep = torch.cat([torch.ones_like(keep[:, :1]), keep & (ids != targets[:, None])], dim=1)
    z = logits_at(output, head, every, float(scoring.temperature), tp_group, vocab_start)
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
