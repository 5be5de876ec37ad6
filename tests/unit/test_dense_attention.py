"""Unpacked rows through torch's fused attention (`varlen_attention.dense_attention`, what megatron's local core
attention runs on CPU) against an explicit fp64 softmax attention: causal rows, block-masked group rows with a
padding row that may attend nothing, grouped-query heads; forward and gradients of query, key and value."""
import math

import pytest
import torch

pytest.importorskip("megatron.core")
from megatron_rl.models.varlen_attention import dense_attention  # noqa: E402


def _reference(q, k, v, allow):
    """[s, b, h, d] in fp64 with `allow` [b, s, s] (True = may attend); rows allowed nothing give 0."""
    q, k, v = (x.double().permute(1, 2, 0, 3) for x in (q, k, v))
    hq, hk = q.shape[1], k.shape[1]
    k, v = k.repeat_interleave(hq // hk, 1), v.repeat_interleave(hq // hk, 1)
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allow[:, None], float("-inf"))
    p = torch.softmax(scores, -1).nan_to_num(0.0)
    return (p @ v).permute(2, 0, 1, 3).flatten(2)


def _block_allow(s: int, b: int):
    """Row 0: a prompt of 5 tokens, then two completions that each see the prompt and themselves causally, then 2
    padding positions that see nothing. Row 1: plain causal."""
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    allow = causal.repeat(b, 1, 1)
    a = torch.zeros(s, s, dtype=torch.bool)
    a[:5, :5] = causal[:5, :5]
    a[5:9, :5] = True
    a[5:9, 5:9] = causal[:4, :4]
    a[9:s - 2, :5] = True
    a[9:s - 2, 9:s - 2] = causal[:s - 11, :s - 11]
    allow[0] = a
    return allow


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads", [(4, 4), (6, 2)])
@pytest.mark.parametrize("masked", [False, True])
def test_dense_attention_equals_explicit_softmax(dtype, tol, heads, masked):
    torch.manual_seed(0)
    s, b, d = 16, 2, 32
    hq, hk = heads
    q = torch.randn(s, b, hq, d, dtype=dtype, requires_grad=True)
    k = torch.randn(s, b, hk, d, dtype=dtype, requires_grad=True)
    v = torch.randn(s, b, hk, d, dtype=dtype, requires_grad=True)
    allow = _block_allow(s, b) if masked else torch.ones(s, s, dtype=torch.bool).tril().repeat(b, 1, 1)
    mask = ~allow[:, None] if masked else None  # megatron's convention: True = masked, [b, 1, s, s]
    out = dense_attention(q, k, v, mask, causal=not masked, scale=1 / math.sqrt(d))
    ref = _reference(q, k, v, allow)
    real = allow.any(-1).T  # [s, b]: rows that attend something (the padding rows' outputs are nobody's input)
    assert out.shape == (s, b, hq * d)
    assert torch.isfinite(out).all()
    assert (out.double() - ref)[real].abs().max() < tol
    g = torch.randn(s, b, hq * d, dtype=torch.float64) * real[..., None]
    grads = torch.autograd.grad((out.double() * g).sum(), (q, k, v))
    want = torch.autograd.grad((ref * g).sum(), (q, k, v))
    for got, exp in zip(grads, want):
        assert torch.isfinite(got).all()
        scale = exp.abs().max().item()
        assert (got.double() - exp).abs().max() < tol * max(1.0, scale) * 4
