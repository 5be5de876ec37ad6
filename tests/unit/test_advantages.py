"""Group-relative advantages (edge cases by hand) and dynamic sampling with refill."""
import math

import pytest
import torch

from megatron_rl.algorithms.advantages import dynamic_sample, group_advantages, groups_with_signal
from megatron_rl.config.schema import AdvantageConfig


def cfg(**kw):
    return AdvantageConfig(**kw)


def test_leave_one_out_values_by_hand():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    adv, bad = group_advantages(r, cfg(baseline="leave_one_out", normalize_std=False))
    # r_i - mean(others): group 0 -> 1 - 1/3, 0 - 2/3; group 1 -> 1 - 0, 0 - 1/3
    expected = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [1.0, -1 / 3, -1 / 3, -1 / 3]])
    torch.testing.assert_close(adv, expected)
    assert bad == 0


def test_mean_baseline_with_std_by_hand():
    r = torch.tensor([[3.0, 1.0, 2.0]])
    adv, _ = group_advantages(r, cfg(baseline="mean", normalize_std=True, std_eps=0.0))
    std = math.sqrt(((3 - 2) ** 2 + (1 - 2) ** 2 + 0) / 2)  # Bessel-corrected
    torch.testing.assert_close(adv, torch.tensor([[1 / std, -1 / std, 0.0]]))
    adv_eps, _ = group_advantages(r, cfg(baseline="mean", normalize_std=True, std_eps=0.5))
    torch.testing.assert_close(adv_eps, torch.tensor([[1 / (std + 0.5), -1 / (std + 0.5), 0.0]]))


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_all_equal_group_is_exactly_zero(baseline, normalize_std):
    r = torch.tensor([[0.1, 0.1, 0.1], [1.0, 1.0, 1.0], [0.0, 1.0, 0.0]])
    adv, _ = group_advantages(r, cfg(baseline=baseline, normalize_std=normalize_std))
    assert torch.equal(adv[:2], torch.zeros(2, 3))
    assert torch.isfinite(adv).all() and adv[2].abs().sum() > 0


@pytest.mark.parametrize("baseline", ["mean", "leave_one_out"])
def test_group_of_one_is_zero(baseline):
    adv, _ = group_advantages(torch.tensor([[1.0], [0.0], [float("nan")]]), cfg(baseline=baseline))
    assert torch.equal(adv, torch.zeros(3, 1))


def test_nan_reward_counts_and_acts_as_zero():
    r = torch.tensor([[1.0, float("nan"), 0.0, float("inf")]])
    adv, bad = group_advantages(r, cfg(baseline="leave_one_out", normalize_std=False))
    ref, _ = group_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), cfg(baseline="leave_one_out",
                                                                         normalize_std=False))
    assert bad == 2
    torch.testing.assert_close(adv, ref)


def test_leave_one_out_advantages_sum_to_zero_per_group():
    r = torch.rand(5, 8, generator=torch.Generator().manual_seed(0))
    adv, _ = group_advantages(r, cfg(baseline="leave_one_out", normalize_std=False))
    torch.testing.assert_close(adv.sum(dim=1), torch.zeros(5), atol=1e-5, rtol=0)


def test_groups_with_signal():
    r = torch.tensor([[1.0, 1.0], [0.0, 1.0], [float("nan"), 0.0], [0.5, 0.5]])
    assert groups_with_signal(r).tolist() == [False, True, False, False]


class FakeDrawer:
    """Hands out groups from a fixed list of reward rows, recording how many were asked for each time."""

    def __init__(self, rows):
        self.rows, self.pos, self.asked = rows, 0, []

    def __call__(self, n):
        self.asked.append(n)
        take = self.rows[self.pos:self.pos + n]
        ids = list(range(self.pos, self.pos + len(take)))
        self.pos += len(take)
        return ids, torch.tensor(take) if take else torch.zeros(0, 2)


