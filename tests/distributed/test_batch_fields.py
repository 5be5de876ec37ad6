"""`RolloutBatch.fields`: an algorithm's own per-token and per-sequence fields reach its loss as `LossInputs.fields`
on both backends, split over micro-batches and data-parallel ranks like the built-in fields: one step of a loss that
reads them equals the same formula in plain torch on HF logprobs (megatron DP=2 in one and in several micro-batches,
TP=2; fsdp2 DP=2). One launch for all layouts (fields_bodies.py)."""
import pytest
import torch

from megatron_rl.distributed.launch import run_distributed
from megatron_rl.models.tiny import write_tiny_hf_model
from megatron_rl.policy.interface import RolloutBatch
from tests.distributed import fields_bodies

LAYOUTS = ["dp2", "dp2_small_mb", "tp2", "fsdp2_dp2"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    model = write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "m", "qwen2", seed=7)
    return run_distributed(fields_bodies.fields_layouts, 2, args=(str(model),), timeout=600)[0]


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

    b = RolloutBatch([[1, 2, 3], [4, 5, 6, 7]], [1, 2], fields={"w": [0.5, 2.0], "t": [torch.ones(2), torch.zeros(2)]})
    sub = b.subset([1])
    assert sub.fields["w"] == [2.0] and torch.equal(sub.fields["t"][0], torch.zeros(2))
    bad = RolloutBatch([[1, 2, 3]], [1], fields={"t": [torch.ones(3)]})
    with pytest.raises(ValueError, match=r"fields\['t'\]\[0\] has 3 values for 2 response tokens"):
        StepFields(bad)
    with pytest.raises(ValueError, match=r"fields\['w'\] has 2 entries for 1 sequences"):
        StepFields(RolloutBatch([[1, 2, 3]], [1], fields={"w": [1.0, 2.0]}))
