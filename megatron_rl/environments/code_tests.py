"""Code with unit tests: the policy writes a Python program, hidden tests score it in the sandbox.

A dataset row (the item) holds:
- "question": the problem statement (the user message);
- "tests": the hidden tests, in one of two forms, told apart by the shape of the entries:
  * assert tests, a list of strings: Python statements run after the model's code in its namespace, passing when
    they raise nothing ("assert add(1, 2) == 3"; MBPP's test_list, HumanEval-plus style asserts);
  * stdin/stdout cases, a list of {"input": str, "output": str}: the program reads the input on stdin and must print
    the output (APPS / CodeContests). The columnar {"inputs": [...], "outputs": [...]} (APPS's input_output, also as
    a JSON string) and {"input": [...], "output": [...]} (CodeContests) are read as the same pairs.
  A list mixing the forms, an empty list or a missing field is an error naming the field and the entry.
- "entry_point" (optional): the function the asserts call, named in the user message; "signature" (optional): its
  signature, e.g. "def add(a: int, b: int) -> int", shown too.

reset: a system message asking for one ```python code block (a function for asserts, a program reading stdin for
cases), then the question. step: the LAST ```python (or ```py) fenced block of the assistant message is the answer;
none gives reward 0, done, metrics format_error=1. The tests run in the sandbox (code_grader.py: one harness run for
all the asserts, one run per stdin case, each test under timeout_s); reward = the fraction of tests passed.

Multi-turn (max_attempts > 1): while attempts remain and a test fails, the step is not done and the observation is a
user message about the FIRST failing test: the assert, or the input and expected output, with what the code gave
(its value, its output, or the last lines of its error), each cut to a few hundred characters; with
reveal_tests=False only how many passed and how the first one failed (wrong answer, the exception's type, timeout).
The reward is that of the LAST attempt, given on the last step; earlier steps get 0, so the trajectory's sum is the
final program's score.

Time: all the tests of one step share a budget, time_budget_s, further cut to the time the worker's soft timeout
(environment.timeout_s) leaves minus 1 s when the step runs under one. A test's timeout is cut to what is left, and
tests with no time left fail with reason "budget" without running, so a step never overruns environment.timeout_s
(an overrun would end the trajectory as env_error instead of scoring it). For rows with many slow tests raise
environment.timeout_s and time_budget_s together.

Metrics (the rollout loop sums each step's metrics over the trajectory, so intermediate steps carry only counters):
every step attempts=1, sandbox_s (wall seconds of the grading) and sandbox_runs; the last step also tests_passed,
tests_total, solved (all passed), format_error, and fail_<reason> per failed test of the final attempt (wrong, error,
timeout, memory, output_limit, killed, exited, cpu_limit, budget, sandbox_error; a missing key is 0).
"""
from __future__ import annotations

import ast
import json
import re
import textwrap
import time
from typing import Any, Optional

from megatron_rl.environments.code_grader import Grade, TestOutcome, grade_asserts, grade_stdio
from megatron_rl.environments.interface import Environment, StepResult
from megatron_rl.environments.worker import time_left

MAX_CODE_BYTES = 100_000  # a stdin program goes to `python -c`: the kernel refuses arguments over 128 KiB
ALARM_MARGIN_S = 1.0  # kept free of the worker's soft timeout: the sandbox's clean-up and the step's own work
FEEDBACK_CHARS = 300

# an opening fence of python/py/python3 and a closing fence, each alone on its line (so ``` inside a string of the
# code does not end the block)
_BLOCK_RE = re.compile(r"^[ \t]*```[ \t]*(?:python3?|py)[ \t]*\n(.*?)^[ \t]*```[ \t]*$",
                       re.IGNORECASE | re.DOTALL | re.MULTILINE)

_SYSTEM = {
    "asserts": "You are an expert Python programmer. Solve the task by writing Python code. Answer with exactly one "
               "```python code block holding the complete solution (imports and any helpers included); it is "
               "tested by hidden unit tests that call your functions. Use only the standard library, and do not "
               "read input or print: the tests call the function.",
    "stdio": "You are an expert Python programmer. Solve the task by writing a complete Python program that reads "
             "its input from standard input and writes the answer to standard output. Answer with exactly one "
             "```python code block; it is run on hidden test inputs and its output compared with the expected "
             "one. Use only the standard library.",
}


def extract_code(text: str) -> Optional[str]:
    """The last ```python fenced block of `text`, dedented; None when there is none."""
    blocks = _BLOCK_RE.findall(text)
    return textwrap.dedent(blocks[-1]) if blocks else None


