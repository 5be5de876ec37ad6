"""The megatron value head (critic / reward model) equals transformers' LlamaForSequenceClassification score at every
position, at TP=1 and TP=2, and its weight gradient equals the reference's (nothing double-counted over TP)."""
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
