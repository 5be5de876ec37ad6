"""Tool-use math: the policy may call a calculator before it answers; the answer is scored like the single-turn demo's.

reset: a system message describing the calculator and the answer format, and the item's question as the user
message. step: an assistant message with tool calls gets one tool message per call (tool_calls.py; a malformed call
gets an error message, and still counts); one without is the final answer, scored against item["answer"], and ends
the trajectory with reward = its score (0 or 1). More than max_tool_calls calls in a trajectory end it with reward 0
(metrics tool_budget_exceeded=1): a policy that never answers must not loop until the turn limit. With python=True
(default off) a `python` tool runs code in the sandbox and answers with its stdout (python_tool.py).

Scoring is `rewards.worker.score_sample`, the function the single-turn reward pool runs: the same answer formats
(answer_tag by default, as in configs/demo_cpu.yaml) and the same verifiers. verifier "auto" picks reasoning-gym's
own scorer for a reasoning-gym row (the item carries task and entry, as data/datasets.py builds them, or is itself
an entry with metadata.source_dataset; the demo's chain_sum) and math-verify otherwise.
"""
from __future__ import annotations

import importlib
from typing import Any

from megatron_rl.environments.calculator import calculator
from megatron_rl.environments.interface import Environment, StepResult
from megatron_rl.environments.python_tool import make_python_tool
from megatron_rl.environments.tool_calls import answer_calls, parse_tool_calls
from megatron_rl.rewards.worker import score_sample

_FORMAT_TEXT = {
    "answer_tag": "give only the final number inside <answer></answer> tags",
    "boxed": "give the final answer inside \\boxed{}",
    "auto": "give the final answer inside <answer></answer> tags or \\boxed{}",
}


def default_system_prompt(answer_format: str, python: bool = False, calculator: bool = True) -> str:
    python_text = ('You can also run Python code: <tool_call>{"name": "python", "arguments": {"code": '
                   '"print(2 ** 10)"}}</tool_call> answers with what it prints (standard library only). '
                   if python else "")
    calc_text = ("You can use a calculator: write "
                 '<tool_call>{"name": "calculator", "arguments": {"expression": "12 * (3 + 4)"}}</tool_call> and its '
                 "result comes back in a tool message. It evaluates numbers with + - * / // % ** and parentheses. "
                 if calculator else "")
    return (f"Solve the arithmetic problem. {calc_text}{python_text}When you know the result, "
            f"{_FORMAT_TEXT[answer_format]}.")


def _few_shot_messages(few_shot) -> list[dict]:
    """few_shot: example conversations, each a list of {role, content} messages (user, then assistant turns with
    tool calls, tool results, the final answer), flattened in order between the system message and the question.
    A small model learns the tool-call form from them before RL can reinforce it (configs/tool_math_cpu.yaml)."""
    if not isinstance(few_shot, list):
        raise ValueError(f"few_shot must be a list of example conversations, got {type(few_shot).__name__}")
    out = []
    for i, conv in enumerate(few_shot):
        if not (isinstance(conv, list) and conv):
            raise ValueError(f"few_shot[{i}] must be a non-empty list of {{role, content}} messages, got {conv!r}")
        for j, m in enumerate(conv):
            if not (isinstance(m, dict) and set(m) == {"role", "content"} and isinstance(m["content"], str)
                    and m["role"] in ("user", "assistant", "tool")):
                raise ValueError(f"few_shot[{i}][{j}] must be {{role: user|assistant|tool, content: str}}, "
                                 f"got {m!r}")
            out.append({"role": m["role"], "content": m["content"]})
        if conv[0]["role"] != "user" or conv[-1]["role"] != "assistant":
            raise ValueError(f"few_shot[{i}] must start with a user message and end with an assistant message")
    return out


