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

from megatron_rl.algorithms.supervised_loss import pair_positions
from megatron_rl.policy.loss_api import LossInputs

Tensor = torch.Tensor

# the metrics an RM step reports beside loss, grad_norm, lr and the counts (TRL's RewardTrainer names)
RM_METRICS = ("accuracy", "margin", "chosen_rewards", "rejected_rewards")


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


def last_token_values(values: Tensor, seq_ids: Tensor, seqs: Tensor) -> Tensor:
    """[m]: each sequence's value at its last response token (flat values in `seqs` order, per loss_api.py)."""
    positions = torch.arange(len(seq_ids), device=seq_ids.device)
    return values[torch.stack([positions[seq_ids == s].max() for s in seqs.tolist()])]


class RMLossFn:
    """The reward model's loss under the worker contract: a value model (policy.value_head) hands its per-token
    values in `LossInputs.logprobs`; a sequence's reward is its last token's (`supervised_batches.rm_pair_batch`
    makes that the value at the real last token). Picklable: shipped to the policy ranks."""

    def __init__(self, center_coef: float | None = None):
        self.center_coef = center_coef

    def __call__(self, inp: LossInputs):
        if inp.seq_groups is None or inp.seq_roles is None:
            raise ValueError("the reward-model loss needs pair group ids and roles (supervised_batches.rm_pair_batch)")
        rewards = last_token_values(inp.logprobs, inp.seq_ids, inp.seqs)
        c, r = pair_positions(inp.seqs, inp.seq_groups, inp.seq_roles)
        # the data's per-pair margins (TRL's `margin` column; supervised_batches.rm_pair_batch), if any
        margin = inp.fields.get("margin")
        margin = last_token_values(margin, inp.seq_ids, inp.seqs)[c] if margin is not None else None
        return bradley_terry(rewards[c], rewards[r], num_pairs=inp.num_global_seqs / 2, margin=margin,
                             center_coef=self.center_coef)
