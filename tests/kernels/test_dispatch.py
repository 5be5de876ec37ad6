"""Implementation choice: kwarg > $MEGATRON_RL_LOGPROB_IMPL > device default; clear errors otherwise."""
from __future__ import annotations

import pytest
import torch

import kernels
from kernels import IMPL_ENV, choose_impl, token_logprobs


def test_default_is_torch_on_cpu(monkeypatch):
    monkeypatch.delenv(IMPL_ENV, raising=False)
    assert choose_impl(torch.zeros(2, 3)) == "torch"


def test_env_and_kwarg_override(monkeypatch):
    monkeypatch.setenv(IMPL_ENV, "triton")  # usable on CPU here because conftest set TRITON_INTERPRET=1
    assert choose_impl(torch.zeros(2, 3)) == "triton"
    assert choose_impl(torch.zeros(2, 3), "torch") == "torch"
    monkeypatch.setenv(IMPL_ENV, "cuda-magic")
    with pytest.raises(ValueError, match="unknown logprob impl"):
        choose_impl(torch.zeros(2, 3))


def test_triton_on_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        choose_impl(torch.zeros(2, 3), "triton")


def test_env_var_routes_the_public_api(monkeypatch):
    calls = []
    from kernels import triton_logprobs

    real = triton_logprobs.row_stats
    monkeypatch.setattr(triton_logprobs, "row_stats", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setenv(IMPL_ENV, "triton")
    token_logprobs(torch.randn(4, 50), torch.randint(0, 50, (4,)))
    assert calls == [1]


def test_input_validation():
    with pytest.raises(TypeError):
        token_logprobs(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), temperature=0.0)
    with pytest.raises(ValueError, match="targets shape"):
        token_logprobs(torch.zeros(2, 3), torch.zeros(3, dtype=torch.long))


def test_public_api():
    assert {"token_logprobs", "token_entropy", "token_logprobs_and_entropy",
            "linear_token_logprobs"} <= set(kernels.__all__)


def test_empty_input():
    for impl in ("torch", "triton"):
        x = torch.zeros(0, 7, requires_grad=True)
        lp, ent = kernels.token_logprobs_and_entropy(x, torch.zeros(0, dtype=torch.long), impl=impl)
        assert lp.shape == (0,) and ent.shape == (0,)
        (lp.sum() + ent.sum()).backward()
        assert x.grad.shape == (0, 7)
