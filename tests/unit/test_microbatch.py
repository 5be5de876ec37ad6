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
