"""Multi-turn environments: the policy's conversation partner in agentic rollouts (tool calls, feedback games).

Modules:
- interface.py: the contract (`Environment`, `StepResult`), loading `environment.cls`, validating what user code
  returns, the trajectory reward.
- runner.py: `EnvironmentPool`, environments in worker processes, one instance per trajectory, per-call timeouts.
- worker.py: the worker processes' request loop.
- chat.py: token-exact incremental rendering of observations for the next turn's prompt.
- tool_calls.py: parsing `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` and answering the calls.
- calculator.py: the arithmetic tool, evaluated safely with `ast`; python_tool.py: the `python` tool (the sandbox).
- guess_number.py, tool_math.py, code_tests.py: built-in environments (code_tests: hidden unit tests run in the
  sandbox by code_grader.py, asserts through code_harness.py, a program that runs inside the sandbox only).
- sandbox.py (and sandbox_os.py, its OS mechanics): `run_python`, model-written code in a contained process.

Docs: docs/environments.md.
"""
from megatron_rl.environments.interface import (
    Environment, EnvironmentContractError, EnvironmentLoadError, StepResult, load_environment, trajectory_reward,
    validate_step,
)

__all__ = ["Environment", "EnvironmentContractError", "EnvironmentLoadError", "StepResult", "load_environment",
           "trajectory_reward", "validate_step"]
