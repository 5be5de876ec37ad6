"""The GRPO policy loss on one micro-batch of flat per-token tensors, plus generator/trainer mismatch metrics.

Normalisation is global on purpose: the caller passes the number of valid tokens (or sequences) of the WHOLE step,
summed over every micro-batch and data-parallel rank. Each micro-batch's loss is then already its share of the global
mean, so summing micro-batch losses (gradient accumulation) and summing gradients over DP ranks gives exactly the
gradient of the mean over all tokens — no rescaling by micro-batch count, and no bias towards short micro-batches.
The returned metrics follow the same rule: they are this micro-batch's share, so the caller just adds them up.

Importance weights (truncated IS for generator/trainer mismatch, times the masked-IS / icepop mask) multiply the PG
and KL terms, which are estimates over tokens sampled by the generator; the entropy bonus is a full-distribution
quantity per position and is not reweighted. A masked token keeps its place in the normaliser (its weight is 0): the
global counts are fixed before the loss sees the batch.

The variant's per-token objective (GRPO's clipped ratio, GSPO, CISPO) lives in `loss_variants.py`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_rl.algorithms.loss_variants import (
    cispo_objective, gspo_objective, importance_mask, ppo_clip_objective, seq_sum,
)
from megatron_rl.config.schema import LossConfig

Tensor = torch.Tensor


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str, clamp: Optional[float],
                value_clamp: Optional[float] = None) -> Tensor:
    """Per-token estimate of KL(policy || reference) on tokens sampled from the policy (Schulman's k1/k2/k3).

    With r = ref_lp - lp (clamped to [-clamp, clamp] first, so one token the reference finds absurd cannot blow up
    the exponent): k1 = -r, k2 = r^2 / 2, k3 = exp(r) - r - 1 (non-negative, unbiased, low variance).
    `value_clamp` then bounds each token's value (k1 to [-c, c]; k2, k3 >= 0 to at most c): the log-ratio clamp
    alone still lets one token's k3 reach e^20. A clamped token contributes no gradient.
    """
    r = ref_logprobs - logprobs
    if clamp is not None:
        r = r.clamp(-clamp, clamp)
    if estimator == "k1":
        kl = -r
    elif estimator == "k2":
        kl = 0.5 * r * r
    elif estimator == "k3":
        kl = torch.exp(r) - r - 1.0
    else:
        raise ValueError(f"unknown kl_estimator {estimator!r} (expected k1, k2 or k3)")
    if value_clamp is not None:
        kl = kl.clamp(-value_clamp, value_clamp) if estimator == "k1" else kl.clamp(max=value_clamp)
    return kl


def _compact_seq_ids(seq_ids: Tensor) -> tuple[Tensor, int]:
    # callers may use any integer ids (global indices, -1 for padding); a dense 0..S-1 index is what scatter needs
    uniq, inverse = torch.unique(seq_ids.reshape(-1), return_inverse=True)
    return inverse, int(uniq.numel())


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
        per_seq = seq_sum(log_w, inverse, num_seqs)
        return torch.exp(per_seq.clamp(max=log_cap))[inverse]
    raise ValueError(f"unknown importance_correction {mode!r} (expected off, token or sequence)")


def grpo_loss(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, *, cfg: LossConfig,
              ref_logprobs: Optional[Tensor] = None, gen_logprobs: Optional[Tensor] = None,
              entropy: Optional[Tensor] = None, num_global_tokens: float, seq_ids: Optional[Tensor] = None,
              num_global_seqs: Optional[float] = None) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy-gradient loss of cfg.variant (+ KL to reference, - entropy bonus) for one micro-batch.

    All tensors hold one value per token and share a shape (flattened here). `mask` marks valid (response) tokens;
    values at masked positions are ignored, even NaN/inf. `advantages` is the sequence's advantage repeated on its
    tokens. `num_global_tokens`: valid tokens in the whole step (all micro-batches, all DP ranks);
    `num_global_seqs`: sequences in the whole step. `seq_ids` (any integer id per token; a sequence must not span
    micro-batches) is needed by the sequence-level parts: GSPO, the "sequences"/"constant" normalisers, sequence IS.

    grpo, per token, with ratio = exp(lp - old_lp): min(ratio*A, clip(ratio, 1-low, 1+high)*A); with dual clip c
    and A < 0 it becomes max(that, c*A), bounding how hard a very unlikely-now token is pushed down.
    gspo / cispo: see `loss_variants`. Normalisers (cfg.effective_normalizer()): tokens: sum / num_global_tokens;
    sequences: mean over each sequence's tokens, summed / num_global_seqs; constant (Dr. GRPO, Liu et al. 2025,
    "Understanding R1-Zero-Like Training"): sum / (cfg.normalizer_max_len * num_global_seqs), no length bias.

    Returns (loss, metrics). Metrics are detached 0-dim tensors, each this micro-batch's share of a global
    token-level mean (sum them over micro-batches; call float() when logging): loss, pg_loss, kl, entropy,
    clip_frac, dual_clip_frac, importance_weight_mean, ratio_mean; with importance_mask on, is_masked_token_frac
    (share of the step's tokens) and is_masked_seq_frac (sequences with a masked token, share of the step's
    sequences).
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
    normalizer = cfg.effective_normalizer()
    if (normalizer == "sequences" or cfg.variant == "gspo") and inverse is None:
        raise ValueError(f"{'variant gspo' if cfg.variant == 'gspo' else 'normalizer sequences'} needs seq_ids")
    if normalizer != "tokens" and num_global_seqs is None:
        raise ValueError(f"normalizer {normalizer!r} needs seq_ids and num_global_seqs")
    if normalizer == "constant" and not cfg.normalizer_max_len:
        raise ValueError("normalizer 'constant' needs normalizer_max_len (the loader sets generation.max_new_tokens)")

    # --- the variant's policy objective ---
    ratio = torch.exp(lp - old)
    dual_clipped = torch.zeros_like(mask)
    if cfg.variant == "grpo":
        objective, ppo_clipped = ppo_clip_objective(ratio, adv, cfg.ratio_clip_low, cfg.ratio_clip_high)
        if cfg.ratio_clip_c is not None:
            floor = cfg.ratio_clip_c * adv
            dual_clipped = (adv < 0) & (floor > objective)
            objective = torch.where(adv < 0, torch.maximum(objective, floor), objective)
    elif cfg.variant == "gspo":
        objective, ppo_clipped = gspo_objective(lp, old, adv, valid, cfg, inverse, num_seqs)
    elif cfg.variant == "cispo":
        objective, ppo_clipped = cispo_objective(lp, old, adv, cfg)
    else:
        raise ValueError(f"unknown loss variant {cfg.variant!r} (expected grpo, gspo or cispo)")

    weights = importance_weights(old, gen, mask, cfg.importance_correction or "off", cfg.importance_cap, inverse,
                                 num_seqs)
    keep = None
    if cfg.importance_mask != "off":
        keep = importance_mask(old, gen, mask, cfg, inverse, num_seqs)
        weights = weights * keep
    per_token = -weights * objective
    kl_tok = None
    if ref is not None:
        kl_tok = kl_estimate(lp, ref.detach(), cfg.kl_estimator, cfg.kl_clamp, cfg.kl_value_clamp)
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
        sums = seq_sum(x * valid, inverse, num_seqs)
        counts = seq_sum(valid, inverse, num_seqs).clamp(min=1.0)
        return (sums / counts).sum() / num_global_seqs

    def constant_share(x: Tensor) -> Tensor:
        # the same constant for every token of the step, whatever the sequence's length
        return (x * valid).sum() / (cfg.normalizer_max_len * num_global_seqs)

    share = {"tokens": token_share, "sequences": seq_share, "constant": constant_share}[normalizer]
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
        if keep is not None:
            dropped = (1.0 - keep) * valid
            metrics["is_masked_token_frac"] = token_share(dropped)
            if inverse is not None and num_global_seqs:
                hit = seq_sum(dropped, inverse, num_seqs) > 0
                metrics["is_masked_seq_frac"] = hit.to(lp.dtype).sum() / num_global_seqs
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
