"""Console warnings for GRPO steps that teach nothing or less than they seem (`algorithms/step_warnings.py`): each
names the config key that changes it, and a long run is not flooded."""
from __future__ import annotations

import io

from megatron_rl import load_config
from megatron_rl.algorithms.step_warnings import REPEAT, WarningGate, step_warnings

OK = {"step": 3, "num_sequences": 8, "truncated_frac": 0.25, "reward_mean": 0.5, "reward_std": 0.4, "grad_norm": 1.2,
      "no_trainable_groups": False}


def test_a_healthy_step_warns_nothing():
    assert step_warnings(OK, load_config({}, [])) == {}


def test_environment_errors_quote_the_first_one():
    cfg = load_config({}, ["environment.cls=tests.integration.multiturn_envs:Turns"])
    w = step_warnings({**OK, "env_errors": 5, "env_error_first": "c0-0-1: garbage: reset() returned str"}, cfg)
    assert list(w) == ["env_errors"]
    assert "5 trajectories ended in an environment error" in w["env_errors"]
    assert "garbage: reset() returned str" in w["env_errors"] and "samples.jsonl" in w["env_errors"]


def test_most_completions_truncated_names_the_limit():
    cfg = load_config({}, ["generation.max_new_tokens=32", "generation.temperature=1.3"])
    w = step_warnings({**OK, "truncated_frac": 0.875}, cfg)
    assert list(w) == ["truncated"]
    assert "88% of completions were cut off by generation.max_new_tokens=32" in w["truncated"]
    assert "temperature 1.3" in w["truncated"]
    assert step_warnings({**OK, "truncated_frac": 0.4}, cfg) == {}  # a few cut answers are normal
    # multi-turn: the trajectory's own limits end it too
    mt = load_config({}, ["environment.cls=tests.integration.multiturn_envs:Turns", "environment.max_tokens=900"])
    assert "environment.max_tokens=900" in step_warnings({**OK, "truncated_frac": 1.0}, mt)["truncated"]


def test_all_equal_rewards_say_no_signal_and_point_at_the_verifier():
    cfg = load_config({}, ["reward.answer_format=boxed"])
    w = step_warnings({**OK, "reward_mean": 0.0, "reward_std": 0.0, "grad_norm": 0.0}, cfg)
    assert list(w) == ["no_signal"]
    assert "every reward was 0.000" in w["no_signal"] and "reward.answer_format=boxed" in w["no_signal"]
    # a step dynamic sampling emptied has its own message (grpo.py); one sequence has no spread to speak of
    assert step_warnings({**OK, "reward_std": 0.0, "no_trainable_groups": True}, cfg) == {}
    assert step_warnings({**OK, "reward_std": 0.0, "num_sequences": 1}, cfg) == {}


def test_the_gate_prints_the_first_then_every_repeat():
    out = io.StringIO()
    gate = WarningGate(stream=out)
    printed = [gate({"no_signal": f"step {s}: x"}) for s in range(1, 2 * REPEAT + 1)]
    steps = [s for s, p in zip(range(1, 2 * REPEAT + 1), printed) if p]
    assert steps == [1, REPEAT, 2 * REPEAT]
    lines = out.getvalue().splitlines()
    assert lines[0] == "[megatron-rl] warning: step 1: x"
    assert lines[1].endswith(f"({REPEAT} steps so far)")
    assert gate({"truncated": "step 99: y"}) and gate({}) == []  # each kind counts on its own
