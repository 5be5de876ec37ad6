"""The environment contract in-process: loading environment.cls (each way it can be wrong), validating what user
code returns, the trajectory reward, and the environment section of the config."""
import math

import pytest

from megatron_rl.config import ConfigError, apply_overrides, from_dict, validate
from megatron_rl.config.schema import Config
from megatron_rl.environments.interface import (
    Environment, EnvironmentContractError, EnvironmentLoadError, StepResult, error_result, load_environment,
    resolve_environment_class, trajectory_reward, validate_messages, validate_step,
)


class Fine(Environment):
    def __init__(self, n: int = 1):
        self.n = n

    def reset(self, item):
        return [{"role": "user", "content": "hi"}]

    def step(self, messages):
        return StepResult(None, 1.0, True)


class Outer:
    class Inner(Fine):
        pass


class Grumpy(Fine):
    def __init__(self):
        raise RuntimeError("no thanks")


class OnlyReset:
    def reset(self, item):
        return []


def not_a_class():
    pass


def test_load_environment_builds_the_named_class():
    env = load_environment(f"{__name__}:Fine", {"n": 3})
    assert isinstance(env, Fine) and env.n == 3
    assert resolve_environment_class(f"{__name__}:Outer.Inner") is Outer.Inner
    assert type(load_environment("megatron_rl.environments.guess_number:GuessNumber", {})).__name__ == "GuessNumber"


@pytest.mark.parametrize("cls_path, kwargs, message", [
    ("tests.unit.test_env_interface.Fine", {}, "must be an import path 'package.module:Class'"),
    ("a:b:c", {}, "must be an import path"),
    ("", {}, "must be an import path"),
    ("__main__:Env", {}, "do not run the main script"),
    ("no_such_pkg.sub:Env", {}, "module 'no_such_pkg.sub' not found (no module named 'no_such_pkg'"),
    ("tests.unit.no_such_file:Env", {}, "module 'tests.unit.no_such_file' not found"),
    (f"{__name__}:Missing", {}, "has no attribute 'Missing' (environment classes there: Fine, Grumpy"),
    (f"{__name__}:Outer.Missing", {}, f"'{__name__}.Outer' has no attribute 'Missing'"),
    (f"{__name__}:not_a_class", {}, "names a function, not a class"),
    (f"{__name__}:OnlyReset", {}, "class OnlyReset has no step(): not an environment"),
    (f"{__name__}:Grumpy", {}, "Grumpy(**environment.kwargs) with kwargs {} raised RuntimeError: no thanks"),
    (f"{__name__}:Fine", {"m": 1}, "unexpected keyword argument 'm'"),
    (f"{__name__}:Fine", [1], "environment.kwargs must be a mapping"),
])
def test_load_errors_name_the_key_and_what_is_wrong(cls_path, kwargs, message):
    with pytest.raises(EnvironmentLoadError) as e:
        load_environment(cls_path, kwargs)
    assert "environment." in str(e.value) and message in str(e.value), str(e.value)
    assert isinstance(e.value, ConfigError)  # the command line prints it as a one-line config error


def test_a_module_that_fails_to_import_is_reported_as_such(tmp_path, monkeypatch):
    (tmp_path / "broken_env_mod.py").write_text("import no_such_dependency_xyz\n")
    (tmp_path / "raising_env_mod.py").write_text("raise RuntimeError('import-time bug')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(EnvironmentLoadError, match="importing 'broken_env_mod' failed: No module named "
                                                   "'no_such_dependency_xyz'"):
        load_environment("broken_env_mod:Env")
    with pytest.raises(EnvironmentLoadError, match="importing 'raising_env_mod' raised RuntimeError: import-time"):
        load_environment("raising_env_mod:Env")


