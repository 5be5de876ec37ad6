"""The reward model's Bradley-Terry loss (`algorithms/rm_loss.py`) against TRL 1.16's RewardTrainer.compute_loss
formula written in plain torch: -logsigmoid(r_c - r_r - margin).mean() + coef * mean((r_c + r_r)^2), with its
gradient, and split into micro-batches and ranks as the worker contract splits it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.algorithms.rm_loss import bradley_terry


def trl_loss(rc, rr, margin=None, coef=None):
    loss = -F.logsigmoid(rc - rr - margin).mean() if margin is not None else -F.logsigmoid(rc - rr).mean()
    if coef is not None:
        loss = loss + coef * torch.mean((rc + rr) ** 2)
    return loss


@pytest.mark.parametrize("use_margin, coef", [(False, None), (True, None), (False, 0.01), (True, 0.5)])
def test_loss_and_gradient_equal_trls_formula(use_margin, coef):
    g = torch.Generator().manual_seed(7)
    rc, rr = torch.randn(10, generator=g, dtype=torch.float64), torch.randn(10, generator=g, dtype=torch.float64)
    margin = torch.rand(10, generator=g, dtype=torch.float64) if use_margin else None
    a, b = rc.clone().requires_grad_(), rr.clone().requires_grad_()
    ref = trl_loss(a, b, margin, coef)
    ref.backward()
    x, y = rc.clone().requires_grad_(), rr.clone().requires_grad_()
    # two micro-batches (7 + 3 pairs), each normalised by the global count: their sum is the batch loss
    parts = [bradley_terry(x[s], y[s], num_pairs=10, margin=None if margin is None else margin[s], center_coef=coef)
             for s in (slice(0, 7), slice(7, 10))]
    total = sum(p[0] for p in parts)
    total.backward()
    torch.testing.assert_close(total, ref.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(x.grad, a.grad, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(y.grad, b.grad, rtol=1e-12, atol=1e-12)
    metrics = {k: sum(p[1][k] for p in parts) for k in parts[0][1]}
    # TRL's metrics: accuracy and margin as means over the pairs
    assert metrics["accuracy"] == pytest.approx(float((rc > rr).double().mean()))
    assert metrics["margin"] == pytest.approx(float((rc - rr).mean()))
    assert metrics["chosen_rewards"] == pytest.approx(float(rc.mean()))
    assert metrics["rejected_rewards"] == pytest.approx(float(rr.mean()))


def test_mismatched_pairs_are_refused():
    with pytest.raises(ValueError, match="same"):
        bradley_terry(torch.zeros(3), torch.zeros(2), num_pairs=3)
