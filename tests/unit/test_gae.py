"""GAE and the critic's value loss (`algorithms/gae.py`) against references written from the paper's closed forms:
A_t = sum_l (gamma lambda)^l delta_{t+l} over the trained tokens after t (Schulman et al. 2016, eq. 16), not the
recursion the module runs; the value loss token by token in Python floats."""
from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_rl.algorithms.gae import gae, token_rewards, value_loss


def reference_gae(rewards, values, mask, lengths, gamma, lam):
    adv, ret, start = [0.0] * len(rewards), [0.0] * len(rewards), 0
    for n in lengths:
        steps = [t for t in range(start, start + n) if mask[t]]  # the actions; observations are not
        vals = [values[t] for t in steps] + [0.0]  # the episode ends after the last action
        deltas = [rewards[t] + gamma * vals[i + 1] - vals[i] for i, t in enumerate(steps)]
        for i, t in enumerate(steps):
            adv[t] = sum((gamma * lam) ** l * deltas[i + l] for l in range(len(steps) - i))
            ret[t] = adv[t] + values[t]
        start += n
    return adv, ret


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (1.0, 0.95), (0.99, 0.9), (0.9, 0.0)])
def test_gae_equals_the_closed_form(gamma, lam):
    rng = random.Random(int(gamma * 100 + lam * 10))
    lengths = [5, 1, 9, 4]
    n = sum(lengths)
    rewards = [rng.uniform(-1, 1) for _ in range(n)]
    values = [rng.uniform(-1, 1) for _ in range(n)]
    # row 3 has observation tokens in the middle (multi-turn), row 4 trains nothing after its first token
    mask = [True] * 5 + [True] + [True, True, False, False, True, True, False, True, True] + [True, False, False, False]
    adv, ret = gae(torch.tensor(rewards), torch.tensor(values), torch.tensor(mask), lengths, gamma=gamma, lam=lam)
    want_adv, want_ret = reference_gae(rewards, values, mask, lengths, gamma, lam)
    torch.testing.assert_close(adv, torch.tensor(want_adv), atol=1e-6, rtol=0)
    torch.testing.assert_close(ret, torch.tensor(want_ret), atol=1e-6, rtol=0)
    assert all(adv[t] == 0 and ret[t] == 0 for t in range(n) if not mask[t])


def test_lambda_one_gamma_one_is_reward_to_go_minus_value():
    """Monte-Carlo: with gamma = lambda = 1, A_t = (sum of the rewards from t on) - V_t."""
    r, v = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.2, 0.5, 0.7])
    adv, ret = gae(r, v, torch.ones(3, dtype=torch.bool), [3], gamma=1.0, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([0.8, 0.5, 0.3]))
    torch.testing.assert_close(ret, torch.ones(3))


def test_token_rewards_put_the_reward_on_the_last_trained_token_and_the_kl_on_all():
    mask = torch.tensor([True, True, False, True, False, True, True])
    kl = torch.tensor([0.1, 0.2, 9.0, 0.3, 9.0, 0.4, 0.5])
    out = token_rewards([1.0, 2.0], mask, [5, 2], kl=kl, kl_coef=0.5)
    want = [-0.05, -0.1, 0.0, 1.0 - 0.15, 0.0, -0.2, 2.0 - 0.25]  # row 1 ends on its 4th token: the 5th is observed
    torch.testing.assert_close(out, torch.tensor(want))
    with pytest.raises(ValueError):
        token_rewards([1.0], mask, [5, 2])  # one reward per row


@pytest.mark.parametrize("clip", [None, 0.2])
def test_value_loss_token_by_token(clip):
    rng = random.Random(3)
    n = 12
    v = [rng.uniform(-1, 1) for _ in range(n)]
    old = [x + rng.uniform(-0.5, 0.5) for x in v]
    ret = [rng.uniform(-1, 1) for _ in range(n)]
    mask = [rng.random() < 0.7 for _ in range(n)]
    total, clipped = 0.0, 0
    for i in range(n):
        if not mask[i]:
            continue
        plain = (v[i] - ret[i]) ** 2
        if clip is None:
            total += 0.5 * plain
            continue
        vc = min(max(v[i], old[i] - clip), old[i] + clip)
        total += 0.5 * max(plain, (vc - ret[i]) ** 2)
        clipped += (vc - ret[i]) ** 2 > plain
    values = torch.tensor(v, requires_grad=True)
    loss, metrics = value_loss(values, torch.tensor(old), torch.tensor(ret), torch.tensor(mask), clip=clip,
                               num_tokens=20.0)
    assert float(loss.detach()) == pytest.approx(total / 20.0, rel=1e-6)
    assert metrics["value_clip_frac"] == pytest.approx(clipped / 20.0)
    loss.backward()
    # d/dV of 0.5 (V - R)^2 is V - R where the unclipped branch decides (and the value moved), 0 where the clip does
    for i in range(n):
        g = float(values.grad[i])
        if not mask[i]:
            assert g == 0.0
        elif clip is None or abs(v[i] - old[i]) <= clip or (v[i] - ret[i]) ** 2 >= \
                (min(max(v[i], old[i] - clip), old[i] + clip) - ret[i]) ** 2:
            assert g == pytest.approx((v[i] - ret[i]) / 20.0, rel=1e-5)
        else:
            assert g == 0.0 and not math.isnan(g)
