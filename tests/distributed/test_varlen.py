"""Varlen (THD) packing and cascade shared-prefix attention (policy.packing: varlen, policy.shared_prefix): at DP=2,
TP=2 and PP=2 the logprobs, loss, gradient norm and updated weights equal the unpacked HF + torch AdamW reference;
also with padded segments (megatron's cu_seqlens_padded) and with full activation recompute; and with a loss mask
(multi-turn observation tokens) at DP=2, unpacked and varlen + cascade.
"""
import pytest
import torch

from megatron_rl.distributed.launch import run_distributed
from megatron_rl.models.tiny import write_tiny_hf_model
from tests.distributed import varlen_bodies

MASKED = ["dp2_masked", "dp2_cascade_masked"]
FAST = ["dp2_varlen", "tp2_cascade", "tp2_cascade_unfused", "pp2_cascade", *MASKED]
SLOW = [n for n in varlen_bodies.LAYOUTS if n not in FAST]


def _launch(tmp_path_factory, names):
    model_dir = str(write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=5))
    return run_distributed(varlen_bodies.varlen_vs_reference, 2, args=(model_dir, names), timeout=900)[0]


@pytest.fixture(scope="module")
def fast(tmp_path_factory):
    return _launch(tmp_path_factory, FAST)


@pytest.fixture(scope="module")
def slow(tmp_path_factory):
    return _launch(tmp_path_factory, SLOW)


def _close_lists(got, want, atol):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=atol, rtol=0, msg=lambda s: f"sequence {i}: {s}")


def _check_layout(res, name):
    r = res[name]
    assert r["fused"] == (not name.endswith("_unfused"))  # the fused head is the default on the last stage
    assert r["varlen"] and all(b == 1 for b, _ in r["rows"]), r["rows"]  # one packed THD row per micro-batch
    assert len(r["rows"]) >= 2 and all(s <= varlen_bodies.BUDGET for _, s in r["rows"])
    assert r["cascade_rows"] > 0 if r["shared"] else r["cascade_rows"] == 0
    if name.endswith("pad4"):  # every segment padded to 4: megatron's padded cu_seqlens on every row
        assert r["padded"] == len(r["rows"]) and all(s % 4 == 0 for _, s in r["rows"])
    elif r["shared"]:
        assert r["padded"] == 0 and r["tokens"] < res["sequence_tokens"]  # prompts computed once per group
    else:
        assert r["padded"] == 0 and r["tokens"] == res["sequence_tokens"]  # packed: no padding at all


def _check_reference(res, name):
    r = res[name]
    _close_lists(r["logprobs"], res["ref_lps"], 1e-5)
    _close_lists([r["train_logprobs"][i] for i in range(res["n"])], res["ref_lps"], 1e-5)
    assert r["metrics"]["loss"] == pytest.approx(res["ref_loss"], rel=1e-5, abs=1e-7)
    assert r["metrics"]["grad_norm"] == pytest.approx(res["ref_norm"], rel=1e-5)
    ref = res["ref_state"]
    assert r["after"] and set(r["after"]) <= set(ref)  # HF lists the tied lm_head too
    for k, v in r["after"].items():
        torch.testing.assert_close(v, ref[k], atol=2e-6, rtol=1e-5, msg=lambda s: f"{name} {k}: {s}")


@pytest.mark.parametrize("name", [n for n in FAST if n not in MASKED])
def test_varlen_layout_is_used(fast, name):
    _check_layout(fast, name)


@pytest.mark.parametrize("name", [n for n in FAST if n not in MASKED])
def test_varlen_equals_hf_reference(fast, name):
    _check_reference(fast, name)


@pytest.mark.parametrize("name", MASKED)
def test_masked_tokens_are_left_out_of_the_loss_and_its_normaliser(fast, name):
    """Observation tokens are context: the step equals the reference whose loss and normaliser leave them out (so
    their gradient is exactly zero), and that reference is not the unmasked one (the mask matters here)."""
    ref = fast["masked_ref"]
    assert ref["ref_loss"] != pytest.approx(fast["ref_loss"], rel=1e-3)
    assert ref["ref_norm"] != pytest.approx(fast["ref_norm"], rel=1e-3)
    r = fast[name]
    assert r["varlen"] == (name == "dp2_cascade_masked") and r["shared"] == (name == "dp2_cascade_masked")
    _check_reference({**ref, name: r}, name)


@pytest.mark.slow
@pytest.mark.parametrize("name", SLOW)
def test_more_varlen_layouts_equal_hf_reference(slow, name):
    _check_layout(slow, name)
    _check_reference(slow, name)
