"""The policy worker trains a tiny Qwen3-MoE at EP=2 on gloo (moe_train_bodies.py, one launch for both checks):

- with the router's load-balancing loss (policy.moe_aux_loss_coef) and zero advantages (no policy-loss gradient), one
  step moves the weights exactly as one torch AdamW step on the Switch loss recomputed from HF's router logits. Were
  the key ignored, nothing would move;
- a batch whose token-budget plan gives the two DP ranks 1 and 2 micro-batches (the EP group's all-to-all in every
  MoE layer of every micro-batch then waited forever on the rank with more) runs logprobs, a step and reference
  logprobs to completion, each equal to HF's: the padding that evens the counts changes neither the outputs nor the
  update, also with the load-balancing loss on. A hang fails the launch at its timeout;
- the same batch with every third response token masked (a multi-turn trajectory's observations) trains like HF
  with those tokens left out of the policy loss and its normaliser (the router still routes them).
"""
import pytest
import torch

from megatron_rl.distributed.launch import run_distributed
from megatron_rl.models.hf_io import HFCheckpoint
from megatron_rl.models.tiny import write_tiny_hf_model
from tests.distributed import moe_train_bodies

COEF = 0.1
TIMEOUT = 300  # the launch takes ~20 s on 2 cores; a hang (the defect) must fail, not block the suite


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(write_tiny_hf_model(tmp_path_factory.mktemp("moe") / "qwen3_moe", "qwen3_moe", seed=2))


@pytest.fixture(scope="module")
def results(model_dir):
    return run_distributed(moe_train_bodies.ep2_suite, 2, args=(model_dir, COEF), timeout=TIMEOUT)[0]


def test_aux_loss_step_equals_switch_loss_reference(results, model_dir):
    res = results["aux_loss"]
    init, (ref_norm, ref), (norm, got) = dict(HFCheckpoint(model_dir).items()), res["ref"], res["got"]
    assert norm == pytest.approx(ref_norm, rel=1e-5)  # the loss's scale (Adam's first step hides most of it)
    assert norm > 1.0  # both sides clip: the comparison covers clipping the dense + expert optimizer chain
    routers = [k for k in got if k.endswith("mlp.gate.weight")]
    assert routers and all(not torch.equal(got[k], init[k]) for k in routers)  # the loss reached every router
    assert set(got) == set(ref)
    for k, v in got.items():
        torch.testing.assert_close(v, ref[k], atol=2e-6, rtol=1e-5, msg=lambda s: f"{k}: {s}")


@pytest.mark.parametrize("packing", ["none", "varlen", "varlen_masked"])
def test_uneven_microbatch_counts_over_ep_ranks_run_and_equal_hf(results, packing):
    got, ref = results["uneven"][packing], results["uneven"]["ref_masked" if packing.endswith("masked") else "ref"]
    for name in ("logprobs", "ref_logprobs"):  # reference logprobs: the initial weights, which HF's are
        for i, want in enumerate(ref["logprobs"]):
            torch.testing.assert_close(got[name][i], want, atol=1e-5, rtol=0, msg=lambda s: f"{name}[{i}]: {s}")
    for i, want in enumerate(ref["logprobs"]):
        torch.testing.assert_close(got["train_logprobs"][i], want, atol=1e-5, rtol=0)
    m = got["metrics"]
    assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert set(got["after"]) == set(ref["after"])
    for k, v in got["after"].items():
        torch.testing.assert_close(v, ref["after"][k], atol=2e-6, rtol=1e-5, msg=lambda s: f"{k}: {s}")


def test_the_masked_reference_differs_from_the_unmasked(results):
    """So the masked comparison above would fail were the worker to train the observation tokens."""
    masked, plain = results["uneven"]["ref_masked"], results["uneven"]["ref"]
    assert abs(masked["loss"] - plain["loss"]) > 1e-4 and abs(masked["grad_norm"] - plain["grad_norm"]) > 1e-4


@pytest.fixture(scope="module")
def replay(model_dir):
    """moe_train_bodies.routing_replay on both backends (its own launch: ~25 s on 2 cores)."""
    return run_distributed(moe_train_bodies.routing_replay, 2, args=(model_dir,), timeout=TIMEOUT)[0]


@pytest.mark.parametrize("backend,mode", [("megatron", "none"), ("megatron", "varlen"), ("fsdp2", "none"),
                                          ("fsdp2", "varlen")])
def test_routing_replay_equals_hf_with_the_recorded_experts(replay, backend, mode):
    """policy.moe_routing_replay (R3), megatron at EP=2 and fsdp2 at DP=2: with the batch's record of experts
    (random ones, so most differ from the router's own top-k; none for some tokens) the trainer's logprobs - its
    logprobs pass, its training step's own and the reference pass - equal HF transformers' with its routers forced
    to those experts (gate weights from its own softmax), to the dense model's fp32 tolerance, in a shared-prefix
    row (padded with a mask, and varlen: megatron's cascade THD row, fsdp2's masked row). Without the record they
    equal HF's own routing; and the two differ, so the record was used."""
    got, forced, plain = replay[backend, mode], replay["hf_forced"], replay["hf_plain"]
    assert any(r["group_in_one_row"] for r in got["ranks"])  # on the rank that holds the group
    if mode == "none":
        assert max(r["most_rows"] for r in got["ranks"]) > 1  # the router's order [s, b] is not the rows' [b, s]
    for name in ("replay", "train", "reference"):
        for a, b in zip(got[name], forced):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=f"{backend} {mode} {name}")
    for a, b in zip(got["plain"], plain):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    assert max(float((a - b).abs().max()) for a, b in zip(forced, plain)) > 1e-2


@pytest.mark.parametrize("backend", ["megatron", "fsdp2"])
def test_routing_replay_off_routes_every_token_itself(replay, backend):
    """policy.moe_routing_replay=off: a batch's record is ignored (the logprobs are the router's own)."""
    for a, b in zip(replay[backend, "none_off"]["replay"], replay["hf_plain"]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
