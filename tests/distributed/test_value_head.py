"""The megatron value head (critic / reward model) equals transformers' LlamaForSequenceClassification score at every
position, at TP=1, TP=2 and PP=2 (the last stage's head), and its weight gradient equals the reference's (nothing double-counted over TP)."""
import pytest

from megatron_rl.distributed.launch import run_distributed
from tests.distributed import value_head_bodies

ATOL = 1e-4


@pytest.fixture(scope="module")
def results():
    return run_distributed(value_head_bodies.value_head_parity, world_size=2)


@pytest.mark.parametrize("tp", [1, 2])
def test_values_and_head_gradient_equal_hf(results, tp):
    for r in results:
        assert r[f"tp{tp}"] <= ATOL and r[f"tp{tp}_grad"] <= 1e-3 and r[f"tp{tp}_lm_head_frozen"]
        assert r[f"tp{tp}_norm_grad"] <= 1e-4, r  # relative: the decoder's gradient through the head, exact


def test_pp2_the_last_stage_scores_like_hf(results):
    last = [r for r in results if r["pp2_has_head"]]
    assert len(last) == 1 and "pp2" in last[0] and last[0]["pp2"] <= ATOL
