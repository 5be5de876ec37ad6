"""The optimizer and learning-rate schedule of a trained worker group (the policy's `policy.optimizer`, PPO's
critic's `critic.optimizer`), one definition for both."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional


@dataclass
class OptimizerConfig:
    name: Literal["adamw"] = "adamw"
    lr: float = 1e-6
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    distributed: bool = True  # megatron distributed optimizer (optimizer state sharded over DP)


@dataclass
class SchedulerConfig:
    warmup_steps: int = 0
    decay: Literal["constant", "cosine", "linear"] = "constant"
    decay_steps: Optional[int] = None  # default: grpo.max_steps
