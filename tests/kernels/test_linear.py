"""linear_token_logprobs: logprobs (and entropy) of hidden @ weight.T without full logits; grads for both."""
from __future__ import annotations

import pytest
import torch

from kernels import linear_token_logprobs
from kernels.reference import ref_linear_token_logprobs, ref_token_entropy
from tests.kernels.cases import IGNORE, bf16_tols


def _inputs(N=45, H=24, V=301, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g).to(dtype)
    w = (torch.randn(V, H, generator=g) * 0.7).to(dtype)
    t = torch.randint(0, V, (N,), generator=g)
    t[7] = IGNORE
    return h, w, t


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("chunk", [(16, 64), 100, None], ids=["tiled", "vocab-only", "default"])
@pytest.mark.parametrize("T", [1.0, 0.6])
@pytest.mark.parametrize("with_entropy", [False, True], ids=["lp", "lp+ent"])
def test_linear_matches_autograd_reference(dtype, chunk, T, with_entropy):
    h, w, t = _inputs(dtype=dtype)
    ha, wa = h.clone().requires_grad_(), w.clone().requires_grad_()
    # Reference: full logits in the same dtype (as an lm-head would produce them), autograd through everything.
    hb, wb = h.clone().requires_grad_(), w.clone().requires_grad_()
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(t.shape, generator=g), torch.randn(t.shape, generator=g)

    out = linear_token_logprobs(ha, wa, t, temperature=T, chunk=chunk, return_entropy=with_entropy)
    lp, ent = out if with_entropy else (out, None)
    ref_lp = ref_linear_token_logprobs(hb, wb, t, temperature=T)
    loss, ref_loss = (lp * g_lp).sum(), (ref_lp * g_lp).sum()
    if with_entropy:
        ref_ent = ref_token_entropy(hb @ wb.t(), temperature=T)
        loss, ref_loss = loss + (ent * g_ent).sum(), ref_loss + (ref_ent * g_ent).sum()
    loss.backward()
    ref_loss.backward()

    tight = dict(atol=2e-5, rtol=1e-5)
    loose = dict(atol=2e-3, rtol=1e-3)  # bf16 matmul tiles may round a few logits differently from the full gemm
    fw = tight if dtype == torch.float32 else loose
    torch.testing.assert_close(lp, ref_lp, **fw)
    assert lp[7] == 0
    if with_entropy:
        torch.testing.assert_close(ent, ref_ent, **fw)
    for ours, ref in ((ha.grad, hb.grad), (wa.grad, wb.grad)):
        assert ours.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
        else:
            torch.testing.assert_close(ours.float(), ref.float(), **bf16_tols(ref.float()))


def test_linear_leading_dims_and_only_hidden_grad():
    h, w, t = _inputs(N=24, seed=2)
    h3 = h.view(4, 6, -1).requires_grad_()
    lp = linear_token_logprobs(h3, w, t.view(4, 6), chunk=(5, 50))
    assert lp.shape == (4, 6)
    lp.sum().backward()
    hb = h.clone().requires_grad_()
    ref_linear_token_logprobs(hb, w, t).sum().backward()
    torch.testing.assert_close(h3.grad.view(24, -1), hb.grad, atol=1e-5, rtol=1e-5)