def test_dynamic_sampling_off_keeps_everything():
    d = FakeDrawer([[1.0, 1.0], [0.0, 1.0]])
    out = dynamic_sample(d, 2, cfg(dynamic_sampling=False))
    assert out.payloads == [0, 1] and out.rounds == 1 and out.num_dropped == 0


def test_dynamic_sampling_drops_without_refill():
    d = FakeDrawer([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]])
    out = dynamic_sample(d, 4, cfg(dynamic_sampling=True, refill=False))
    assert out.payloads == [1, 3] and out.num_dropped == 2 and out.rounds == 1
    assert out.rewards.tolist() == [[0.0, 1.0], [1.0, 0.0]]


def test_refill_until_full_and_truncates_surplus():
    rows = [[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 1.0]] + [[0.0, 1.0]] * 10
    d = FakeDrawer(rows)
    out = dynamic_sample(d, 4, cfg(dynamic_sampling=True, refill=True, max_refill_rounds=3))
    assert len(out.payloads) == 4 and out.payloads[0] == 1
    # keep rate 1/4 after round one: 3 missing / 0.25 = 12, capped at the batch size
    assert d.asked == [4, 4]
    assert out.rounds == 2 and out.num_surplus == 1 and out.num_dropped == 3
    assert groups_with_signal(out.rewards).all()


def test_refill_stops_after_max_rounds():
    d = FakeDrawer([[1.0, 1.0]] * 100)
    out = dynamic_sample(d, 4, cfg(dynamic_sampling=True, refill=True, max_refill_rounds=2))
    assert out.rounds == 3 and len(d.asked) == 3 and out.payloads == []
    assert out.rewards.shape == (0, 2)


def _loo_reference(rows, baseline, eps):
    """NeMo-RL's convention written out per sample: baseline and population std over the other G-1 rewards; a
    sample whose others all agree (std 0) is not divided."""
    out = []
    for row in rows:
        adv_row = []
        for i, ri in enumerate(row):
            others = [r for j, r in enumerate(row) if j != i]
            m = sum(others) / len(others)
            # others all equal: exactly 0 (their float mean may differ from them by a rounding error, and 1e-17
            # + eps would then blow the advantage up to 1e5)
            std = 0.0 if len(set(others)) == 1 else math.sqrt(sum((r - m) ** 2 for r in others) / len(others))
            base = m if baseline == "leave_one_out" else sum(row) / len(row)
            a = ri - base
            adv_row.append(a / (std + eps) if std > 0 else a)
        out.append(adv_row if max(row) != min(row) else [0.0] * len(row))
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("baseline", ["leave_one_out", "mean"])
def test_leave_one_out_std_matches_reference(baseline):
    rows = [[1.0, 0.0, 0.0, 0.0], [0.1, 0.1, 0.1, 0.7], [0.3, 0.9, 0.2, 0.5], [1.0, 1.0, 1.0, 1.0],
            [0.0, 1.0, 0.0, 1.0]]
    adv, _ = group_advantages(torch.tensor(rows, dtype=torch.float64),
                              cfg(baseline=baseline, normalize_std=True, std_mode="leave_one_out", std_eps=1e-6))
    torch.testing.assert_close(adv, _loo_reference(rows, baseline, 1e-6))
    # the lone success of row 0: its others are all 0 (std exactly 0), so it stays 1, never 1 / 1e-6
    assert adv[0, 0] == (1.0 if baseline == "leave_one_out" else 0.75) and adv.abs().max() < 10


def test_leave_one_out_std_group_of_two_is_not_divided():
    adv, _ = group_advantages(torch.tensor([[1.0, 0.0]]), cfg(baseline="leave_one_out", std_mode="leave_one_out"))
    torch.testing.assert_close(adv, torch.tensor([[1.0, -1.0]]))


def test_std_mode_group_is_the_default():
    r = torch.rand(3, 6, generator=torch.Generator().manual_seed(1))
    a, _ = group_advantages(r, cfg())
    b, _ = group_advantages(r, cfg(std_mode="group"))
    assert AdvantageConfig().std_mode == "group" and torch.equal(a, b)
