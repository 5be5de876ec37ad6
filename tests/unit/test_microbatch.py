import random

import pytest

from megatron_rl.policy.microbatch import SequenceTooLongError, balance_over_dp, pack_microbatches, plan


def test_every_sequence_exactly_once_and_within_budget():
    rng = random.Random(0)
    lengths = [rng.randint(1, 100) for _ in range(200)]
    for dp in (1, 2, 4):
        seen = []
        for r in range(dp):
            for mb in plan(lengths, dp, r, max_tokens=256):
                assert mb.padded_tokens <= 256
                assert mb.max_len == max(lengths[i] for i in mb.indices)
                seen += mb.indices
        assert sorted(seen) == list(range(200))


def test_dp_balance_is_tight():
    rng = random.Random(1)
    lengths = [rng.randint(10, 500) for _ in range(64)]
    loads = [sum(lengths[i] for i in s) for s in balance_over_dp(lengths, 4)]
    assert max(loads) - min(loads) <= max(lengths)  # LPT bound: within one sequence of each other


def test_ffd_uses_few_bins():
    lengths = [50] * 8 + [25] * 8
    mbs = pack_microbatches(list(range(16)), lengths, max_tokens=200)
    assert sum(mb.padded_tokens for mb in mbs) == 8 * 50 + 8 * 25  # no padding wasted here
    assert len(mbs) == 3


def test_too_long_names_sequence_and_key():
    with pytest.raises(SequenceTooLongError, match=r"sequence 1 .*max_tokens_per_microbatch=10"):
        pack_microbatches([0, 1], [5, 11], max_tokens=10)


def test_equal_counts_pads_the_short_ranks_with_empty_microbatches():
    # the case: [700] on DP rank 0 (one micro-batch), [400, 350] on rank 1 (2 x 400 > 700: two), which left
    # rank 1 alone in the MoE all-to-all of its second micro-batch
    lengths, budget = [700, 400, 350], 700
    assert [len(plan(lengths, 2, r, budget)) for r in range(2)] == [1, 2]
    for packed in (False, True):  # varlen's cost 400 + 350 > 700 as well
        plans = [plan(lengths, 2, r, budget, packed=packed, equal_counts=True) for r in range(2)]
        assert [len(p) for p in plans] == [2, 2]
        assert [mb.indices for mb in plans[0]] == [[0], []] and [mb.indices for mb in plans[1]] == [[1], [2]]


def test_equal_counts_only_appends_empty_microbatches():
    rng = random.Random(2)
    for trial in range(50):
        dp = rng.choice([2, 3, 4])
        lengths = [rng.randint(1, 100) for _ in range(rng.randint(dp, 40))]
        plain = [plan(lengths, dp, r, 128) for r in range(dp)]
        equal = [plan(lengths, dp, r, 128, equal_counts=True) for r in range(dp)]
        most = max(len(p) for p in plain)
        for a, b in zip(plain, equal):
            assert len(b) == most
            assert [mb.indices for mb in b[:len(a)]] == [mb.indices for mb in a]  # the real ones unchanged
            assert all(mb.indices == [] and mb.padded_tokens == 0 for mb in b[len(a):])
