"""GRPO algorithm pieces that are pure torch: the policy loss, advantages, dynamic sampling. (The shared training loop
is `trainer.py`; SFT and DPO are `supervised*.py`.)"""
from megatron_rl.algorithms.advantages import (
    SampledGroups, dynamic_sample, group_advantages, groups_with_signal, sanitize_rewards,
)
from megatron_rl.algorithms.loss import grpo_loss, importance_weights, kl_estimate, mismatch_metrics

__all__ = ["SampledGroups", "dynamic_sample", "group_advantages", "groups_with_signal", "grpo_loss",
           "importance_weights", "kl_estimate", "mismatch_metrics", "sanitize_rewards"]
