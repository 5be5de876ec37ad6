"""Grading a program against hidden tests in the sandbox: assert tests or stdin/stdout cases, one outcome per test.

- `grade_asserts(code, tests)`: tests are Python statements ("assert add(1, 2) == 3"; MBPP / HumanEval-plus rows).
  One sandbox run of code_harness.py loads the code once and runs every assert separately, each under its own
  timeout, reporting per test. A run that dies inside a test (a segfault, os._exit, code stuck in C past the CPU
  timer, the sandbox's wall timeout) fails that test, and a fresh run resumes at the next one. So a hanging or
  crashing test costs only itself, while the common case is one process for all the tests rather than one per test
  (the costs of both are measured in docs/environments.md).
- `grade_stdio(code, cases)`: cases are (stdin, expected stdout) pairs (APPS / CodeContests rows). The program is run
  once per case, as a fresh `python -c` process, the way a judge runs it; its stdout, stripped, must equal the
  expected output, stripped (trailing whitespace of each line and blank lines at either end ignored, CRLF read as
  LF). A nonzero exit fails the case even when the output was right.

Both take a `deadline` (time.monotonic()) for the whole grading: a test's timeout is cut to what is left of it, and
tests it leaves no time for fail with reason "budget" without running. That keeps a step inside the environment's own
per-call timeout (environment.timeout_s) however many tests hang.

Outcome reasons: ok; wrong (a failed assert or a different output); error (raised / exited nonzero); timeout; memory;
output_limit; killed (a signal); exited (the harness process ended inside a test, os._exit); cpu_limit; budget; and
sandbox_error (the sandbox could not start the program: the result says nothing of the code).
"""
from __future__ import annotations

import ast
import secrets
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

from megatron_rl.environments.sandbox import SandboxResult, run_python

HARNESS = (Path(__file__).resolve().parent / "code_harness.py").read_text(encoding="utf-8")
MAX_TEXT = 300  # characters of expected / got / error kept per outcome (feedback and logs read them)
MIN_RUN_S = 0.05  # less time than this left: the test is not started (a run could not even start Python)
_LOAD_SLACK_S = 1.0  # the harness's own start (the interpreter, its imports) on a loaded machine
_REPORT_BYTES = 1200  # an upper bound on one test's report line, for the harness run's output limit


@dataclass(frozen=True)
class TestOutcome:
    passed: bool
    reason: str
    expected: str = ""
    got: str = ""
    error: str = ""


@dataclass
class Grade:
    """The outcomes of one program, in test order. load_failure: the asserts' code failed before any test ran (every
    outcome is then that failure). runs: sandbox processes started; seconds: wall time of the whole grading."""
    outcomes: list[TestOutcome]
    runs: int = 0
    seconds: float = 0.0
    load_failure: Optional[TestOutcome] = None
    reason_counts: dict[str, int] = field(default_factory=dict)

    @property
    def passed(self) -> int:
        return sum(o.passed for o in self.outcomes)

    @property
    def total(self) -> int:
        return len(self.outcomes)

    def first_failure(self) -> Optional[int]:
        return next((i for i, o in enumerate(self.outcomes) if not o.passed), None)


def grade_asserts(code: str, tests: Sequence[str], *, timeout_s: float, memory_mb: int,
                  deadline: float) -> Grade:
    """Run each assert test against `code` (module docstring); one outcome per test."""
    t0 = time.monotonic()
    n = len(tests)
    outcomes: list[Optional[TestOutcome]] = [None] * n
    grade = Grade(outcomes=[])  # type: ignore[arg-type]
    start = 0
    while start < n:
        left = deadline - time.monotonic()
        if left < MIN_RUN_S:
            break
        nonce = secrets.token_hex(16)
        # the run's wall limit: every remaining test at its full timeout, plus the load; the per-test timers in the
        # harness normally end a hanging test long before this backstop
        wall = (n - start + 1) * timeout_s + _LOAD_SLACK_S
        capped = left < wall
        payload = repr({"nonce": nonce, "code": code, "tests": [str(t) for t in tests], "start": start,
                        "timeout_s": min(timeout_s, left)})
        r = run_python(HARNESS, timeout_s=min(wall, left), memory_mb=memory_mb, stdin=payload,
                       output_limit=4096 + _REPORT_BYTES * (n - start + 1))
        grade.runs += 1
        reports = _reports(r.stdout, nonce)
        load = next((m for m in reports if "loaded" in m), None)
        if load is None or not load["loaded"]:
            # nothing ran: the code failed to load (or the harness never got that far), every remaining test fails
            why = _outcome(load) if load else _died(r, capped, "while loading the code")
            if start == 0:
                grade.load_failure = why
            for i in range(start, n):
                outcomes[i] = why
            break
        started = None
        for m in reports:
            if "start" in m:
                started = m["start"]
            elif "test" in m and 0 <= m["test"] < n:
                outcomes[m["test"]] = _outcome(m)
                started = None
        if all(o is not None for o in outcomes[start:]):
            break
        # the run ended early: inside test `started`, or (no start line came) at the first test without a result
        i = started if started is not None else next(k for k in range(start, n) if outcomes[k] is None)
        outcomes[i] = _died(r, capped, "during this test")
        if r.reason == "sandbox_error":
            for k in range(i, n):
                outcomes[k] = outcomes[k] or outcomes[i]
            break
        start = i + 1
    grade.outcomes = [o or TestOutcome(False, "budget", error="no time was left for this test")
                      for o in outcomes]
    grade.seconds = time.monotonic() - t0
    grade.reason_counts = _counts(grade.outcomes)
    return grade


