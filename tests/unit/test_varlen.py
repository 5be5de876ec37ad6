"""Varlen (THD) rows: the packed row's layout (tokens, positions, targets, cu_seqlens, padding), the packed
micro-batch plan, and cascade attention against an explicit-mask softmax attention (forward and gradients)."""
import math

import pytest
import torch

from megatron_rl.policy import batching, packing
from megatron_rl.policy.microbatch import pack_microbatches
from tests.unit.test_packing import _batch

pytest.importorskip("megatron.core")
from megatron_rl.models.varlen_attention import CascadeSeqParams, segments_of, varlen_attention  # noqa: E402


@pytest.mark.parametrize("multiple", [1, 4])
def test_varlen_row_holds_every_sequence_once(multiple):
    b = _batch()
    units = packing.plan_units(b, shared=True, max_tokens=64, multiple=multiple)
    mb = batching.varlen_row(b, units, multiple)
    assert mb.tokens.shape[0] == 1 and mb.attention_mask is None
    assert mb.tokens.shape[1] == sum(packing.unit_length(b, u, multiple) for u in units)
    assert isinstance(mb.packed, CascadeSeqParams)  # groups 0 and 1 share their prompts
    # every sequence's response targets, in `indices` order, by split_rows and by flat
    got = batching.split_rows(mb.targets, mb)
    assert sorted(mb.indices) == list(range(len(b)))
    for i, t in zip(mb.indices, got):
        assert t.tolist() == b.input_ids[i][b.prompt_lens[i]:]
    assert batching.flat(mb.targets, mb).tolist() == [x for t in got for x in t.tolist()]
    # each sequence's predicting tokens sit at its own unshared positions, and attention reaches exactly its prefix
    starts, lengths, prefix_of = segments_of(mb.packed)
    assert all(s % multiple == 0 for s in starts)
    for i, ((_, c), n) in zip(mb.indices, zip(mb.spans, mb.resp_lens)):
        p = b.prompt_lens[i]
        seg = max(k for k, s in enumerate(starts) if s <= c)
        keys = list(range(starts[seg], c + n))
        if prefix_of[seg] >= 0:
            q = prefix_of[seg]
            keys = list(range(starts[q], starts[q] + lengths[q])) + keys
        assert [mb.tokens[0, k].item() for k in keys] == b.input_ids[i][:-1]
        assert [mb.position_ids[0, k].item() for k in keys] == list(range(len(b.input_ids[i]) - 1))
        assert mb.position_ids[0, c].item() == p - 1
    # cu_seqlens: real lengths; padded starts only when segments are padded
    assert mb.packed.cu_seqlens_q.tolist() == [0] + [sum(lengths[:k + 1]) for k in range(len(lengths))]
    assert (mb.packed.cu_seqlens_q_padded is not None) == (multiple > 1)


def test_varlen_response_window_gathers_the_response_columns():
    b = _batch()
    mb = batching.varlen_row(b, packing.plan_units(b, shared=True, max_tokens=64))
    cols, view = batching.response_window(mb)
    values = torch.arange(mb.tokens.shape[1], dtype=torch.float)[None] * 10
    narrowed = values[:, cols]
    assert batching.flat(narrowed, view).tolist() == batching.flat(values, mb).tolist()
    for a, c in zip(batching.split_rows(narrowed, view), batching.split_rows(values, mb)):
        assert a.tolist() == c.tolist()


def test_packed_microbatches_use_the_total_length_as_cost():
    lengths = [30, 20, 15, 10, 5]
    bins = pack_microbatches(list(range(5)), lengths, 40, packed=True)
    assert [b.indices for b in bins] == [[0, 3], [1, 2, 4]]
    assert all(b.total <= 40 for b in bins)
    assert len(pack_microbatches(list(range(5)), lengths, 40)) == 3  # padded cost (rows x longest): 30 | 20 15 | 10 5


def test_segment_multiple_follows_megatron():
    assert packing.segment_multiple(tp=2) == 1
    assert packing.segment_multiple(tp=2, sequence_parallel=True) == 2
    assert packing.segment_multiple(tp=2, cp=2) == 4
    assert packing.segment_multiple(tp=2, cp=2, sequence_parallel=True) == 8


