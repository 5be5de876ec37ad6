"""Group-shared prefix packing: the row layout (tokens, positions, targets) and attention mask (`batching`), the unit
plan (`packing`), dense micro-batches, and position-indexed RoPE frequencies."""
import random

import pytest
import torch

from megatron_rl.policy import batching, packing
from megatron_rl.policy.interface import RolloutBatch
from megatron_rl.policy.microbatch import SequenceTooLongError


def _group(p=4, resp=(3, 1, 5), seed=0, vocab=50):
    rng = random.Random(seed)
    prompt = [rng.randrange(vocab) for _ in range(p)]
    return [prompt + [rng.randrange(vocab) for _ in range(r)] for r in resp]


def test_row_layout_of_a_group():
    seqs = [[10, 11, 12, 20, 21, 22], [10, 11, 12, 30], [10, 11, 12, 40, 41]]
    lay = batching.row_layout(seqs, 3)
    # shared P[0:2], then each segment: last prompt token + response minus its last token
    assert lay.tokens == [10, 11, 12, 20, 21, 12, 12, 40]
    assert lay.positions == [0, 1, 2, 3, 4, 2, 2, 3]
    assert lay.targets == [-1, -1, 20, 21, 22, 30, 40, 41]
    assert lay.segments == [-1, -1, 0, 0, 0, 1, 2, 2]
    assert lay.spans == [(2, 3), (5, 1), (6, 2)]
    assert len(lay.tokens) == packing.make_unit(RolloutBatch(seqs, [3, 3, 3]), [0, 1, 2]).length


def test_single_sequence_row_is_the_unshared_layout():
    ids = [5, 6, 7, 8, 9]
    lay = batching.row_layout([ids], 2)
    assert lay.tokens == ids[:-1]
    assert lay.positions == [0, 1, 2, 3]
    assert lay.targets == [-1, 7, 8, 9]
    assert lay.spans == [(1, 3)]


def test_mask_segments_see_prefix_and_themselves_causally():
    seg = torch.tensor([[-1, -1, 0, 0, 1, 2, 2, -1]])  # last column: padding
    m = batching.attention_mask(seg)[0, 0]
    allowed = ~m
    assert allowed[1].tolist() == [1, 1, 0, 0, 0, 0, 0, 0]
    assert allowed[3].tolist() == [1, 1, 1, 1, 0, 0, 0, 0]
    assert allowed[4].tolist() == [1, 1, 0, 0, 1, 0, 0, 0]  # segment 1 does not see segment 0
    assert allowed[6].tolist() == [1, 1, 0, 0, 0, 1, 1, 0]
    assert not allowed[:7, 7].any()  # nobody real sees padding


@pytest.mark.parametrize("seed", range(5))
def test_every_prediction_sees_exactly_its_unshared_context(seed):
    """For each packed query, the visible (token, position) pairs in order are the sequence's unshared prefix, and
    the target is the sequence's next token: the packed forward computes what the unshared forward computes."""
    rng = random.Random(seed)
    p = rng.randint(1, 6)
    seqs = _group(p, [rng.randint(1, 6) for _ in range(rng.randint(2, 5))], seed=seed)
    lay = batching.row_layout(seqs, p)
    allowed = ~batching.attention_mask(torch.tensor([lay.segments]))[0, 0]
    for j, (c, n) in enumerate(lay.spans):
        for k in range(n):
            q = c + k
            keys = allowed[q].nonzero().flatten().tolist()
            assert [lay.tokens[i] for i in keys] == seqs[j][:p + k]
            assert [lay.positions[i] for i in keys] == list(range(p + k))
            assert lay.targets[q] == seqs[j][p + k]


