"""Group-shared prefix packing (policy.shared_prefix): at DP=2, TP=2 and PP=2 the packed layout gives the same
logprobs, loss, gradient norm and updated weights as the unshared layout and as the HF + torch AdamW reference,
including length-1 completions, a group of one, a group whose prompts differ, a group over the micro-batch budget,
and full activation recompute.
"""
import pytest
import torch

from megatron_rl.models.tiny import write_tiny_hf_model
from megatron_rl.distributed.launch import run_distributed
from tests.distributed import shared_prefix_bodies

LAYOUTS = ["dp2", "tp2", "pp2"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    model_dir = str(write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "llama", "llama", seed=5))
    return run_distributed(shared_prefix_bodies.shared_vs_unshared, 2, args=(model_dir,), timeout=900)[0]


def _close_lists(got, want, atol):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(g, w, atol=atol, rtol=0, msg=lambda s: f"sequence {i}: {s}")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_packed_layout_is_used(results, layout):
    shared, plain = results[(layout, True)], results[(layout, False)]
    assert shared["enabled"] and not plain["enabled"]
    assert shared["packed_rows"] == 3 and plain["packed_rows"] == 0  # groups 0-2; group 3 has one member, 4 differs
    assert shared["row_tokens"] < plain["row_tokens"]


EXTRA = {"dp2_fallback": "dp2", "tp2_recompute": "tp2"}  # extra packed runs -> the unshared run they compare to


@pytest.mark.parametrize("layout", LAYOUTS + list(EXTRA))
def test_shared_equals_unshared(results, layout):
    shared = results[(layout, True)]
    plain = results[(EXTRA.get(layout, layout), False)]
    _close_lists(shared["logprobs"], plain["logprobs"], 1e-5)
    n = results["n"]
    _close_lists([shared["train_logprobs"][i] for i in range(n)], [plain["train_logprobs"][i] for i in range(n)], 1e-5)
    for key in ("loss", "grad_norm", "tokens"):
        assert shared["metrics"][key] == pytest.approx(plain["metrics"][key], rel=1e-5, abs=1e-7), key
    assert set(shared["after"]) == set(plain["after"])
    for k, v in shared["after"].items():
        torch.testing.assert_close(v, plain["after"][k], atol=1e-5, rtol=0, msg=lambda s: f"{layout} {k}: {s}")


@pytest.mark.parametrize("layout", LAYOUTS + list(EXTRA))
def test_shared_equals_hf_reference(results, layout):
    r = results[(layout, True)]
    _close_lists(r["logprobs"], results["ref_lps"], 1e-5)
    assert r["metrics"]["loss"] == pytest.approx(results["ref_loss"], rel=1e-5, abs=1e-7)
    assert r["metrics"]["grad_norm"] == pytest.approx(results["ref_norm"], rel=1e-5)
    ref = results["ref_state"]
    for k, v in r["after"].items():
        torch.testing.assert_close(v, ref[k], atol=2e-6, rtol=1e-5, msg=lambda s: f"{layout} {k}: {s}")


def test_over_budget_group_falls_back(results):
    # group 1 (32 packed tokens) exceeds the 24-token budget: only groups 0 and 2 stay packed
    assert results[("dp2_fallback", True)]["packed_rows"] == 2


def test_recompute_of_plain_rows_equals_hf_reference(results):
    """Activation recompute on unpacked causal rows: the backward's re-run forward trains as HF does."""
    r = results[("tp2_recompute_plain", False)]
    assert not r["enabled"]
    _close_lists(r["logprobs"], results["ref_lps"], 1e-5)
    assert r["metrics"]["loss"] == pytest.approx(results["ref_loss"], rel=1e-5, abs=1e-7)
    assert r["metrics"]["grad_norm"] == pytest.approx(results["ref_norm"], rel=1e-5)
    for k, v in r["after"].items():
        torch.testing.assert_close(v, results["ref_state"][k], atol=2e-6, rtol=1e-5, msg=lambda s: f"{k}: {s}")
