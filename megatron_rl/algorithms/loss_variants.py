"""Per-token policy objectives of the loss variants, and the mask-style mismatch corrections.

Each objective returns (objective, clipped): the per-token quantity whose mean the policy maximises (the loss is
minus it, times the mismatch weights, normalised by `grpo_loss`), and a bool per token saying whether the variant's
clip was active there (for clip_frac). Every tensor is flat over the micro-batch's tokens; masked positions hold
zeros (cleaned by the caller) and are excluded by `valid`.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_rl.config.schema import LossConfig

Tensor = torch.Tensor


def seq_sum(values: Tensor, inverse: Tensor, num_seqs: int) -> Tensor:
    """Sum of per-token values per sequence (inverse: dense 0..num_seqs-1 sequence index of each token)."""
    out = torch.zeros(num_seqs, dtype=values.dtype, device=values.device)
    return out.index_add(0, inverse, values)


def ppo_clip_objective(ratio: Tensor, adv: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """min(ratio * A, clip(ratio, 1 - low, 1 + high) * A), and where the clipped branch won."""
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - low, 1.0 + high) * adv
    return torch.minimum(unclipped, clipped), clipped < unclipped


def gspo_objective(lp: Tensor, old: Tensor, adv: Tensor, valid: Tensor, cfg: LossConfig, inverse: Tensor,
                   num_seqs: int) -> tuple[Tensor, Tensor]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", eqs. 5-7):

        J(theta) = E[ 1/G sum_i min( s_i(theta) A_i, clip(s_i(theta), 1 - eps_low, 1 + eps_high) A_i ) ],
        s_i(theta) = (pi_theta(y_i|x) / pi_old(y_i|x)) ^ (1/|y_i|) = exp( 1/|y_i| sum_t log(pi_theta / pi_old)(y_i,t) )

    The sequence's objective is repeated on each of its tokens, so a per-sequence mean (normalizer "sequences", the
    variant's default) gives exactly the paper's 1/G sum_i; its gradient reaches every token through s_i.
    """
    counts = seq_sum(valid, inverse, num_seqs).clamp(min=1.0)
    log_s = seq_sum((lp - old) * valid, inverse, num_seqs) / counts
    s = torch.exp(log_s)[inverse]
    return ppo_clip_objective(s, adv, cfg.gspo_clip_low, cfg.gspo_clip_high)


def cispo_objective(lp: Tensor, old: Tensor, adv: Tensor, cfg: LossConfig) -> tuple[Tensor, Tensor]:
    """CISPO (MiniMax-M1, Chen et al. 2025, eqs. 4-5):

        J(theta) = E[ 1/sum_i |o_i| sum_i sum_t sg(r_hat_i,t(theta)) A_i,t log pi_theta(o_i,t | q, o_i,<t) ],
        r_hat_i,t = clip(r_i,t(theta), 1 - eps_low_IS, 1 + eps_high_IS)

    The IS weight is clipped and detached, so every token keeps a REINFORCE gradient (PPO's clip would zero it).
    """
    ratio = torch.exp(lp - old)
    lo, hi = 1.0 - cfg.cispo_clip_low, 1.0 + cfg.cispo_clip_high
    w = ratio.detach().clamp(lo, hi)
    return w * adv * lp, (ratio.detach() < lo) | (ratio.detach() > hi)


def importance_mask(old: Tensor, gen: Optional[Tensor], mask: Tensor, cfg: LossConfig,
                    inverse: Optional[Tensor] = None, num_seqs: int = 0) -> Tensor:
    """1.0 where a token keeps its weight, 0.0 where the mismatch mask drops it (detached).

    token (icepop): pi_old/pi_gen of the token outside [low, high] -> that token is dropped.
    sequence (masked IS): the product of the ratios over the sequence's valid tokens outside [low, high] -> the whole
    sequence is dropped. Compared in log space, so long sequences cannot overflow.
    """
    mode = cfg.importance_mask
    if mode == "off":
        return torch.ones_like(old)
    if gen is None:
        raise ValueError(f"importance_mask={mode!r} needs gen_logprobs")
    log_lo = math.log(cfg.importance_mask_low) if cfg.importance_mask_low > 0 else -math.inf
    log_hi = math.log(cfg.importance_mask_high)
    log_r = torch.where(mask, (old - gen).detach(), torch.zeros_like(old))
    if mode == "token":
        keep = (log_r >= log_lo) & (log_r <= log_hi)
    elif mode == "sequence":
        if inverse is None:
            raise ValueError("importance_mask='sequence' needs seq_ids")
        per_seq = seq_sum(log_r, inverse, num_seqs)
        keep = ((per_seq >= log_lo) & (per_seq <= log_hi))[inverse]
    else:
        raise ValueError(f"unknown importance_mask {mode!r} (expected off, token or sequence)")
    return keep.to(old.dtype)