def parse_tests(item: dict) -> tuple[str, list]:
    """("asserts", [str]) or ("stdio", [(stdin, stdout)]) from item["tests"] (module docstring); ValueError naming
    the field and the entry otherwise."""
    if "tests" not in item:
        raise ValueError(f"code_tests needs items with a 'tests' field (the hidden tests); this one has "
                         f"{sorted(item)}")
    tests = item["tests"]
    if isinstance(tests, str):  # APPS stores its input_output as a JSON string
        try:
            tests = json.loads(tests)
        except json.JSONDecodeError as e:
            raise ValueError(f"item['tests'] is a string but not JSON ({e.msg}): expected a list of assert strings "
                             "or of {'input', 'output'} cases") from None
    if isinstance(tests, dict):
        tests = _columns_to_cases(tests)
    if not isinstance(tests, (list, tuple)) or not tests:
        got = "empty" if isinstance(tests, (list, tuple)) else f"a {type(tests).__name__}"
        raise ValueError(f"item['tests'] must be a non-empty list of assert strings or of {{'input', 'output'}} "
                         f"cases, is {got}")
    if isinstance(tests[0], str):
        for i, t in enumerate(tests):
            if not isinstance(t, str):
                raise ValueError(f"item['tests'][{i}] is a {type(t).__name__}, but tests[0] is an assert string: "
                                 "one row holds one form of tests")
            try:
                ast.parse(t, f"tests[{i}]", "exec")
            except SyntaxError as e:
                raise ValueError(f"item['tests'][{i}] is not valid Python ({e.msg}): {t[:80]!r}") from None
        return "asserts", list(tests)
    cases = []
    for i, t in enumerate(tests):
        if not (isinstance(t, dict) and isinstance(t.get("input"), str) and isinstance(t.get("output"), str)):
            raise ValueError(f"item['tests'][{i}] must be an assert string or a dict with string 'input' and "
                             f"'output' (a stdin/stdout case), got {_short(t)}; one row holds one form of tests")
        cases.append((t["input"], t["output"]))
    return "stdio", cases


def _columns_to_cases(tests: dict) -> list:
    for ins, outs in (("inputs", "outputs"), ("input", "output")):
        if ins in tests and outs in tests:
            a, b = tests[ins], tests[outs]
            if not (isinstance(a, list) and isinstance(b, list) and len(a) == len(b)):
                raise ValueError(f"item['tests'][{ins!r}] and [{outs!r}] must be lists of the same length")
            if "fn_name" in tests:
                raise ValueError("item['tests'] has fn_name: call-based APPS rows are not stdin/stdout cases; "
                                 "convert them to assert strings")
            return [{"input": x, "output": y} for x, y in zip(a, b)]
    raise ValueError(f"item['tests'] is a dict with keys {sorted(tests)}: expected 'inputs'/'outputs' or "
                     "'input'/'output' lists")


