"""Reward-model training with a value head equals an independent reference on both backends (megatron at DP=2, TP=2,
PP=2 and DP=2 varlen; fsdp2 at DP=2 and TP=2): transformers' ForSequenceClassification scoring each sequence at its last token (its `score` set to
the worker's initial head), TRL RewardTrainer's loss (with its centring term) in plain torch, one clipped
torch.optim.AdamW step; the metrics as TRL names them. One launch for all layouts (rm_bodies.py)."""
import pytest
import torch

from megatron_rl.distributed.launch import run_distributed
from megatron_rl.models.tiny import write_tiny_hf_model
from tests.distributed import rm_bodies

LAYOUTS = ["dp2", "tp2", "pp2", "dp2_varlen", "fsdp2_dp2", "fsdp2_tp2"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    # llama with untied embeddings: the lm_head exists, so "frozen and not exported" is checked
    model = write_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "rm", "llama", seed=5,
                                config_overrides={"tie_word_embeddings": False})
    return run_distributed(rm_bodies.rm_layouts, 2, args=(str(model),), timeout=900)[0]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rm_step_equals_trl_loss_on_hf_sequence_classification(results, layout):
    ref_metrics, ref_state, ref_rewards = results["ref"]
    r = results[layout]
    m = r["metrics"]
    for k in ("loss", "grad_norm", "margin", "chosen_rewards", "rejected_rewards"):
        assert m[k] == pytest.approx(ref_metrics[k], rel=1e-5, abs=1e-6), k
    assert m["accuracy"] == pytest.approx(ref_metrics["accuracy"])
    # each sequence's reward (its last value, before the step) is HF's score of it: pairs are chosen, rejected
    n = len(ref_rewards) // 2
    want = torch.stack([ref_rewards[i // 2 + (n if i % 2 else 0)] for i in range(2 * n)])
    torch.testing.assert_close(r["rewards"], want, atol=1e-5, rtol=1e-5)
    # after the step: every HF weight, the head's included; no lm_head in a sequence classifier's weights
    after = r["after"]
    assert not r["has_lm_head"] and "score.weight" in after
    assert set(after) == set(ref_state), set(after) ^ set(ref_state)
    for k, v in after.items():
        torch.testing.assert_close(v, ref_state[k], atol=2e-6, rtol=1e-5, msg=lambda s: f"{layout} {k}: {s}")
    assert r["varlen"] == (layout == "dp2_varlen")