class ToolMath(Environment):
    TOOLS = {"calculator": calculator}  # its CalculatorError (a ValueError) is answered as "error: ..."

    def __init__(self, max_tool_calls: int = 4, answer_format: str = "answer_tag", verifier: str = "auto",
                 system_prompt: str | None = None, python: bool = False, python_timeout_s: float = 5.0,
                 calculator: bool = True, few_shot: list | None = None):
        """python: also offer the `python` tool (python_tool.py: code run in the sandbox, its stdout returned),
        each call under python_timeout_s. calculator: false offers no calculator (with python false, no tool at all:
        the no-tool arm of a comparison, still one environment). few_shot: example conversations put before the
        question (_few_shot_messages)."""
        if not (isinstance(max_tool_calls, int) and max_tool_calls >= 0):
            raise ValueError(f"max_tool_calls must be an integer >= 0, got {max_tool_calls!r}")
        if answer_format not in _FORMAT_TEXT:
            raise ValueError(f"answer_format must be one of {sorted(_FORMAT_TEXT)}, got {answer_format!r}")
        if verifier not in ("auto", "math", "reasoning_gym"):
            raise ValueError(f"verifier must be auto, math or reasoning_gym, got {verifier!r}")
        for name, flag in (("python", python), ("calculator", calculator)):
            if not isinstance(flag, bool):
                raise ValueError(f"{name} must be true or false, got {flag!r}")
        if not (isinstance(python_timeout_s, (int, float)) and python_timeout_s > 0):
            raise ValueError(f"python_timeout_s must be a number > 0, got {python_timeout_s!r}")
        self.max_tool_calls, self.answer_format, self.verifier = max_tool_calls, answer_format, verifier
        self.system_prompt, self.python = system_prompt, python
        self.calculator = calculator
        self.few_shot = _few_shot_messages(few_shot or [])
        self.tools = dict(self.TOOLS) if calculator else {}
        if python:
            self.tools["python"] = make_python_tool(float(python_timeout_s))
        self.item: dict = {}
        self.tool_calls = self.tool_errors = 0

    @classmethod
    def warmup(cls) -> None:
        # math-verify, sympy and reasoning-gym, warmed as in the verifier workers (a no-op in a worker forked from
        # their preloaded forkserver)
        importlib.import_module("megatron_rl.rewards._preload")

    def reset(self, item: dict) -> list[dict]:
        for key in ("question", "answer"):
            if key not in item:
                raise ValueError(f"tool_math needs items with 'question' and 'answer'; this one has "
                                 f"{sorted(item)}")
        self.item, self.tool_calls, self.tool_errors = item, 0, 0
        system = self.system_prompt or default_system_prompt(self.answer_format, self.python, self.calculator)
        return [{"role": "system", "content": system}, *self.few_shot,
                {"role": "user", "content": str(item["question"])}]

    def step(self, messages: list[dict]) -> StepResult:
        text = messages[-1]["content"] if messages and messages[-1]["role"] == "assistant" else ""
        calls = parse_tool_calls(text)
        # metrics are this step's counts: the rollout loop sums them over the trajectory (interface.StepResult)
        if calls:
            self.tool_calls += len(calls)
            if self.tool_calls > self.max_tool_calls:
                return StepResult(None, 0.0, True, {"tool_calls": len(calls), "tool_errors": 0,
                                                    "tool_budget_exceeded": 1})
            observation, errors = answer_calls(calls, self.tools)
            self.tool_errors += errors
            return StepResult(observation, 0.0, False, {"tool_calls": len(calls), "tool_errors": errors})
        scored = score_sample(self._payload(text))
        return StepResult(None, float(scored["score"]), True,
                          {"tool_calls": 0, "tool_errors": 0, "correct": int(scored["score"] >= 1.0),
                           "answered": int(scored.get("answer") is not None)})

    def _payload(self, completion: str) -> dict[str, Any]:
        item = self.item
        payload = {"kind": "math", "completion": completion, "answer": str(item["answer"]),
                   "answer_format": self.answer_format}
        rg = _reasoning_gym_row(item)
        if self.verifier == "reasoning_gym" and rg is None:
            raise ValueError("verifier=reasoning_gym needs reasoning-gym items (task and entry, or an entry with "
                             "metadata.source_dataset)")
        if self.verifier != "math" and rg is not None:
            payload.update(kind="reasoning_gym", **rg)
        return payload


def _reasoning_gym_row(item: dict):
    """(task, task_params, entry) of a reasoning-gym row, or None."""
    if "task" in item and isinstance(item.get("entry"), dict):
        return {"task": item["task"], "task_params": item.get("task_params") or {}, "entry": item["entry"]}
    task = (item.get("metadata") or {}).get("source_dataset") if isinstance(item.get("metadata"), dict) else None
    if isinstance(task, str):
        return {"task": task, "task_params": item.get("task_params") or {}, "entry": item}
    return None
