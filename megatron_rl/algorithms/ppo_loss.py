"""PPO's two losses under the worker contract (`policy/loss_api.py`), reading the per-token fields PPO puts on the
batch (`RolloutBatch.fields`, named below):

- `PPOPolicyLossFn`: GRPO's loss (`algorithms/loss.py`: the clipped surrogate, its variants, KL and entropy terms,
  normalisers) with each token's GAE advantage (`fields[ADVANTAGES]`, algorithms/gae.py) instead of its sequence's;
- `ValueLossFn`: the critic's loss (`gae.value_loss`: 0.5 x the squared error to the return, PPO2's value clipping
  around the values the rollout was scored with) on a value model's per-token values, which its worker returns where
  a policy's returns logprobs (`policy.value_head`).
"""
from __future__ import annotations

import dataclasses

from megatron_rl.algorithms.gae import value_loss
from megatron_rl.algorithms.loss_fn import GRPOLossFn
from megatron_rl.policy.loss_api import LossInputs

ADVANTAGES, RETURNS, OLD_VALUES = "advantages", "returns", "old_values"


class PPOPolicyLossFn(GRPOLossFn):
    def __call__(self, inp: LossInputs):
        if ADVANTAGES not in inp.fields:
            raise ValueError(f"the PPO policy loss needs per-token advantages: RolloutBatch.fields[{ADVANTAGES!r}]")
        return super().__call__(dataclasses.replace(inp, advantages=inp.fields[ADVANTAGES]))


class ValueLossFn:
    """Picklable: shipped to the critic's ranks. `clip`: PPO2's value clip range (None: the plain squared error)."""

    def __init__(self, clip: float | None = 0.2):
        self.clip = clip

    def __call__(self, inp: LossInputs):
        missing = [k for k in (RETURNS, OLD_VALUES) if k not in inp.fields]
        if missing:
            raise ValueError(f"the value loss needs RolloutBatch.fields {missing}")
        loss, metrics = value_loss(inp.logprobs, inp.fields[OLD_VALUES], inp.fields[RETURNS], inp.mask,
                                   clip=self.clip, num_tokens=inp.num_global_tokens)
        return loss, {"loss": loss.detach(), **metrics}
