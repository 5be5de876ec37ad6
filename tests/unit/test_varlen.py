"""Varlen (THD) rows: the packed row's layout (tokens, positions, targets, cu_seqlens, padding), the packed
micro-batch plan, and cascade attention against an explicit-mask softmax attention (forward and gradients)."""
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rl.policy import batching, packing
from megatron_rl.policy.microbatch import pack_microbatches
from tests.unit.test_packing import _batch

pytest.importorskip("megatron.core")
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402

from megatron_rl.models.varlen_attention import CascadeSeqParams, segments_of, varlen_attention  # noqa: E402


@pytest.mark.parametrize("multiple", [1, 4])
def test_varlen_row_holds_every_sequence_once(multiple):
    b = _batch()
    units = packing.plan_units(b, shared=True, max_tokens=64, multiple=multiple)
    mb = batching.varlen_row(b, units, multiple)
    assert mb.tokens.shape[0] == 1 and mb.attention_mask is None
    # the row holds what the plan counted: each unit's segments padded to the multiple, re-derived from the lengths
    up = lambda n: -(-n // multiple) * multiple  # noqa: E731
    expect = 0
    for u in units:
        p, resp = b.prompt_lens[u.members[0]], [len(b.input_ids[i]) - b.prompt_lens[i] for i in u.members]
        expect += up(p - 1 + resp[0]) if len(resp) == 1 else up(p - 1) + sum(up(r) for r in resp)
    assert mb.tokens.shape[1] == expect == sum(u.length for u in units)
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


class _MemEffKernelStandIn(TorchDispatchMode):
    """Stands in for torch's memory-efficient CUDA attention on `meta` tensors: checks every call's arguments
    against what the CUDA kernel reads (torch's attention_backward.cu and mem_eff_attention/kernel_backward.h),
    and answers with empty tensors of the kernel's shapes (torch's own meta kernel of the backward does not take
    today's `out` argument). Every other op runs as usual."""

    def __init__(self):
        super().__init__()
        self.calls = {"forward": 0, "backward": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._efficient_attention_forward.default:
            # q, k, v [b, s, h, d]: the kernel takes their batch, row and head strides; the last dim must be dense
            assert all(x.stride(-1) == 1 for x in args[:3]), [x.stride() for x in args[:3]]
            self.calls["forward"] += 1
            return func(*args, **kwargs)  # torch's meta kernel: out [b, s, h, d], lse [b, h, s padded to 32]
        if func is torch.ops.aten._efficient_attention_backward.default:
            do, q, k, v, _, out = args[:6]
            lse, max_q, max_k = args[10], args[8], args[9]
            b, s, h, d = q.shape
            assert out.shape == do.shape == (b, s, h, v.shape[-1]) and (max_q, max_k) == (s, k.shape[1])
            assert all(x.stride(-1) == 1 for x in (q, k, v, do, out))
            # the kernel's computeDelta (bf16/fp16) reads row m of `out` at m * h * d (o_strideM() is hard-coded,
            # only out's batch and head strides are passed); torch copies a non-dense grad_out itself, which per
            # segment is a copy of the whole slice, so both must come as dense [b, s, h, d] rows
            for name, x in (("out", out), ("grad_out", do)):
                assert x.stride(1) == h * x.shape[-1], f"{name} {tuple(x.shape)} strides {x.stride()}: row stride " \
                                                      f"{x.stride(1)}, the kernel reads rows of {h * x.shape[-1]}"
            # lse: fp32 [b, h, >= s], padded to whole blocks of 32 queries (as the forward returns it), rows dense
            assert lse.dtype == torch.float32 and lse.shape[:2] == (b, h) and lse.shape[-1] >= s
            assert lse.shape[-1] % 32 == 0 and lse.is_contiguous(), (lse.shape, lse.stride())
            self.calls["backward"] += 1
            return (*(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in (q, k, v)),
                    torch.empty(0, device=q.device))
        return func(*args, **kwargs)


@pytest.mark.parametrize("row", ["varlen", "cascade"])
def test_the_cuda_branch_hands_the_kernel_its_layout(row):
    """Guards the CUDA branch of the packed-row attention (no CPU test reaches it otherwise): on `meta` tensors
    (device type not "cpu") the forward and backward call torch's memory-efficient kernel, whose arguments are
    checked against the layout the CUDA kernel assumes. A [1, h, t, d] concatenation of the outputs, sliced per
    segment, has row stride d, not h * d: bf16 Delta = rowsum(dO * O) then reads the wrong rows (silently wrong
    gradients, or an illegal address). bf16 as the DeepScaleR configs run it; a plain varlen row of padded
    segments, and a cascade row (a prefix, its adjacent completions, one after padding, a plain sequence)."""
    t, hq, hk, d = 48, 4, 2, 16
    if row == "varlen":  # megatron's own params: real and padded cu_seqlens (host tensors, the row on the device)
        real, padded = [0, 5, 12, 15, 24], [0, 8, 16, 24, 40]
        params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=torch.tensor(real, dtype=torch.int32),
                                 cu_seqlens_q_padded=torch.tensor(padded, dtype=torch.int32))
        calls = {"forward": 4, "backward": 4}
    else:
        params = CascadeSeqParams(qkv_format="thd", prefix_of=[-1, 0, 0, 0, -1], starts=[0, 7, 12, 24, 40],
                                  lengths=[7, 5, 6, 9, 5])
        calls = {"forward": 7, "backward": 7}  # 5 own parts; the prefix part once per run of adjacent completions
    q, k, v = (torch.randn(t, h, d, dtype=torch.bfloat16, device="meta", requires_grad=True) for h in (hq, hk, hk))
    with _MemEffKernelStandIn() as kernel:
        out = varlen_attention(q, k, v, params, 1 / math.sqrt(d))
        grads = torch.autograd.grad((out * torch.randn_like(out)).sum(), (q, k, v))
    assert out.shape == (t, hq * d) and out.dtype == torch.bfloat16
    assert [(g.shape, g.dtype) for g in grads] == [(x.shape, x.dtype) for x in (q, k, v)]
    assert kernel.calls == calls
