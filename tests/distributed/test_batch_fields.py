"""`RolloutBatch.fields`: an algorithm's own per-token and per-sequence fields reach its loss as `LossInputs.fields`
on both backends, split over micro-batches and data-parallel ranks like the built-in fields: one step of a loss that
reads them equals the same formula in plain torch on HF logprobs (megatron DP=2 in one and in several micro-batches,
TP=2; fsdp2 DP=2). PPO's two losses ride on them: the policy's clipped surrogate with per-token advantages and the
critic's clipped value loss, each against the paper's formula written out on transformers' models (fields_bodies.py:
one launch for the fields, one for PPO)."""
import pytest
import torch

from megatron_rl.distributed.launch import run_distributed
from megatron_rl.models.tiny import write_tiny_hf_model
from megatron_rl.policy.interface import RolloutBatch
from tests.distributed import fields_bodies

LAYOUTS = ["dp2", "dp2_small_mb", "tp2", "fsdp2_dp2"]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", "qwen2", seed=7)


@pytest.fixture(scope="module")
def results(model):
    return run_distributed(fields_bodies.fields_layouts, 2, args=(str(model),), timeout=600)[0]


@pytest.fixture(scope="module")
def ppo(model):
    return run_distributed(fields_bodies.ppo_layouts, 2, args=(str(model),), timeout=600)[0]


def _same_step(r, ref, what):
    loss, norm, state = ref
    assert r["metrics"]["loss"] == pytest.approx(loss, rel=1e-5), what
    assert r["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-5), what
    assert set(r["after"]) <= set(state), set(r["after"]) - set(state)
    for k, v in r["after"].items():
        torch.testing.assert_close(v, state[k], atol=2e-6, rtol=1e-5, msg=lambda s: f"{what} {k}: {s}")


@pytest.mark.parametrize("layout", ["dp2", "fsdp2_dp2"])
def test_ppo_policy_loss_equals_the_clipped_surrogate_with_token_advantages(ppo, layout):
    """algorithms/ppo_loss.PPOPolicyLossFn (per-token GAE advantages from RolloutBatch.fields, old logprobs that
    put some ratios outside the clip) against PPO's clipped surrogate written out on HF logprobs."""
    _same_step(ppo[("policy", layout)], ppo["policy_ref"], f"policy {layout}")


@pytest.mark.parametrize("layout", ["dp2", "tp2", "fsdp2_dp2"])
def test_critic_value_loss_equals_ppo2s_clipped_value_loss(ppo, layout):
    """algorithms/ppo_loss.ValueLossFn on a value model (the critic) against PPO2's clipped value loss written out on
    transformers' sequence classifier, V_t from the hidden state before token t, its head the worker's initial one."""
    r = ppo[("value", layout)]
    _same_step(r, ppo["value_ref"], f"value {layout}")
    assert "lm_head.weight" not in r["after"] and "score.weight" in r["after"]
    assert 0.0 < r["metrics"]["value_clip_frac"] < 1.0  # the clip decided some tokens, not all


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_loss_reading_batch_fields_equals_the_reference(results, layout):
    loss, norm, state = results["ref"]
    r = results[layout]
    assert r["metrics"]["loss"] == pytest.approx(loss, rel=1e-5)
    assert r["metrics"]["grad_norm"] == pytest.approx(norm, rel=1e-5)
    for k, v in r["after"].items():
        torch.testing.assert_close(v, state[k], atol=2e-6, rtol=1e-5, msg=lambda s: f"{layout} {k}: {s}")
    if layout == "dp2_small_mb":
        assert r["micro_batches"] > 1


def test_fields_follow_subset_and_bad_lengths_are_named():
    from megatron_rl.policy.step_inputs import StepFields

    b = RolloutBatch([[1, 2, 3], [4, 5, 6, 7]], [1, 2], fields={"w": [0.5, 2.0], "t": [torch.ones(2), torch.zeros(2)]},
                     model_inputs={"pixel_values": [None, torch.full((1, 3, 2, 2), 7.0)]})
    sub = b.subset([1])
    assert sub.fields["w"] == [2.0] and torch.equal(sub.fields["t"][0], torch.zeros(2))
    assert torch.equal(sub.model_inputs["pixel_values"][0], torch.full((1, 3, 2, 2), 7.0))  # model inputs as well
    assert b.subset([0]).model_inputs == {"pixel_values": [None]}
    bad = RolloutBatch([[1, 2, 3]], [1], fields={"t": [torch.ones(3)]})
    with pytest.raises(ValueError, match=r"fields\['t'\]\[0\] has 3 values for 2 response tokens"):
        StepFields(bad)
    with pytest.raises(ValueError, match=r"fields\['w'\] has 2 entries for 1 sequences"):
        StepFields(RolloutBatch([[1, 2, 3]], [1], fields={"w": [1.0, 2.0]}))
