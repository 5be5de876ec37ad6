"""The reward model's pairwise loss (Bradley-Terry, as TRL's RewardTrainer computes it) over the scalar rewards a
value head gives each sequence of a preference pair.

    loss = -log sigmoid(r_chosen - r_rejected - margin)  +  center_coef * (r_chosen + r_rejected)^2

averaged over pairs (the centring term, TRL's `center_rewards_coefficient`, keeps the rewards near 0: Eisenstein et
al. 2023). As every loss of the worker contract (`policy/loss_api.py`), a micro-batch's share is divided by the whole
batch's pair count, so the sum over micro-batches and data-parallel ranks is the batch mean however it was split; the
metrics, named as TRL names them, likewise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

Tensor = torch.Tensor


def bradley_terry(chosen: Tensor, rejected: Tensor, *, num_pairs: float, margin: Tensor | None = None,
                  center_coef: float | None = None) -> tuple[Tensor, dict]:
    """(loss share, metrics) of this micro-batch's pairs: `chosen[i]` and `rejected[i]` are pair i's rewards (the
    value head at each sequence's last token); `margin[i]` an optional per-pair margin; `num_pairs` the global count."""
    if chosen.shape != rejected.shape or chosen.dim() != 1:
        raise ValueError(f"chosen {tuple(chosen.shape)} and rejected {tuple(rejected.shape)} must be the same [pairs]")
    diff = chosen - rejected
    loss = -F.logsigmoid(diff - (margin if margin is not None else 0.0)).sum()
    if center_coef:
        loss = loss + center_coef * ((chosen + rejected) ** 2).sum()
    loss = loss / num_pairs
    with torch.no_grad():
        c, r = chosen.detach().float(), rejected.detach().float()
        metrics = {"accuracy": float((c > r).float().sum()) / num_pairs,
                   "margin": float((c - r).sum()) / num_pairs,
                   "chosen_rewards": float(c.sum()) / num_pairs, "rejected_rewards": float(r.sum()) / num_pairs}
    return loss, metrics