def _masked_reference(q, k, v, starts, lengths, prefix_of, scale):
    t = q.shape[0]
    seg = torch.full((t,), -1)
    for i, (s, n) in enumerate(zip(starts, lengths)):
        seg[s:s + n] = i
    allow = torch.zeros(t, t, dtype=torch.bool)
    for i in range(t):
        for j in range(i + 1):
            if seg[i] >= 0 and seg[j] >= 0 and (seg[i] == seg[j] or prefix_of[seg[i]] == seg[j]):
                allow[i, j] = True
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    p = torch.softmax(s.masked_fill(~allow, float("-inf")).nan_to_num(-1e30), -1) * allow.any(-1)[:, None]
    return torch.einsum("hqk,khd->qhd", p, vv).reshape(t, -1)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
def test_cascade_attention_equals_masked_attention(dtype, tol):
    torch.manual_seed(0)
    # a prefix of 5 with two completions (3 and 4 tokens, one after padding), a plain sequence, an empty prefix
    starts, lengths, prefix_of = [0, 5, 9, 13, 16], [5, 3, 4, 2, 3], [-1, 0, 0, -1, -1]
    t, hq, hk, d = 20, 4, 2, 8
    q, k, v = (torch.randn(t, h, d, dtype=dtype, requires_grad=True) for h in (hq, hk, hk))
    params = CascadeSeqParams(qkv_format="thd", prefix_of=prefix_of, starts=starts, lengths=lengths)
    scale = 1 / math.sqrt(d)
    out = varlen_attention(q, k, v, params, scale)
    ref = _masked_reference(q, k, v, starts, lengths, prefix_of, scale)
    torch.testing.assert_close(out, ref, atol=tol, rtol=0)
    g = torch.randn_like(ref)
    got = torch.autograd.grad((out * g).sum(), (q, k, v))
    want = torch.autograd.grad((ref * g).sum(), (q, k, v))
    for a, w in zip(got, want):
        torch.testing.assert_close(a, w, atol=tol * 4, rtol=0)


def test_a_one_token_prompt_group_has_no_shared_segment():
    from megatron_rl.policy.interface import RolloutBatch

    b = RolloutBatch([[7, 1, 2], [7, 3]], [1, 1], advantages=[0.0, 0.0], group_ids=[0, 0])
    mb = batching.varlen_row(b, packing.plan_units(b, shared=True, max_tokens=64))
    assert not isinstance(mb.packed, CascadeSeqParams)  # two plain causal segments: [7, 1] and [7]
    assert mb.tokens.tolist() == [[7, 1, 7]] and mb.position_ids.tolist() == [[0, 1, 0]]
    assert batching.flat(mb.targets, mb).tolist() == [1, 2, 3]


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 2e-2), (torch.float64, 1e-12)])
def test_a_group_of_adjacent_completions_against_fp64(dtype, tol):
    """A group whose completions lie back to back (their prefix part runs as one kernel call), a plain sequence
    after it; the packed row in bf16 (as the bf16 trainer runs it) and fp64 against the fp64 masked reference on
    the same inputs: bf16 within a few spacings, fp64 exactly. A prefix's key/value gradient gathers from every
    completion of its group (here 6), so a lost or double-counted contribution shows far above that."""
    torch.manual_seed(1)
    starts = [0, 7, 12, 17, 22, 27, 32, 37]
    lengths, prefix_of = [7] + [5] * 6 + [4], [-1] + [0] * 6 + [-1]
    t, hq, hk, d = 44, 4, 2, 16
    q, k, v = (torch.randn(t, h, d, dtype=dtype, requires_grad=True) for h in (hq, hk, hk))
    params = CascadeSeqParams(qkv_format="thd", prefix_of=prefix_of, starts=starts, lengths=lengths)
    scale = 1 / math.sqrt(d)
    out = varlen_attention(q, k, v, params, scale)
    assert out.dtype == dtype
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = _masked_reference(q64, k64, v64, starts, lengths, prefix_of, scale)
    torch.testing.assert_close(out.double(), ref, atol=tol, rtol=0)
    g = torch.randn(ref.shape, dtype=torch.float64)
    got = torch.autograd.grad((out.double() * g).sum(), (q, k, v))
    want = torch.autograd.grad((ref * g).sum(), (q64, k64, v64))
    for a, w in zip(got, want):
        assert a.dtype == dtype
        torch.testing.assert_close(a.double(), w, atol=3 * tol, rtol=tol)
