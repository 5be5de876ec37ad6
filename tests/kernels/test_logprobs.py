"""token_logprobs / token_entropy / token_logprobs_and_entropy vs the naive reference, forward and backward,
for both implementations (Triton through the interpreter, chunked torch)."""
from __future__ import annotations

import pytest
import torch

from kernels import token_entropy, token_logprobs, token_logprobs_and_entropy
from kernels.reference import ref_token_entropy, ref_token_logprobs
from tests.kernels.cases import IGNORE, bf16_tols, make_case

# (impl, chunk): small tiles so that every case spans several row and vocab tiles, plus each impl's default.
IMPLS = [("triton", (16, 256)), ("triton", None), ("torch", (8, 128)), ("torch", None)]
IMPL_IDS = ["triton-tiled", "triton-default", "torch-tiled", "torch-default"]


def _run_both(x, t, dtype, impl, chunk, T, mode):
    """Our op and the reference on the same (dtype-rounded) inputs with the same random upstream grads.
    The reference always runs in fp32 from those inputs. Returns (ours, ref) dicts of outputs and grads."""
    xin = x.to(dtype)
    ours_x = xin.clone().requires_grad_()
    ref_x = xin.float().requires_grad_()
    g = torch.Generator().manual_seed(1)
    g_lp, g_ent = torch.randn(t.shape, generator=g), torch.randn(t.shape, generator=g)
    kw = dict(temperature=T, impl=impl, chunk=chunk)
    out, ref = {}, {}
    if mode == "logprob":
        out["lp"] = token_logprobs(ours_x, t, **kw)
        ref["lp"] = ref_token_logprobs(ref_x, t, temperature=T)
        loss, ref_loss = (out["lp"] * g_lp).sum(), (ref["lp"] * g_lp).sum()
    elif mode == "entropy":
        out["ent"] = token_entropy(ours_x, **kw)
        ref["ent"] = ref_token_entropy(ref_x, temperature=T)
        loss, ref_loss = (out["ent"] * g_ent).sum(), (ref["ent"] * g_ent).sum()
    else:
        out["lp"], out["ent"] = token_logprobs_and_entropy(ours_x, t, **kw)
        ref["lp"] = ref_token_logprobs(ref_x, t, temperature=T)
        ref["ent"] = ref_token_entropy(ref_x, temperature=T)
        loss = (out["lp"] * g_lp + out["ent"] * g_ent).sum()
        ref_loss = (ref["lp"] * g_lp + ref["ent"] * g_ent).sum()
    loss.backward()
    ref_loss.backward()
    out["grad"], ref["grad"] = ours_x.grad, ref_x.grad
    return out, ref


def _compare(out, ref, dtype):
    for k in ("lp", "ent"):
        if k in out:
            assert out[k].dtype == torch.float32
            # same fp32 math on the same input values: tight for every input dtype
            torch.testing.assert_close(out[k], ref[k], atol=2e-5, rtol=1e-5, msg=lambda m: f"{k}: {m}")
    assert out["grad"].dtype == dtype
    assert torch.isfinite(out["grad"]).all()
    if dtype == torch.float32:
        torch.testing.assert_close(out["grad"], ref["grad"], atol=1e-5, rtol=1e-5)
    else:
        torch.testing.assert_close(out["grad"].float(), ref["grad"], **bf16_tols(ref["grad"]))


@pytest.mark.parametrize("impl,chunk", IMPLS, ids=IMPL_IDS)
@pytest.mark.parametrize("case", ["basic", "extreme", "neginf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T", [1.0, 0.7])
def test_combined_matches_reference(impl, chunk, case, dtype, T):
    x, t = make_case(case)
    _compare(*_run_both(x, t, dtype, impl, chunk, T, "both"), dtype)


@pytest.mark.parametrize("impl,chunk", IMPLS[::2], ids=IMPL_IDS[::2])
@pytest.mark.parametrize("mode", ["logprob", "entropy"])
@pytest.mark.parametrize("case", ["basic", "neginf"])
def test_single_output_paths(impl, chunk, mode, case):
    """Only one output used: the backward kernels' single-term branches (no g_ent / no g_lp)."""
    x, t = make_case(case, N=29, V=777, seed=3)
    _compare(*_run_both(x, t, torch.float32, impl, chunk, 1.3, mode), torch.float32)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_fp16_and_leading_dims(impl):
    x, t = make_case("basic", N=24, V=515, seed=5)
    x3, t3 = x.view(2, 12, 515), t.view(2, 12)
    out, ref = _run_both(x3, t3, torch.float16, impl, None, 0.9, "both")
    assert out["lp"].shape == (2, 12) and out["ent"].shape == (2, 12)
    _compare(out, ref, torch.float16)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_strided_logits(impl):
    """A row-strided view (e.g. logits[..., :V] of a padded buffer) and a non-unit vocab stride both work."""
    wide, t = make_case("basic", N=20, V=640, seed=7)
    x = wide[:, :600]
    t = t % 600
    assert not x.is_contiguous()
    torch.testing.assert_close(token_logprobs(x, t, impl=impl), ref_token_logprobs(x, t), atol=2e-5, rtol=1e-5)
    xt = x.t().contiguous().t()  # vocab stride != 1
    torch.testing.assert_close(token_entropy(xt, impl=impl), ref_token_entropy(x), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_ignore_index_gives_zero_and_no_grad(impl):
    x, t = make_case("basic", N=16, V=300, seed=9)
    t = t.abs()  # drop the case's own ignored token; ignore exactly the even rows
    t[::2] = IGNORE
    xg = x.clone().requires_grad_()
    lp = token_logprobs(xg, t, impl=impl)
    assert (lp[::2] == 0).all() and (lp[1::2] < 0).all()
    lp.sum().backward()
    assert (xg.grad[::2] == 0).all()
    torch.testing.assert_close(xg.grad[1::2].sum(-1), torch.zeros(8), atol=1e-5, rtol=0)  # sum(onehot - p) = 0


@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_vocab_start_index_outside_shard(impl):
    """Targets outside [vocab_start, vocab_start + V_local) add nothing locally (single-process view of a shard)."""
    x, t = make_case("basic", N=12, V=200, seed=11)
    shard_lp = token_logprobs(x, torch.where(t < 0, t, t + 1000), vocab_start_index=1000, impl=impl)
    torch.testing.assert_close(shard_lp, ref_token_logprobs(x, t), atol=2e-5, rtol=1e-5)
    # targets all in another shard: zt = 0, so logprob = -logsumexp of this shard
    lp = token_logprobs(x, torch.full_like(t, 5000), vocab_start_index=1000, impl=impl)
    torch.testing.assert_close(lp, -torch.logsumexp(x, -1), atol=2e-5, rtol=1e-5)


def test_impls_agree_bitwise_close_on_bf16_grad():
    """Both implementations produce the same bf16 gradient (up to one bf16 rounding step)."""
    x, t = make_case("extreme", N=33, V=513, seed=13)
    grads = []
    for impl in ("triton", "torch"):
        xg = x.to(torch.bfloat16).requires_grad_()
        lp, ent = token_logprobs_and_entropy(xg, t, impl=impl, temperature=0.8)
        (lp.sum() + 0.1 * ent.sum()).backward()
        grads.append(xg.grad.float())
    torch.testing.assert_close(grads[0], grads[1], atol=1e-2 * grads[1].abs().max().item(), rtol=1e-2)
