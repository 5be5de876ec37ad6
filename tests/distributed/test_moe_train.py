"""The policy worker trains a tiny Qwen3-MoE at EP=2 on gloo with the router's load-balancing loss
(policy.moe_aux_loss_coef): with zero advantages (no policy-loss gradient) one step moves the weights exactly as one
torch AdamW step on the Switch loss recomputed from HF's router logits (moe_train_bodies.py). Were the key ignored,
nothing would move. Slow (15-18 s): the default suite's MoE budget goes to test_moe_grpo.py, whose CLI run has the
loss on too."""
import pytest
import torch

from megatron_rl.distributed.launch import run_distributed
from megatron_rl.models.hf_io import HFCheckpoint
from megatron_rl.models.tiny import write_tiny_hf_model
from tests.distributed import moe_train_bodies


@pytest.mark.slow
def test_aux_loss_step_equals_switch_loss_reference(tmp_path):
    model_dir = str(write_tiny_hf_model(tmp_path / "qwen3_moe", "qwen3_moe", seed=2))
    res = run_distributed(moe_train_bodies.aux_loss_step, 2, args=(model_dir, 0.1), timeout=600)[0]
    init, (ref_norm, ref), (norm, got) = dict(HFCheckpoint(model_dir).items()), res["ref"], res["got"]
    assert norm == pytest.approx(ref_norm, rel=1e-5)  # the loss's scale (Adam's first step hides most of it)
    assert norm > 1.0  # both sides clip: the comparison covers clipping the dense + expert optimizer chain
    routers = [k for k in got if k.endswith("mlp.gate.weight")]
    assert routers and all(not torch.equal(got[k], init[k]) for k in routers)  # the loss reached every router
    assert set(got) == set(ref)
    for k, v in got.items():
        torch.testing.assert_close(v, ref[k], atol=2e-6, rtol=1e-5, msg=lambda s: f"{k}: {s}")
