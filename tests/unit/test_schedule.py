"""The learning-rate schedule both backends share (`policy/grad_ops.build_scheduler`), against its definition: a
warm-up of W steps trains step i < W at lr * (i + 1) / W (never at 0), then the decay runs from lr to min_lr over
decay_steps, reached after the last step. Checkpoints written under the old rule (warm-up from lr 0) resume on it."""
from __future__ import annotations

import math

import pytest
import torch

from megatron_rl.config.schema import OptimizerConfig, SchedulerConfig
from megatron_rl.policy.grad_ops import SCHEDULE_RULE, build_scheduler, restore_scheduler, scheduler_state

LR = 1e-3


def lrs(sched, opt, steps: int) -> list[float]:
    """The lr each optimizer step trains at: read, then tick (as the workers do)."""
    out = []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        sched.step(increment=1)
    return out


def make(warmup: int, decay: str, max_steps: int, rule: int = SCHEDULE_RULE, min_lr: float = 0.0):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=LR)
    o = OptimizerConfig(lr=LR, min_lr=min_lr, weight_decay=0.0)
    s = SchedulerConfig(warmup_steps=warmup, decay=decay)
    return build_scheduler(opt, o, s, max_steps, rule=rule), opt, o, s


def reference(i: int, warmup: int, decay: str, max_steps: int) -> float:
    """Step i's lr written from the definition (min_lr 0)."""
    if i < warmup:
        return LR * (i + 1) / warmup
    if decay == "constant":
        return LR
    w = max(warmup - 1, 0)  # the last warm-up step is the decay's start
    ratio = (i - w) / (max_steps - w)
    return LR * (1 - ratio) if decay == "linear" else LR * 0.5 * (1 + math.cos(math.pi * ratio))


@pytest.mark.parametrize("warmup", [0, 1, 2, 3])
@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_every_step_trains_at_the_defined_lr(warmup, decay):
    max_steps = 5
    sched, opt, *_ = make(warmup, decay, max_steps)
    got = lrs(sched, opt, max_steps)
    assert got == pytest.approx([reference(i, warmup, decay, max_steps) for i in range(max_steps)], rel=1e-9)
    assert min(got) > 0  # the first step of a warm-up and the last of a decay both move the weights
    if warmup:
        assert got[min(warmup, max_steps) - 1] == pytest.approx(LR)


def test_three_steps_with_warmup_and_cosine_never_train_at_zero():
    """The first-day case: 3 SFT steps, warm-up 1, cosine to 0."""
    sched, opt, *_ = make(1, "cosine", 3)
    assert lrs(sched, opt, 3) == pytest.approx([LR, LR * 0.75, LR * 0.25])


def test_old_checkpoints_resume_on_their_own_rule():
    # written by the rule-1 scheduler (warm-up from 0), whose state had no "rule"
    old, old_opt, *_ = make(2, "cosine", 6, rule=1)
    assert lrs(old, old_opt, 2) == pytest.approx([0.0, LR / 2])
    state = dict(old.state_dict())
    assert "rule" not in state
    expected = lrs(old, old_opt, 4)
    sched, opt, o, s = make(2, "cosine", 6)
    resumed = restore_scheduler(sched, opt, o, s, 6, state)
    assert resumed.rule == 1 and lrs(resumed, opt, 4) == pytest.approx(expected)
    # today's rule round-trips through a checkpoint
    new, new_opt, o, s = make(2, "cosine", 6)
    lrs(new, new_opt, 3)
    saved = scheduler_state(new)
    assert saved["rule"] == SCHEDULE_RULE
    expected = lrs(new, new_opt, 3)
    fresh, opt2, *_ = make(2, "cosine", 6)
    back = restore_scheduler(fresh, opt2, o, s, 6, saved)
    assert back is fresh and lrs(back, opt2, 3) == pytest.approx(expected)