def grade_stdio(code: str, cases: Sequence[tuple[str, str]], *, timeout_s: float, memory_mb: int,
                deadline: float) -> Grade:
    """Run `code` once per (stdin, expected stdout) case (module docstring); one outcome per case."""
    t0 = time.monotonic()
    grade = Grade(outcomes=[])
    for stdin, expected in cases:
        left = deadline - time.monotonic()
        if left < MIN_RUN_S:
            grade.outcomes.append(TestOutcome(False, "budget", error="no time was left for this test"))
            continue
        limit = min(timeout_s, left)
        # room for twice the expected output: a longer answer is wrong anyway, and a flood is cut early
        r = run_python(code, timeout_s=limit, memory_mb=memory_mb, stdin=stdin,
                       output_limit=max(64 * 1024, 2 * len(expected.encode()) + 4096))
        grade.runs += 1
        if r.reason == "ok":
            ok = normalize_output(r.stdout) == normalize_output(expected)
            grade.outcomes.append(TestOutcome(ok, "ok" if ok else "wrong", expected=_clip(expected),
                                              got=_clip(r.stdout)))
        elif r.reason == "timeout":
            grade.outcomes.append(TestOutcome(False, "budget" if limit < timeout_s else "timeout",
                                              error=f"did not finish within {limit:.3g} s"))
        else:
            grade.outcomes.append(TestOutcome(False, r.reason, got=_clip(r.stdout), error=_stderr_tail(r)))
    grade.seconds = time.monotonic() - t0
    grade.reason_counts = _counts(grade.outcomes)
    return grade


def normalize_output(text: str) -> str:
    """The output as compared: CRLF as LF, each line's trailing whitespace and blank lines at either end dropped."""
    return "\n".join(line.rstrip() for line in text.replace("\r\n", "\n").strip().split("\n"))


# ---------------------------------------------------------------------------------------------------- helpers

def _reports(stdout: str, nonce: str) -> list[dict]:
    """The harness's report lines of this run, in order (a line without the nonce is not one of them)."""
    out = []
    prefix = nonce + " "
    for line in stdout.splitlines():
        if line.startswith(prefix):
            try:
                m = ast.literal_eval(line[len(prefix):])
            except (ValueError, SyntaxError, MemoryError, RecursionError):
                continue
            if isinstance(m, dict):
                out.append(m)
    return out


def _outcome(m: dict) -> TestOutcome:
    passed = m.get("passed") is True
    return TestOutcome(passed, str(m.get("reason", "error")), expected=_clip(str(m.get("expected", ""))),
                       got=_clip(str(m.get("got", ""))), error=_clip(str(m.get("error", ""))))


def _died(r: SandboxResult, capped: bool, where: str) -> TestOutcome:
    """The outcome of the test a harness run died in, from how the sandbox saw the run end."""
    if r.reason == "timeout":
        return TestOutcome(False, "budget" if capped else "timeout", error=f"the program hung {where}")
    if r.reason == "killed" and r.exit_code == -signal.SIGPROF:  # the harness's CPU timer: stuck in C code
        return TestOutcome(False, "timeout", error=f"the program ran out of CPU time {where}")
    if r.reason in ("ok", "error"):  # the process ended by itself without a result: os._exit, a fatal error
        return TestOutcome(False, "exited", error=f"the program exited {where} (status {r.exit_code})")
    if r.reason == "killed":
        return TestOutcome(False, "killed", error=f"the program was killed by {_signal_name(r.exit_code)} {where}")
    return TestOutcome(False, r.reason, error=f"{r.reason} {where}" + (f": {_stderr_tail(r)}" if
                                                                      r.reason == "sandbox_error" else ""))


def _signal_name(code: Optional[int]) -> str:
    try:
        return signal.Signals(-code).name if code is not None else "a signal"
    except ValueError:
        return f"signal {-code}"


def _stderr_tail(r: SandboxResult) -> str:
    if r.reason == "killed":
        return f"killed by {_signal_name(r.exit_code)}"
    text = r.stderr.strip()
    return text if len(text) <= MAX_TEXT else "..." + text[-(MAX_TEXT - 3):]  # the end: the exception is last


def _clip(text: str) -> str:
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 3] + "..."


def _counts(outcomes: list[TestOutcome]) -> dict[str, int]:
    out: dict[str, int] = {}
    for o in outcomes:
        if not o.passed:
            out[o.reason] = out.get(o.reason, 0) + 1
    return out
