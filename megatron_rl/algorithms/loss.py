"""The GRPO policy loss on one micro-batch of flat per-token tensors, plus generator/trainer mismatch metrics.

Normalisation is global on purpose: the caller passes the number of valid tokens (or sequences) of the WHOLE step,
summed over every micro-batch and data-parallel rank. Each micro-batch's loss is then already its share of the global
mean, so summing micro-batch losses (gradient accumulation) and summing gradients over DP ranks gives exactly the
gradient of the mean over all tokens — no rescaling by micro-batch count, and no bias towards short micro-batches.
The returned metrics follow the same rule: they are this micro-batch's share, so the caller just adds them up.

Importance weights (truncated IS for generator/trainer mismatch) multiply the PG and KL terms, which are estimates
over tokens sampled by the generator; the entropy bonus is a full-distribution quantity per position and is not
reweighted.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_rl.config.schema import LossConfig

Tensor = torch.Tensor


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str, clamp: Optional[float]) -> Tensor:
    """Per-token estimate of KL(policy || reference) on tokens sampled from the policy (Schulman's k1/k2/k3).

    With r = ref_lp - lp (clamped to [-clamp, clamp] first, so one token the reference finds absurd cannot blow up
    the exponent): k1 = -r, k2 = r^2 / 2, k3 = exp(r) - r - 1 (non-negative, unbiased, low variance).
    """
    r = ref_logprobs - logprobs
    if clamp is not None:
        r = r.clamp(-clamp, clamp)
    if estimator == "k1":
        return -r
    if estimator == "k2":
        return 0.5 * r * r
    if estimator == "k3":
        return torch.exp(r) - r - 1.0
    raise ValueError(f"unknown kl_estimator {estimator!r} (expected k1, k2 or k3)")


def _compact_seq_ids(seq_ids: Tensor) -> tuple[Tensor, int]:
    # callers may use any integer ids (global indices, -1 for padding); a dense 0..S-1 index is what scatter needs
    uniq, inverse = torch.unique(seq_ids.reshape(-1), return_inverse=True)
    return inverse, int(uniq.numel())


def _seq_sum(values: Tensor, inverse: Tensor, num_seqs: int) -> Tensor:
    out = torch.zeros(num_seqs, dtype=values.dtype, device=values.device)
    return out.index_add(0, inverse, values)


def importance_weights(old_logprobs: Tensor, gen_logprobs: Optional[Tensor], mask: Tensor, mode: str, cap: float,
                       inverse: Optional[Tensor] = None, num_seqs: int = 0) -> Tensor:
    """Truncated importance weights pi_old / pi_gen per token, detached (they rescale the gradient, never carry one).

    token: min(exp(old - gen), cap) per token; sequence: min(prod over the sequence's valid tokens, cap), broadcast to
    its tokens. The cap is applied in log space (min(log w, log cap)) so long sequences cannot overflow exp.
    """
    if mode == "off":
        return torch.ones_like(old_logprobs)
    if gen_logprobs is None:
        raise ValueError(f"importance_correction={mode!r} needs gen_logprobs")
    log_cap = math.log(cap)
    log_w = torch.where(mask, (old_logprobs - gen_logprobs).detach(), torch.zeros_like(old_logprobs))
    if mode == "token":
        return torch.exp(log_w.clamp(max=log_cap))
    if mode == "sequence":
        if inverse is None:
            raise ValueError("importance_correction='sequence' needs seq_ids")
        per_seq = _seq_sum(log_w, inverse, num_seqs)
        return torch.exp(per_seq.clamp(max=log_cap))[inverse]
    raise ValueError(f"unknown importance_correction {mode!r} (expected off, token or sequence)")


def grpo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, cfg: LossConfig,
              ref_logprobs: Optional[Tensor] = None, gen_logprobs: Optional[Tensor] = None,
              entropy: Optional[Tensor] = None, num_global_tokens: float, seq_ids: Optional[Tensor] = None,
              num_global_seqs: Optional[float] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped policy-gradient loss (+ KL to reference, - entropy bonus) for one micro-batch.

    All tensors hold one value per token and share a shape (flattened here). `mask` marks valid (response) tokens;
    values at masked positions are ignored, even NaN/inf. `advantages` is the sequence's advantage repeated on its
    tokens. `num_global_tokens`: valid tokens in the whole step (all micro-batches, all DP ranks).
    Sequence-level mode (cfg.token_level=False) averages within each sequence first and divides by
    `num_global_seqs`; it needs `seq_ids` (any integer id per token; a sequence must not span micro-batches).

    Per token, with ratio = exp(lp - old_lp), the objective is min(ratio*A, clip(ratio, 1-low, 1+high)*A); with dual
    clip c and A < 0 it becomes max(that, c*A), bounding how hard a very unlikely-now token is pushed down.

    Returns (loss, metrics). Metrics are detached 0-dim tensors, each this micro-batch's share of a global
    token-level mean (sum them over micro-batches; call float() when logging): loss, pg_loss, kl, entropy,
    clip_frac, dual_clip_frac, importance_weight_mean, ratio_mean.
    """
    lp = logprobs.reshape(-1)
    mask = mask.reshape(-1).to(torch.bool)
    zeros = torch.zeros_like(lp)

    def clean(x: Optional[Tensor]) -> Optional[Tensor]:
        # masked positions may hold padding garbage (NaN/inf); zero them so neither values nor gradients see it
        return None if x is None else torch.where(mask, x.reshape(-1).to(lp.dtype), zeros)

    lp = torch.where(mask, lp, zeros)
    old, adv, ref, gen, ent = (clean(x) for x in (old_logprobs, advantages, ref_logprobs, gen_logprobs, entropy))
    old, adv = old.detach(), adv.detach()
    valid = mask.to(lp.dtype)

    inverse, num_seqs = (None, 0)
    if seq_ids is not None:
        inverse, num_seqs = _compact_seq_ids(seq_ids)
    if not cfg.token_level and (inverse is None or num_global_seqs is None):
        raise ValueError("sequence-level loss (token_level=False) needs seq_ids and num_global_seqs")

    # --- clipped policy gradient ---
    ratio = torch.exp(lp - old)
    surr_unclipped = ratio * adv
    surr_clipped = ratio.clamp(1.0 - cfg.ratio_clip_low, 1.0 + cfg.ratio_clip_high) * adv
    objective = torch.minimum(surr_unclipped, surr_clipped)
    ppo_clipped = surr_clipped < surr_unclipped
    dual_clipped = torch.zeros_like(mask)
    if cfg.ratio_clip_c is not None:
        floor = cfg.ratio_clip_c * adv
        dual_clipped = (adv < 0) & (floor > objective)
        objective = torch.where(adv < 0, torch.maximum(objective, floor), objective)

    weights = importance_weights(old, gen, mask, cfg.importance_correction, cfg.importance_cap, inverse, num_seqs)
    per_token = -weights * objective
    kl_tok = None
    if ref is not None:
        kl_tok = kl_estimate(lp, ref.detach(), cfg.kl_estimator, cfg.kl_clamp)
        if cfg.kl_coef != 0.0:
            per_token = per_token + cfg.kl_coef * weights * kl_tok
    elif cfg.kl_coef != 0.0:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    if ent is not None and cfg.entropy_coef != 0.0:
        per_token = per_token - cfg.entropy_coef * ent

    def token_share(x: Tensor) -> Tensor:
        # this micro-batch's share of the global per-token mean
        return (x * valid).sum() / num_global_tokens

    def seq_share(x: Tensor) -> Tensor:
        # mean over each sequence's valid tokens, then this micro-batch's share of the mean over global sequences
        sums = _seq_sum(x * valid, inverse, num_seqs)
        counts = _seq_sum(valid, inverse, num_seqs).clamp(min=1.0)
        return (sums / counts).sum() / num_global_seqs

    share = token_share if cfg.token_level else seq_share
    loss = share(per_token)

    with torch.no_grad():
        metrics = {
            "loss": loss.detach(),
            "pg_loss": share(-weights * objective).detach(),
            "clip_frac": token_share((ppo_clipped | dual_clipped).to(lp.dtype)),
            "dual_clip_frac": token_share(dual_clipped.to(lp.dtype)),
            "importance_weight_mean": token_share(weights),
            "ratio_mean": token_share(ratio.detach()),
        }
        if kl_tok is not None:
            metrics["kl"] = token_share(kl_tok.detach())
        if ent is not None:
            metrics["entropy"] = token_share(ent.detach())
    return loss, metrics


def mismatch_metrics(gen_logprobs: Tensor, train_logprobs: Tensor, mask: Tensor, *,
                     num_tokens: Optional[float] = None) -> dict[str, float]:
    """How far the generator's token log-probs are from the trainer's, on the sampled tokens.

    token_mult_prob_error (NeMo-RL's definition): mean over valid tokens of exp(|gen_lp - train_lp|) — the average
    multiplicative disagreement of the two token probabilities; 1.0 means identical, 1.01 about 1 % apart.
    gen_kl_error: mean over valid tokens of the k3 estimate of KL(gen || train) for tokens sampled from the
    generator: with r = train_lp - gen_lp, exp(r) - r - 1 (non-negative, 0 iff equal; its expectation under the
    generator is exactly KL(gen || train) per token).
    `num_tokens`: divide by this instead of this call's valid-token count, making results additive across
    micro-batches/ranks (pass the global count). Masked positions are ignored even if non-finite.
    """
    mask = mask.reshape(-1).to(torch.bool)
    gen = gen_logprobs.detach().reshape(-1).double()
    train = train_logprobs.detach().reshape(-1).double()
    diff = torch.where(mask, train - gen, torch.zeros_like(gen))
    denom = float(mask.sum()) if num_tokens is None else float(num_tokens)
    if denom == 0:
        return {"token_mult_prob_error": 0.0, "gen_kl_error": 0.0}
    valid = mask.double()
    mult = (torch.exp(diff.abs()) * valid).sum() / denom
    k3 = ((torch.exp(diff) - diff - 1.0) * valid).sum() / denom
    return {"token_mult_prob_error": float(mult), "gen_kl_error": float(k3)}
