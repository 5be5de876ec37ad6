"""Vocab-parallel (TP=2, gloo) logprobs/entropy and fused linear equal the full-vocab reference. One launch."""
from megatron_rl.distributed.launch import run_distributed
from tests.kernels import tp_bodies


def test_tp2_matches_full_vocab_reference():
    results = run_distributed(tp_bodies.tp_checks, world_size=2, timeout=300)
    # 2 impls x 3 cases x 2 dtypes, the logprob-only/gather-reference check, 2 linear variants — on both ranks
    assert results[0] == results[1]
    assert len(results[0]) == 2 * 3 * 2 + 1 + 2
