"""MoE routing replay's bookkeeping (no model): the engine's per-sample records as full-sequence records
(algorithms/routing_records.py), laid out like a micro-batch's rows (policy/routing_replay.routing_rows), and merged
over engines (generation/pool.py)."""
import torch

from megatron_rl.algorithms.routing_records import (
    fill_shared_prefixes, recorded_fraction, sample_records, sequence_record,
)
from megatron_rl.generation.interface import GenerationResult
from megatron_rl.generation.pool import _merge
from megatron_rl.policy import batching, packing
from megatron_rl.policy.interface import RolloutBatch
from megatron_rl.policy.routing_replay import replayed_topk, routing_rows

L, K = 2, 2


def rec(n: int, base: int) -> torch.Tensor:
    """n tokens' [layers, k] experts, distinct per token: base + 10 * token + layer, repeated over k."""
    return (base + 10 * torch.arange(n)[:, None, None] + torch.arange(L)[None, :, None]).repeat(1, 1, K).short()


def test_cached_prompt_tokens_take_the_experts_of_the_request_that_ran_them():
    p0, p1 = [5, 6, 7, 8], [5, 6, 9]  # p1 shares p0's first two tokens (a common preamble)
    prompts, completions = [p0, p0, p1], [[1, 2, 3], [4, 4], [7, 7]]
    starts = [0, 4, 2]  # sample 1: the whole prompt from the cache; sample 2: the shared preamble
    records = [rec(6, 0), rec(1, 500), rec(2, 900)]  # the engine ran tokens start .. len - 2
    full = sample_records(prompts, completions, starts, records)
    assert [r.shape[0] for r in full] == [7, 6, 5] and all(r.dtype == torch.int16 for r in full)
    torch.testing.assert_close(full[0][:6], records[0])
    torch.testing.assert_close(full[1][:4], records[0][:4])  # the sibling's prompt
    torch.testing.assert_close(full[1][4], records[1][0])
    torch.testing.assert_close(full[2][:2], records[0][:2])  # the preamble, from the request that ran it
    torch.testing.assert_close(full[2][2:4], records[2])
    assert all(bool((r[-1] == -1).all()) for r in full)  # the last token: never run, never fed
    assert recorded_fraction(full) == 1.0


def test_a_prefix_nobody_in_the_call_ran_stays_unknown():
    full = sample_records([[5, 6, 7]], [[1, 2]], [2], [rec(2, 0)])
    assert bool((full[0][:2] == -1).all()) and recorded_fraction(full) == 2 / 4


def test_a_trajectorys_turns_join_into_one_record_the_first_run_of_a_position_kept():
    """Multi-turn: turn 1 ran positions 0-5 (prompt 0-3, its completion 4-6, the last never run); turn 2's prompt is
    all that plus an observation (7-8), served from the cache up to position 4, and ran 4-10: positions 4-5 keep turn
    1's experts (the tokens it sampled), 6-10 are turn 2's."""
    t1, t2 = rec(6, 0), rec(7, 500)
    full = sequence_record(12, [(0, t1), (4, t2)])
    torch.testing.assert_close(full[:6], t1)
    torch.testing.assert_close(full[6:11], t2[2:])
    assert bool((full[11] == -1).all()) and full.dtype == torch.int16
    # a segment past the sequence's end (a record longer than what the trainer keeps) is cut, not an error
    assert sequence_record(3, [(1, rec(5, 0))]).shape == (3, L, K)


def test_shared_prefixes_fill_across_whole_sequences_never_across_a_difference():
    a, b, c = [1, 2, 3, 4], [1, 2, 3, 9], [7, 2, 3, 4]
    ra, rb, rc = sequence_record(4, [(0, rec(3, 0))]), sequence_record(4, [(3, rec(1, 500))]), \
        sequence_record(4, [(3, rec(1, 900))])
    fill_shared_prefixes([a, b, c], [ra, rb, rc])
    torch.testing.assert_close(rb[:3], ra[:3])  # b's cached prefix: a ran it
    assert bool((rc[:3] == -1).all())  # c differs at position 0: no donor, though its later tokens equal a's


def test_routing_rows_follow_each_position_to_its_token():
    """Shared-prefix padded rows and a varlen row: each position's record is its own token's (the group's prompt
    from the first member)."""
    ids = [[3, 4, 5, 6, 7], [3, 4, 5, 9], [8, 8, 8]]
    full = [rec(5, 0), rec(4, 100), rec(3, 200)]
    full[1][:3] = full[0][:3]
    batch = RolloutBatch(input_ids=ids, prompt_lens=[3, 3, 2], group_ids=[0, 0, 1], routed_experts=full)
    for varlen in (False, True):
        [plan] = packing.plan_microbatches(batch, shared=True, varlen=varlen, max_tokens=64, dp_size=1, dp_rank=0)
        mb = batching.rows(batch, plan, varlen=varlen, thd=False)
        got = routing_rows(batch.routed_experts, mb)
        assert got.shape == (*mb.tokens.shape, L, K)
        for r in range(mb.tokens.shape[0]):
            for c in range(mb.tokens.shape[1]):
                i, j = int(mb.source[r, c]), int(mb.position_ids[r, c])
                want = torch.full((L, K), -1) if i < 0 else full[i][j].long()
                assert torch.equal(got[r, c], want), (varlen, r, c)
                if i >= 0:
                    assert ids[i][j] == int(mb.tokens[r, c])  # the source names the token the position holds


def test_replayed_topk_keeps_the_routers_choice_where_nothing_is_recorded():
    own = torch.tensor([[0, 1], [2, 3], [1, 2]])
    target = torch.tensor([[3, 2], [-1, -1], [0, -1]])  # a partial row counts as unrecorded
    assert replayed_topk(target, own).tolist() == [[3, 2], [2, 3], [1, 2]]
    assert replayed_topk(None, own) is own


def test_pool_merge_keeps_each_samples_record():
    def result(tokens, starts):
        r = GenerationResult(tokens, [[0.0] * len(t) for t in tokens], ["stop"] * len(tokens),
                             list(range(len(tokens))), 1, 3)
        r.routing_start, r.routed_experts = starts, [rec(len(t), 7 * s) for t, s in zip(tokens, starts)]
        return r

    a, b = result([[1], [2, 2]], [0, 1]), result([[3, 3, 3]], [2])
    out = _merge([a, b], [[0, 2], [1]], 3, 1, 3)
    assert out.token_ids == [[1], [3, 3, 3], [2, 2]] and out.routing_start == [0, 2, 1]
    assert [torch.equal(x, y) for x, y in zip(out.routed_experts, [a.routed_experts[0], b.routed_experts[0],
                                                                   a.routed_experts[1]])] == [True] * 3