def _batch():
    g0, g1 = _group(5, (2, 1, 4), seed=1), _group(3, (6, 2), seed=2)
    odd = _group(4, (2,), seed=3) + _group(4, (3,), seed=4)  # same group id, different prompts
    ids = [g0[0], g1[0], odd[0], g0[1], g1[1], odd[1], g0[2], [1, 2, 3, 4]]
    plens = [5, 3, 4, 5, 3, 4, 5, 2]
    return RolloutBatch(ids, plens, advantages=[0.0] * 8, group_ids=[0, 1, 2, 0, 1, 2, 0, 3])


def test_plan_units_packs_groups_and_falls_back():
    b = _batch()
    def members(**kw):
        return [list(u.members) for u in packing.plan_units(**kw)]

    assert members(batch=b, shared=True, max_tokens=64) == [[0, 3, 6], [1, 4], [2], [5], [7]]
    assert members(batch=b, shared=False, max_tokens=64) == [[i] for i in range(8)]
    b_nogroups = RolloutBatch(b.input_ids, b.prompt_lens)
    assert members(batch=b_nogroups, shared=True, max_tokens=64) == [[i] for i in range(8)]
    # group 0 packs to 4 + 7 = 11 tokens, group 1 to 2 + 8 = 10: a budget of 10 keeps only group 1 packed
    assert members(batch=b, shared=True, max_tokens=10) == [[0], [1, 4], [2], [3], [5], [6], [7]]
    # fewer rows than DP ranks: everything unshared
    assert members(batch=b, shared=True, max_tokens=64, dp_size=6) == [[i] for i in range(8)]
    # lengths: (p - 1) + the responses for a group, L - 1 for one sequence
    lengths = {u.members: u.length for u in packing.plan_units(b, shared=True, max_tokens=64)}
    assert lengths[(0, 3, 6)] == 4 + 2 + 1 + 4 and lengths[(7,)] == 3


def test_plan_units_names_a_too_long_sequence():
    b = _batch()
    with pytest.raises(SequenceTooLongError, match=r"sequence 1 .*max_tokens_per_microbatch=7"):
        packing.plan_units(b, shared=True, max_tokens=7)


def test_dense_rows_keep_per_sequence_order_and_targets():
    b = _batch()
    units = packing.plan_units(b, shared=True, max_tokens=64)
    mb = batching.dense_rows(b, units)
    assert mb.indices == [0, 3, 6, 1, 4, 2, 5, 7]
    assert mb.attention_mask is not None and mb.attention_mask.shape == (5, 1, 11, 11)
    got = batching.split_rows(mb.targets, mb)
    for i, t in zip(mb.indices, got):
        assert t.tolist() == b.input_ids[i][b.prompt_lens[i]:]
    flat = batching.flat(mb.targets, mb)
    assert flat.tolist() == [x for t in got for x in t.tolist()]
    assert mb.resp_lens == [len(t) for t in got]
    # unshared rows keep positions 0..s-1 through the padding, so the model's stock RoPE path applies
    plain = batching.dense_rows(b, [packing.make_unit(b, [2]), packing.make_unit(b, [7])])
    assert plain.attention_mask is None
    assert torch.equal(plain.position_ids, torch.arange(plain.tokens.shape[1]).expand(2, -1))


def test_position_freqs_match_megatron_rotary_table():
    pytest.importorskip("megatron.core")
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_rl.policy.model_hooks import position_freqs

    for interp in (None, 2.0):
        rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_base=500,
                               seq_len_interpolation_factor=interp, use_cpu_initialization=True)
        rope.inv_freq = rope.inv_freq * torch.linspace(1.0, 0.25, 8)  # a scaled table (like llama3) must be used
        f = rope.get_freqs_non_repeated(12)
        table = torch.cat((f, f), dim=-1)  # megatron's [s, d] angles for positions 0..11
        pos = torch.tensor([[0, 1, 2, 3, 4, 5], [0, 1, 2, 2, 3, 9]])
        got = position_freqs(rope, pos)
        assert got.shape == (6, 2, 1, 16)
        for b in range(2):
            assert torch.equal(got[:, b, 0], table[pos[b]])
