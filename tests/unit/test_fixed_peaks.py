"""The planner's fixed peaks (planner/fixed_peaks.py, issue 54): the memory the runtime's order holds at the FSDP2
load, a disaggregated refit and a distillation teacher's set-up, against numbers worked out here by hand from the
published Llama-3.1-8B shape (8,030,261,248 parameters; 128,256 x 4,096 embeddings, untied). The bytes those runtime
paths hold on CPU are bounded by tests/distributed/test_fsdp2_load.py, test_collective_refit_memory.py,
tests/unit/test_startup_residency.py and test_topk_blocks.py."""
from __future__ import annotations

import pytest

from megatron_rl.buffers import BUCKET_BYTES
from megatron_rl.planner import fixed_peaks
from megatron_rl.planner.search import resolve_model

GiB = 2**30
PARAMS = 8_030_261_248  # Llama-3.1-8B, as transformers counts it
EMBED_AND_HEAD = 2 * 128_256 * 4_096 + 4_096  # the FSDP2 root unit: embeddings, lm_head (untied), final norm


@pytest.fixture(scope="module")
def llama():
    return resolve_model("llama3.1-8b")[1]  # the preset through the trainer's config parser


def test_fsdp2_load_is_every_fp32_shard_plus_the_largest_unit_in_bf16(llama):
    for world, tp in ((8, 1), (16, 2)):
        want = (4 * PARAMS / world + 2 * EMBED_AND_HEAD / tp) / GiB
        assert fixed_peaks.fsdp2_load(llama, world, tp) == pytest.approx(want, rel=1e-9)


def test_disaggregated_refit_adds_one_bucket_on_each_end():
    got = fixed_peaks.disaggregated_refit(static_bytes=40 * GiB, vllm_w=16 * GiB, kv_bytes=50 * GiB)
    assert got == {"refit_trainer": 40 + BUCKET_BYTES / GiB, "refit_engine": 66 + BUCKET_BYTES / GiB}
    assert BUCKET_BYTES == 256 * 2**20


def test_teacher_setup_is_its_weights_and_scoring_adds_a_block(llama):
    tp, pp, tokens = 2, 2, 4096
    got = fixed_peaks.teacher(llama, tp, pp, tokens)
    weights = 2 * PARAMS / (tp * pp) / GiB
    assert got["teacher_startup"] == pytest.approx(weights, rel=1e-9)
    # an 8,192-column block of fp32 logits for 4,096 tokens and 8,192 fp32 rows of the 4,096-wide head
    assert got["teacher_scoring"] - got["teacher_startup"] == pytest.approx(4 * 8192 * (tokens + 4096) / GiB)
    beside = fixed_peaks.teacher(llama, tp, pp, tokens, beside_gib=30.0)
    assert beside["teacher_startup"] == pytest.approx(weights + 30.0)
