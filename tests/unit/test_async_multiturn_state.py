"""Async GRPO keeps rollouts sampled for later steps in its checkpoints (async_rollouts.rollout_to_state). A
multi-turn rollout's samples carry their loss masks: after the state goes through torch.save and
torch.load(weights_only=True), as a resumed run loads it, the batch built from it has the same tokens, the same
masks (observations still untrained) and the same environment metrics as the batch built before the save."""
from __future__ import annotations

import io

import torch

from megatron_rl.algorithms.advantages import SampledGroups
from megatron_rl.algorithms.async_rollouts import SampledRollout, rollout_from_state, rollout_to_state
from megatron_rl.algorithms.rollout import build_rollout
from megatron_rl.config import load_config
from megatron_rl.data.datasets import PromptItem


def _rollout() -> SampledRollout:
    item = PromptItem(prompt_ids=[1, 2, 3], prompt_text="q", answer="7", meta={"task": "chain_sum"},
                      source="reasoning_gym:chain_sum", problem=[{"role": "user", "content": "3 + 4 ="}])
    # (response ids, generator logprobs, text, finish, answer, loss mask): tool-call turn, observation, answer turn
    a = ([10, 11, 12, 20, 21, 13, 14], [-0.1, -0.2, -0.3, 0.0, 0.0, -0.4, -0.5], "call ... 7", "stop", None,
         torch.tensor([True, True, True, False, False, True, True]))
    b = ([15, 16], [-0.6, -0.7], "<answer>8</answer>", "stop", None, torch.tensor([True, True]))
    groups = SampledGroups(payloads=[(item, [a, b])], rewards=torch.tensor([[1.0, 0.0]]), rounds=1, num_drawn=1,
                           per_round_kept=[1])
    stats = {"turns_mean": 1.5, "tool_calls_mean": 0.5, "env_errors": 0, "observation_tokens": 2, "env_s": 0.01,
             "num_samples": 2, "num_truncated": 0}
    return SampledRollout(step=4, groups=groups, stats=stats, weights_step=2, sampling_s=1.5)


def test_multiturn_rollout_state_survives_a_weights_only_checkpoint():
    cfg = load_config("configs/tool_math_cpu.yaml", ["grpo.max_staleness=1", "grpo.num_generations_per_prompt=2",
                                                     "cluster.colocated=false", "cluster.devices_per_node=2"],
                      check_model=False)
    before = _rollout()
    buf = io.BytesIO()
    torch.save({"pending_rollouts": [rollout_to_state(before)]}, buf)
    buf.seek(0)
    after = rollout_from_state(torch.load(buf, weights_only=True)["pending_rollouts"][0])
    want, got = build_rollout(cfg, before.groups, dict(before.stats)), build_rollout(cfg, after.groups,
                                                                                     dict(after.stats))
    assert got.batch.input_ids == want.batch.input_ids == [[1, 2, 3, 10, 11, 12, 20, 21, 13, 14], [1, 2, 3, 15, 16]]
    assert [m.tolist() for m in got.batch.loss_mask] == [[True, True, True, False, False, True, True], [True, True]]
    assert got.batch.advantages == want.batch.advantages
    assert got.batch.num_response_tokens() == 7  # the two observation tokens are not trained tokens
    assert (after.step, after.weights_step) == (4, 2)
    assert after.groups.payloads[0][0].problem == before.groups.payloads[0][0].problem
    for k in ("turns_mean", "tool_calls_mean", "env_errors", "observation_tokens"):
        assert after.stats[k] == before.stats[k]
