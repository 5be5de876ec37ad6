"""PPO's two config sections (`algorithm: ppo`, docs/algorithms.md), beside the schema's others: `ppo` (the
advantage estimator) and `critic` (the value model's worker group). PPO samples, scores and trains the policy with
GRPO's keys (`grpo.num_prompts_per_step`, `grpo.num_generations_per_prompt`, `grpo.loss.*`, `grpo.max_steps`,
validation); what differs is where each token's advantage comes from: a learned critic and GAE instead of the group.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from megatron_rl.config.optimizer_schema import OptimizerConfig, SchedulerConfig


@dataclass
class PPOConfig:
    # GAE (algorithms/gae.py): the discount and the bias/variance trade-off over a response's tokens. 1.0 and 0.95
    # as OpenRLHF's defaults (verl's lam is 1.0)
    gamma: float = 1.0
    lam: float = 0.95
    # true: grpo.loss.kl_coef x the sampled token's KL to the reference (k1, log pi_old - log pi_ref) is subtracted
    # from each token's reward before GAE, and the loss has no KL term (InstructGPT, OpenRLHF's default); false:
    # the KL term stays in the policy loss as in GRPO (grpo.loss.kl_estimator)
    kl_in_reward: bool = False
    # advantages standardised over the step's trained tokens (mean 0, std 1) before the policy loss, as OpenRLHF
    # and verl do: the critic's early errors set their scale otherwise
    whiten_advantages: bool = True


@dataclass
class CriticConfig:
    """PPO's critic: the policy's decoder (or a reward model's) with a value head (models/value_head.py), trained on
    GAE's returns with PPO2's clipped value loss, one rank on each of the policy's devices with the policy's split
    and backend, its own optimizer; colocated, it takes its own turn on the device (algorithms/handover.py)."""
    # None: policy.model with a new value head. Or an HF folder: a causal LM (a new head) or a reward model's
    # ...ForSequenceClassification export (its head too); or a megatron-rl reward-model checkpoint (a `step_N`)
    model: Optional[str] = None
    # verl's and OpenRLHF's critic learns ~10x faster than the actor (their 1e-5 vs 1e-6; the policy's default 1e-6)
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(lr=1e-5))
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # the first warmup_steps steps train the critic alone (the policy and the engines' weights stay as they are), so
    # the policy's first updates see values fitted to its own returns rather than a random head's
    warmup_steps: int = 0
    # PPO2's value clip: the new value stays within value_clip of the one the rollout was scored with; None: off
    value_clip: Optional[float] = 0.2
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto: policy.precision
