"""The environment contract: what a multi-turn environment is, how one is named in a config, and what it may return.

An environment plays the other side of a conversation with the policy. Messages are OpenAI-style dicts,
`{"role": "system" | "user" | "assistant" | "tool", "content": str}`.

    env = cls(**environment.kwargs)          # one instance per trajectory, in an environment worker process
    messages = env.reset(item)               # the opening conversation: system and user messages
    loop:
        messages.append(assistant turn)      # the policy's sampled reply (its token ids are kept as sampled)
        result = env.step(messages)          # the whole conversation so far; its last message is the assistant's
        if result.done: break
        messages += result.observation       # tool results, feedback: the next prompt continues with them

- `item` is the dataset row as a dict, e.g. {"question": ..., "answer": ...}; for reasoning-gym rows also `task`,
  `task_params` and `entry` (data/datasets.py). An environment reads what it needs and ignores the rest.
- The trajectory's reward is the SUM of the rewards of its steps. Most environments give 0 until done and the whole
  reward on the last step; shaping (a bonus for a useful tool call) is a non-zero intermediate reward.
- A trajectory that ends in an environment failure (the environment raised, overran its timeout, returned something
  outside this contract, or its worker process died) gets `metrics["env_error"]` and a total reward of 0: earlier
  step rewards are dropped too (`trajectory_reward`), so no failure is ever worth more than a plain wrong answer.
- The rollout loop also ends a trajectory at `environment.max_turns` assistant turns or `environment.max_tokens`
  tokens; the reward is then the sum of the steps so far.

`Environment` is a base class to subclass, but any class with `reset(item)` and `step(messages)` qualifies.
"""
from __future__ import annotations

import importlib
import inspect
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from megatron_rl.config.loader import ConfigError, check_class_path

KEY = "environment.cls"  # the config key named in every loading error
# An observation this long is a bug (a tool printing a file in a loop), not a message for the model; the token budget
# would cut it anyway, after it had been pickled, rendered and tokenized.
MAX_OBSERVATION_CHARS = 1_000_000
MAX_METRIC_CHARS = 1000  # a string metric (a reason) longer than this is cut, not refused


@dataclass
class StepResult:
    """What `step` returns. observation: the messages to append before the policy's next turn (a tool result, user
    feedback), None when done. reward: this step's share of the trajectory's reward (summed over the steps).
    metrics: numbers (or short strings) of THIS step, e.g. {"tool_calls": 2} for a turn that made two calls; like the
    rewards, a trajectory's numbers are the sums over its steps (algorithms/multiturn.py), so report counts per step,
    never running totals."""
    observation: Optional[list[dict]]
    reward: float
    done: bool
    metrics: dict[str, Any] = field(default_factory=dict)


class Environment:
    """Base class of an environment (subclassing is optional: a class with the same two methods qualifies).

    The constructor gets `environment.kwargs`; one instance serves one trajectory, so per-trajectory state (a secret,
    the number of tool calls) lives on `self`. Both methods run in an environment worker process under
    `environment.timeout_s`.
    """

    @classmethod
    def warmup(cls) -> None:
        """Optional: called once per worker process before its first trajectory, outside any call's timeout.
        Import heavy libraries or build shared tables here, so no trajectory pays for them."""

    def reset(self, item: dict) -> list[dict]:
        """The opening conversation (system and user messages) for one dataset row."""
        raise NotImplementedError

    def step(self, messages: list[dict]) -> StepResult:
        """The environment's answer to the assistant turn at the end of `messages` (the whole conversation)."""
        raise NotImplementedError


class EnvironmentLoadError(ConfigError):
    """environment.cls / environment.kwargs cannot give an environment. A ConfigError: the command line prints it as
    one line naming the key."""


