"""Metric reductions go to the device the group's backend needs: one DP=2 train step under a checker that plays NCCL
on a GPU platform (see collectives_bodies.py) makes no wrongly placed collective, and a raw one is caught."""
import pytest

from megatron_rl.distributed.launch import run_distributed
from megatron_rl.models.tiny import write_tiny_hf_model
from tests.distributed import collectives_bodies


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    model_dir = str(write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "qwen2", "qwen2", seed=3))
    return run_distributed(collectives_bodies.train_step_under_nccl_checker, 2, args=(model_dir,), timeout=600)


def test_train_step_places_every_collective_for_nccl(results):
    for rank, r in enumerate(results):
        t = r["train"]
        assert t["dp"] == 2
        assert not t["rejected"], f"rank {rank}: collectives on the wrong device for NCCL:\n" + "\n".join(t["rejected"])
        # not vacuous: the DP metric reduction was seen, and went through the helper
        assert any("collectives.py" in c and "all_reduce_scalars" in c for c in t["accepted"]), t["accepted"]
    metrics = [r["train"]["metrics"] for r in results if r["train"]["metrics"]]
    assert metrics and all(m["tokens"] == pytest.approx(1.0) for m in metrics)  # summed over both DP replicas


def test_helper_reduces_on_the_platform_device(results):
    for r in results:
        assert r["helper_dict"] == {"rank": 1.0, "one": 2.0}
        assert r["helper_list"] == [2.0]
        accepted, rejected = r["helper_checked"]
        assert len(accepted) == 2 and not rejected


def test_checker_rejects_a_raw_cpu_reduction(results):
    for r in results:
        assert len(r["wrong_rejected"]) == 1
        assert "megatron_rl/_wrong_reduction.py:1" in r["wrong_rejected"][0]
