"""PPO's per-token advantages and returns: generalized advantage estimation (Schulman et al. 2016, "High-Dimensional
Continuous Control Using Generalized Advantage Estimation"), and the critic's clipped value loss.

One sequence's response is a trajectory of T tokens: the action at t is token t, the state before it the prefix.
With per-token rewards r_t (the sequence's reward on its last token, the KL penalty on every token when it is folded
into the reward), the critic's values V_t and V_T = 0 after the last token (the episode ends there):

    delta_t = r_t + gamma * V_{t+1} - V_t
    A_t     = delta_t + gamma * lambda * A_{t+1}        (A_T = 0)
    R_t     = A_t + V_t                                 (the critic's regression target)

Tokens the loss does not train (multi-turn observations, `loss_mask` False) are not actions: they are skipped, so
the recursion runs over the trained tokens only, from each to the next trained one (verl and OpenRLHF do the same for
their observation masks). Their advantage and return are 0.

Tensors are flat over the batch's response tokens, row by row, with the length of each row (the layout the loss
functions see, `policy/loss_api.py`); the recursion is a loop over a row's tokens, run in float64 on the host: it is
the driver's work between the critic's pass and the training pass, a few thousand tokens per sequence.
"""
from __future__ import annotations

from typing import Sequence

import torch

Tensor = torch.Tensor


def gae(rewards: Tensor, values: Tensor, mask: Tensor, lengths: Sequence[int], *, gamma: float,
        lam: float) -> tuple[Tensor, Tensor]:
    """(advantages, returns), each shaped like `rewards` ([sum(lengths)] float32): GAE per row of `lengths` tokens
    over the tokens where `mask` is true (module doc). `values` are the critic's V_t of the same tokens."""
    if not (rewards.shape == values.shape == mask.shape) or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)}, values {tuple(values.shape)} and mask {tuple(mask.shape)} "
                         "must be the same flat [tokens] shape")
    if sum(lengths) != rewards.numel():
        raise ValueError(f"the rows' lengths add up to {sum(lengths)}, but there are {rewards.numel()} tokens")
    r, v, m = rewards.double(), values.double(), mask.bool()
    adv = torch.zeros_like(r)
    start = 0
    for n in lengths:
        last_adv, next_value = 0.0, 0.0  # after the row's last trained token the episode has ended
        for t in range(start + n - 1, start - 1, -1):
            if not m[t]:
                continue
            delta = float(r[t]) + gamma * next_value - float(v[t])
            last_adv = delta + gamma * lam * last_adv
            adv[t], next_value = last_adv, float(v[t])
        start += n
    returns = torch.where(m, adv + v, torch.zeros_like(v))
    return adv.float(), returns.float()


def token_rewards(seq_rewards: Sequence[float], mask: Tensor, lengths: Sequence[int],
                  kl: Tensor | None = None, kl_coef: float = 0.0) -> Tensor:
    """Per-token rewards for GAE: each sequence's reward on its last trained token, minus kl_coef * kl_t on every
    trained token when the KL penalty is folded into the reward (PPO's "KL in reward"; `kl` per token)."""
    out = torch.zeros(mask.shape, dtype=torch.float64)
    m = mask.bool()
    if kl is not None and kl_coef:
        out -= kl_coef * kl.double() * m
    start = 0
    for reward, n in zip(seq_rewards, lengths, strict=True):
        trained = m[start:start + n].nonzero()
        if len(trained):
            out[start + int(trained[-1])] += float(reward)
        start += n
    return out.float()


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *, clip: float | None,
               num_tokens: float) -> tuple[Tensor, dict]:
    """The critic's loss, summed over the masked tokens and divided by `num_tokens` (the batch's global count, as the
    loss contract asks): 0.5 * max((V - R)^2, (V_clip - R)^2) with V_clip = old_V + clamp(V - old_V, -clip, clip)
    (PPO2's value clipping; clip None: the plain squared error). Metrics: the share of tokens the clip decided."""
    err = (values - returns) ** 2
    if clip is None:
        per_token, clipped = 0.5 * err, torch.zeros_like(err, dtype=torch.bool)
    else:
        v_clip = old_values + (values - old_values).clamp(-clip, clip)
        err_clip = (v_clip - returns) ** 2
        per_token, clipped = 0.5 * torch.maximum(err, err_clip), err_clip > err
    m = mask.float()
    loss = (per_token * m).sum() / num_tokens
    return loss, {"value_loss": float(loss.detach()),
                  "value_clip_frac": float((clipped.float() * m).sum() / num_tokens)}
