"""The distributed harness runs real megatron-core on gloo: TP=2 and PP=2 equal TP=1."""
import pytest
import torch

from megatron_rl.distributed.launch import run_distributed
from tests.distributed import foundation_bodies


@pytest.fixture(scope="module")
def results():
    return run_distributed(foundation_bodies.tp_and_pp_equivalence, world_size=2)


def test_tp2_per_token_losses_equal_tp1(results):
    for r in results:
        assert r["tp_losses"].shape == r["ref_losses"].shape
        torch.testing.assert_close(r["tp_losses"], r["ref_losses"], atol=1e-5, rtol=0)
        assert r["tp_grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)


def test_pp2_loss_and_grad_norm_equal_pp1(results):
    last = [r for r in results if r["pp_stage"] == 1][0]
    torch.testing.assert_close(last["pp_losses"], last["ref_losses"], atol=1e-5, rtol=0)
    for r in results:
        assert r["pp_grad_norm"] == pytest.approx(r["ref_grad_norm"], rel=1e-5)


def test_harness_reports_rank_failure():
    with pytest.raises(RuntimeError, match="rank 1"):
        run_distributed(foundation_bodies.fail_on_rank_one, world_size=2, timeout=120)