class EnvironmentContractError(ValueError):
    """An environment returned something outside the contract; `reason` says what, for metrics["env_error"]."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


# ------------------------------------------------------------------------------------------------------- loading

def resolve_environment_class(cls_path: str) -> type:
    """The class named by "package.module:Class", checked to be Environment-like; EnvironmentLoadError naming
    environment.cls and what is wrong otherwise."""
    try:
        module_name, qualname = check_class_path(cls_path, KEY)
    except ConfigError as e:
        raise EnvironmentLoadError(str(e)) from None
    where = f"{KEY}={cls_path!r}"
    if module_name == "__main__":
        raise EnvironmentLoadError(f"{where}: environments run in worker processes, which do not run the main script "
                                   "or notebook; define the class in an importable module")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        # the module itself (or a package above it) is missing, vs. a module that exists but imports a missing one
        if e.name and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise EnvironmentLoadError(f"{where}: module {module_name!r} not found (no module named {e.name!r}: is "
                                       "it installed, or its folder on PYTHONPATH?)") from None
        raise EnvironmentLoadError(f"{where}: importing {module_name!r} failed: {e}") from None
    except Exception as e:  # noqa: BLE001 - any import-time failure of user code is a config problem to report
        raise EnvironmentLoadError(f"{where}: importing {module_name!r} raised {type(e).__name__}: {e}") from None
    obj: Any = module
    for i, part in enumerate(qualname.split(".")):
        if not hasattr(obj, part):
            owner = ".".join([module_name] + qualname.split(".")[:i])
            # the environment classes defined there (not the ones it imports, such as Environment itself)
            candidates = sorted(n for n, v in vars(obj).items() if inspect.isclass(v) and _is_environment_like(v)
                                and v.__module__ == module_name and v is not Environment)
            hint = f" (environment classes there: {', '.join(candidates)})" if candidates else ""
            raise EnvironmentLoadError(f"{where}: {owner!r} has no attribute {part!r}{hint}")
        obj = getattr(obj, part)
    if not inspect.isclass(obj):
        raise EnvironmentLoadError(f"{where}: names a {type(obj).__name__}, not a class (one instance is made per "
                                   "trajectory, so it must be a class)")
    if not _is_environment_like(obj):
        missing = [m for m in ("reset", "step") if not callable(getattr(obj, m, None))]
        raise EnvironmentLoadError(f"{where}: class {obj.__name__} has no {' or '.join(m + '()' for m in missing)}: "
                                   "not an environment (see megatron_rl.environments.interface.Environment)")
    return obj


def load_environment(cls_path: str, kwargs: Optional[dict] = None) -> Any:
    """An instance: the class named by `cls_path` called with `kwargs` (environment.kwargs)."""
    cls = resolve_environment_class(cls_path)
    kwargs = {} if kwargs is None else kwargs
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise EnvironmentLoadError(f"environment.kwargs must be a mapping of names to values, got {kwargs!r}")
    try:
        return cls(**kwargs)
    except Exception as e:  # noqa: BLE001 - the user's constructor: report what it said, with the key
        raise EnvironmentLoadError(f"{KEY}={cls_path!r}: {cls.__name__}(**environment.kwargs) with kwargs "
                                   f"{kwargs!r} raised {type(e).__name__}: {e}") from None


def _is_environment_like(cls: type) -> bool:
    return callable(getattr(cls, "reset", None)) and callable(getattr(cls, "step", None))


# ---------------------------------------------------------------------------------------------------- validation

def validate_messages(messages: Any, what: str) -> list[dict]:
    """A clean copy of a list of {role, content} messages (str values; extra str keys such as `name` kept), or
    EnvironmentContractError. `what` names the value in the reason ("observation", "reset()")."""
    if not isinstance(messages, list):
        raise EnvironmentContractError(f"{what} must be a list of messages, got {type(messages).__name__}")
    out, chars = [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise EnvironmentContractError(f"{what}[{i}] must be a dict with role and content, got "
                                           f"{type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                got = "missing" if key not in m else f"a {type(m[key]).__name__}"
                raise EnvironmentContractError(f"{what}[{i}].{key} must be a string, is {got}")
        if not m["role"]:
            raise EnvironmentContractError(f"{what}[{i}].role is empty")
        bad = [k for k, v in m.items() if not isinstance(k, str) or not isinstance(v, str)]
        if bad:
            raise EnvironmentContractError(f"{what}[{i}]: every field must be a string; {bad[0]!r} is not")
        chars += len(m["content"])
        out.append(dict(m))
    if chars > MAX_OBSERVATION_CHARS:
        raise EnvironmentContractError(f"{what} holds {chars} characters, more than {MAX_OBSERVATION_CHARS}")
    return out


def validate_step(result: Any) -> StepResult:
    """A clean copy of a StepResult returned by user code (plain types only, so it pickles and logs safely), or
    EnvironmentContractError with the reason."""
    if not isinstance(result, StepResult):
        raise EnvironmentContractError(f"step() must return a StepResult, got {type(result).__name__}")
    if not isinstance(result.done, bool):
        raise EnvironmentContractError(f"StepResult.done must be True or False, got {type(result.done).__name__}")
    reward = result.reward
    if not isinstance(reward, numbers.Real) or isinstance(reward, bool) or not math.isfinite(float(reward)):
        raise EnvironmentContractError(f"StepResult.reward must be a finite number, got {_short(reward)}")
    if result.done:
        if result.observation is not None:
            raise EnvironmentContractError("StepResult.observation must be None when done (nothing would read it)")
        observation = None
    else:
        observation = validate_messages(result.observation, "StepResult.observation")
        if not observation:
            raise EnvironmentContractError("StepResult.observation is empty but not done: the policy's next turn "
                                           "would follow its own")
    return StepResult(observation=observation, reward=float(reward), done=result.done,
                      metrics=validate_metrics(result.metrics))


def validate_metrics(metrics: Any) -> dict[str, Any]:
    if not isinstance(metrics, dict):
        raise EnvironmentContractError(f"StepResult.metrics must be a dict, got {type(metrics).__name__}")
    out: dict[str, Any] = {}
    for k, v in metrics.items():
        if not isinstance(k, str):
            raise EnvironmentContractError(f"StepResult.metrics keys must be strings, got {_short(k)}")
        if isinstance(v, str):
            out[k] = v[:MAX_METRIC_CHARS]
        elif isinstance(v, numbers.Real) and math.isfinite(float(v)):
            out[k] = v if isinstance(v, (bool, int)) else float(v)
        else:
            raise EnvironmentContractError(f"StepResult.metrics[{k!r}] must be a finite number or a string, got "
                                           f"{_short(v)}")
    return out


def _short(value: Any) -> str:
    # repr of user data, bounded: a reason string goes into metrics and logs
    try:
        text = repr(value)
    except Exception:  # noqa: BLE001 - a hostile __repr__
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 80 else text[:77] + "..."


# -------------------------------------------------------------------------------------------------- trajectories

# why an environment call failed: the keys of EnvironmentPool.errors and the values of metrics["env_error"]
ERROR_KINDS = ("raised", "timeout", "garbage", "worker_died")


def error_result(kind: str, detail: str = "") -> StepResult:
    """The step that ends a trajectory whose environment failed: reward 0, done, metrics env_error (one of
    ERROR_KINDS) and env_error_detail (what happened, for the logs)."""
    if kind not in ERROR_KINDS:
        raise ValueError(f"unknown environment error kind {kind!r} (expected one of {ERROR_KINDS})")
    return StepResult(observation=None, reward=0.0, done=True,
                      metrics={"env_error": kind, "env_error_detail": detail[:MAX_METRIC_CHARS]})


def trajectory_reward(steps: Sequence[StepResult]) -> float:
    """The trajectory's reward: the sum of its step rewards, or 0 when it ended in an environment failure."""
    if steps and "env_error" in steps[-1].metrics:
        return 0.0
    return float(sum(s.reward for s in steps))