class CodeTests(Environment):
    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, max_attempts: int = 1,
                 reveal_tests: bool = True, time_budget_s: float = 8.0, system_prompt: Optional[str] = None):
        """timeout_s: per test; memory_mb: the sandbox's memory cap; max_attempts: answers allowed (1: single
        turn); reveal_tests: show the failing test in the feedback; time_budget_s: all the tests of one step."""
        for name, v in (("timeout_s", timeout_s), ("time_budget_s", time_budget_s)):
            if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
                raise ValueError(f"{name} must be a number > 0, got {v!r}")
        if not (isinstance(memory_mb, int) and memory_mb >= 16):
            raise ValueError(f"memory_mb must be an integer >= 16, got {memory_mb!r}")
        if not (isinstance(max_attempts, int) and not isinstance(max_attempts, bool) and max_attempts >= 1):
            raise ValueError(f"max_attempts must be an integer >= 1, got {max_attempts!r}")
        if not isinstance(reveal_tests, bool):
            raise ValueError(f"reveal_tests must be true or false, got {reveal_tests!r}")
        self.timeout_s, self.memory_mb, self.max_attempts = float(timeout_s), memory_mb, max_attempts
        self.reveal_tests, self.time_budget_s, self.system_prompt = reveal_tests, float(time_budget_s), system_prompt
        self.form, self.tests, self.attempts = "", [], 0

    def reset(self, item: dict) -> list[dict]:
        if "question" not in item:
            raise ValueError(f"code_tests needs items with a 'question' field; this one has {sorted(item)}")
        self.form, self.tests = parse_tests(item)
        self.attempts = 0
        user = str(item["question"])
        if item.get("entry_point"):
            user += f"\n\nYour code must define the function `{item['entry_point']}`."
        if item.get("signature"):
            user += f"\nIts signature: `{item['signature']}`"
        return [{"role": "system", "content": self.system_prompt or _SYSTEM[self.form]},
                {"role": "user", "content": user}]

    def step(self, messages: list[dict]) -> StepResult:
        if not self.tests:
            raise RuntimeError("step() before reset(): the environment has no tests")
        self.attempts += 1
        text = messages[-1]["content"] if messages and messages[-1]["role"] == "assistant" else ""
        code = extract_code(text)
        base = {"attempts": 1}
        if code is None or len(code.encode("utf-8", "replace")) > MAX_CODE_BYTES:
            # no answer to grade: the trajectory ends here, even with attempts left (as in the other environments)
            return StepResult(None, 0.0, True, {**base, "sandbox_s": 0.0, "sandbox_runs": 0, "tests_passed": 0,
                                                "tests_total": len(self.tests), "solved": 0, "format_error": 1,
                                                "code_too_long": int(code is not None)})
        grade = self._grade(code)
        base.update(sandbox_s=grade.seconds, sandbox_runs=grade.runs)
        last = grade.passed == grade.total or self.attempts >= self.max_attempts
        if not last:
            return StepResult([{"role": "user", "content": self._feedback(grade)}], 0.0, False, base)
        metrics = {**base, "tests_passed": grade.passed, "tests_total": grade.total,
                   "solved": int(grade.passed == grade.total), "format_error": 0,
                   **{f"fail_{k}": v for k, v in sorted(grade.reason_counts.items())}}
        return StepResult(None, grade.passed / grade.total, True, metrics)

    def _grade(self, code: str) -> Grade:
        budget = self.time_budget_s
        left = time_left()
        if left is not None:  # under the worker's soft timeout (environment.timeout_s): finish before it fires
            budget = min(budget, left - ALARM_MARGIN_S)
        deadline = time.monotonic() + budget
        grade = grade_asserts if self.form == "asserts" else grade_stdio
        return grade(code, self.tests, timeout_s=self.timeout_s, memory_mb=self.memory_mb, deadline=deadline)

    # ------------------------------------------------------------------------------------------------ feedback

    def _feedback(self, grade: Grade) -> str:
        i = grade.first_failure()
        o = grade.outcomes[i]
        head = f"Your code passed {grade.passed} of {grade.total} tests."
        tail = "Fix the code and answer again with the complete solution in one ```python code block."
        if grade.load_failure is not None:
            body = "It failed before any test ran:\n" + (_block(o.error or o.reason) if self.reveal_tests
                                                         else _kind(o))
        elif not self.reveal_tests:
            body = f"The first failing test (test {i + 1}): {_kind(o)}."
        elif self.form == "asserts":
            body = "The first failing test:\n" + _block(self.tests[i]) + "\n" + _what_happened(o, "asserts")
        else:
            stdin, expected = self.tests[i]
            body = ("The first failing test. Input:\n" + _block(stdin) + "\nExpected output:\n" + _block(expected)
                    + "\n" + _what_happened(o, "stdio"))
        return f"{head} {body}\n\n{tail}"


def _what_happened(o: TestOutcome, form: str) -> str:
    if o.reason == "wrong" and form == "stdio":
        return "Your output:\n" + _block(o.got)
    if o.reason == "wrong":
        if o.got:
            note = f" ({o.error})" if o.error else ""
            return f"Expected: {_clip(o.expected)}\nGot: {_clip(o.got)}{note}"
        return "The assertion failed." + (f"\n{_block(o.error)}" if o.error else "")
    if o.reason in ("timeout", "budget"):
        return "It did not finish in time."
    if o.reason == "memory":
        return "It ran out of memory."
    return "It failed:\n" + _block(o.error or o.reason)


def _kind(o: TestOutcome) -> str:
    """How a test failed, without its content (reveal_tests=False): the exception's type, not its message."""
    if o.reason == "wrong":
        return "wrong answer"
    if o.reason in ("timeout", "budget"):
        return "timed out"
    if o.reason == "error" and o.error:
        last = o.error.strip().splitlines()[-1]
        return "raised " + last.split(":", 1)[0].strip()[:60]
    return o.reason.replace("_", " ")


def _block(text: str) -> str:
    return "```\n" + _clip(text.rstrip("\n")) + "\n```"


def _clip(text: str, n: int = FEEDBACK_CHARS) -> str:
    return text if len(text) <= n else text[:n - 3] + "..."


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