@pytest.mark.parametrize("result, reason", [
    ({"reward": 1.0}, "must return a StepResult, got dict"),
    (StepResult(None, 1.0, 1), "done must be True or False"),
    (StepResult(None, math.nan, True), "reward must be a finite number"),
    (StepResult(None, math.inf, True), "reward must be a finite number"),
    (StepResult(None, "1", True), "reward must be a finite number, got '1'"),
    (StepResult(None, True, True), "reward must be a finite number"),
    (StepResult([{"role": "user", "content": "x"}], 0.0, True), "must be None when done"),
    (StepResult(None, 0.0, False), "observation must be a list"),
    (StepResult([], 0.0, False), "observation is empty but not done"),
    (StepResult(["hi"], 0.0, False), "observation[0] must be a dict"),
    (StepResult([{"content": "x"}], 0.0, False), "observation[0].role must be a string, is missing"),
    (StepResult([{"role": "tool", "content": None}], 0.0, False), "content must be a string, is a NoneType"),
    (StepResult([{"role": "", "content": "x"}], 0.0, False), "role is empty"),
    (StepResult([{"role": "tool", "content": "x", "id": 3}], 0.0, False), "'id' is not"),
    (StepResult([{"role": "tool", "content": "x" * 1_000_001}], 0.0, False), "more than 1000000"),
    (StepResult(None, 0.0, True, metrics=[1]), "metrics must be a dict"),
    (StepResult(None, 0.0, True, metrics={"a": math.nan}), "metrics['a'] must be a finite number or a string"),
    (StepResult(None, 0.0, True, metrics={"a": [1]}), "metrics['a']"),
    (StepResult(None, 0.0, True, metrics={1: 1}), "keys must be strings"),
])
def test_validate_step_refuses_garbage_with_a_reason(result, reason):
    with pytest.raises(EnvironmentContractError) as e:
        validate_step(result)
    assert reason in e.value.reason, e.value.reason


def test_validate_step_returns_a_plain_copy():
    import numpy as np

    obs = [{"role": "tool", "content": "5", "name": "calculator"}]
    r = validate_step(StepResult(obs, np.float32(0.5), False, {"n": np.int64(2), "ok": True, "why": "x" * 2000}))
    assert r == StepResult(obs, 0.5, False, {"n": 2.0, "ok": True, "why": "x" * 1000})
    assert type(r.reward) is float and r.observation is not obs and r.observation[0] is not obs[0]
    assert validate_messages([], "reset()") == []


def test_trajectory_reward_sums_steps_and_zeroes_failures():
    steps = [StepResult([{"role": "user", "content": "x"}], 0.25, False), StepResult(None, 1.0, True)]
    assert trajectory_reward(steps) == 1.25
    assert trajectory_reward(steps[:1] + [error_result("timeout", "slow")]) == 0.0
    assert trajectory_reward([]) == 0.0
    with pytest.raises(ValueError, match="unknown environment error kind"):
        error_result("oops")


# ---- the config section -------------------------------------------------------------------------------------------

def config(*overrides: str) -> Config:
    return validate(from_dict(apply_overrides({}, list(overrides))), check_model=False)


def test_environment_section_defaults_and_engine_context():
    cfg = config()
    e = cfg.environment
    assert (e.cls, e.kwargs, e.max_turns, e.stop) == (None, {}, 4, ["</tool_call>"])
    assert cfg.max_model_len() == cfg.data.max_prompt_tokens + cfg.generation.max_new_tokens  # single-turn
    cfg = config("environment.cls=megatron_rl.environments.tool_math:ToolMath", "environment.max_tokens=3000",
                 "environment.kwargs={max_tool_calls: 2}")
    assert cfg.max_model_len() == 3000 and cfg.environment.kwargs == {"max_tool_calls": 2}


@pytest.mark.parametrize("override, message", [
    ("environment.cls=megatron_rl.environments.tool_math.ToolMath", "environment.cls='megatron_rl.environments."
                                                                    "tool_math.ToolMath' must be an import path"),
    ("environment.max_turns=0", "environment.max_turns must be >= 1"),
    ("environment.max_tokens=0", "environment.max_tokens must be >= 1"),
    ("environment.num_workers=0", "environment.num_workers must be >= 1"),
    ("environment.timeout_s=0", "environment.timeout_s must be > 0"),
    ("environment.stop=['']", "environment.stop[0] is empty"),
    ("environment.kwargs=3", "environment.kwargs: expected a mapping"),
    ("environment.colour=red", "unknown key 'environment.colour'"),
])
def test_environment_section_errors_name_the_key(override, message):
    with pytest.raises(ConfigError) as e:
        config(override)
    assert message in str(e.value), str(e.value)


def test_environment_budget_against_prompt_and_engine():
    cls = "environment.cls=megatron_rl.environments.guess_number:GuessNumber"
    with pytest.raises(ConfigError, match="environment.max_tokens=256 .* data.max_prompt_tokens=512"):
        config(cls, "environment.max_tokens=256")
    with pytest.raises(ConfigError, match="generation.max_model_len=1024 is shorter than environment.max_tokens"):
        config(cls, "generation.max_model_len=1024")
    config("environment.max_tokens=256")  # no environment: the budget is not used
