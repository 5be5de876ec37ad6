"""CodeTests (megatron_rl/environments/code_tests.py) with real sandbox runs, no mocks: rewards as fractions of tests
passed, both test forms, hostile programs contained, the feedback variant, one trajectory through EnvironmentPool, and
ToolMath's optional python tool.

Expected fractions are computed here independently, by running the (safe) candidate in this process on the same
inputs. Timeouts are 1 s so the suite stays short.
"""
import json
import time

import pytest

from megatron_rl.environments.code_tests import CodeTests, extract_code, parse_tests
from megatron_rl.environments.interface import trajectory_reward, validate_step
from megatron_rl.environments.runner import EnvironmentPool
from megatron_rl.environments.sandbox import capabilities
from megatron_rl.environments.tool_math import ToolMath

ADD = {"question": "Write add(a, b) returning the sum.", "entry_point": "add",
       "tests": ["assert add(1, 2) == 3", "assert add(-4, 4) == 0", "assert add(10, 5) == 15"]}
SUM_STDIN = {"question": "Read two integers and print their sum.",
             "tests": [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5", "output": "10"},
                       {"input": "-3 1\n", "output": "-2"}]}


def answer(code: str, prose: str = "Here is my solution.") -> dict:
    return {"role": "assistant", "content": f"{prose}\n```python\n{code}\n```\n"}


def play(env: CodeTests, item: dict, *replies: dict):
    """reset, then one step per reply; the StepResults (validated as the worker would)."""
    messages = env.reset(item)
    results = []
    for reply in replies:
        messages.append(reply)
        r = validate_step(env.step(messages))
        results.append(r)
        if r.done:
            break
        messages += r.observation
    return messages, results


def test_correct_solution_gets_one():
    messages, [r] = play(CodeTests(), ADD, answer("def add(a, b):\n    return a + b"))
    assert messages[0]["role"] == "system" and "```python" in messages[0]["content"]
    assert messages[1]["content"].startswith(ADD["question"]) and "`add`" in messages[1]["content"]
    assert (r.reward, r.done, r.observation) == (1.0, True, None)
    assert r.metrics["tests_passed"] == r.metrics["tests_total"] == 3
    assert r.metrics["solved"] == 1 and r.metrics["format_error"] == 0 and r.metrics["sandbox_runs"] == 1
    assert 0 < r.metrics["sandbox_s"] < 5
    assert not [k for k in r.metrics if k.startswith("fail_")]


def test_partly_correct_solution_gets_the_fraction_computed_in_process():
    candidate = ("def is_even(n):\n"
                 "    if n > 5:\n"
                 "        return n % 3 == 0  # wrong past 5\n"
                 "    return n % 2 == 0\n")
    inputs = range(12)
    tests = [f"assert is_even({n}) == {n % 2 == 0}" for n in inputs]
    ns: dict = {}
    exec(candidate, ns)  # safe code: the expected fraction straight from the candidate
    expected = sum(ns["is_even"](n) == (n % 2 == 0) for n in inputs) / len(tests)
    assert 0 < expected < 1
    _, [r] = play(CodeTests(), {"question": "is_even", "tests": tests}, answer(candidate))
    assert r.reward == pytest.approx(expected)
    assert r.metrics["tests_passed"] == round(expected * len(tests))
    assert r.metrics["fail_wrong"] == len(tests) - r.metrics["tests_passed"]


def test_no_code_block_is_a_format_error():
    _, [r] = play(CodeTests(max_attempts=3), ADD, {"role": "assistant", "content": "def add(a, b): return a + b"})
    assert (r.reward, r.done) == (0.0, True)
    assert r.metrics["format_error"] == 1 and r.metrics["sandbox_runs"] == 0


def test_the_last_python_block_is_the_answer():
    text = ("First try:\n```python\ndef add(a, b):\n    return a - b\n```\nBetter:\n```py\n"
            "def add(a, b):\n    s = '```'\n    return a + b\n```\nA usage example:\n```\nadd(1, 2)\n```")
    assert extract_code(text) == "def add(a, b):\n    s = '```'\n    return a + b\n"
    _, [r] = play(CodeTests(), ADD, {"role": "assistant", "content": text})
    assert r.reward == 1.0


def test_stdin_stdout_cases():
    program = "a, b = map(int, input().split())\nprint(a + b if a > 0 else a - b)"  # wrong for a <= 0
    messages, [r] = play(CodeTests(), SUM_STDIN, answer(program))
    assert "standard input" in messages[0]["content"]
    expected = sum((a + b if a > 0 else a - b) == a + b for a, b in [(1, 2), (5, 5), (-3, 1)]) / 3
    assert r.reward == pytest.approx(expected) and r.metrics["sandbox_runs"] == 3
    # the columnar form (APPS input_output, here as the JSON string APPS stores) reads as the same cases
    columnar = {"question": "sum", "tests": '{"inputs": ["1 2\\n", "5 5"], "outputs": ["3\\n", "10\\n\\n"]}'}
    _, [r] = play(CodeTests(), columnar, answer("print(sum(map(int, input().split())))"))
    assert r.reward == 1.0


def test_a_hanging_test_fails_within_its_timeout_and_the_others_count():
    code = ("def add(a, b):\n"
            "    if a == -4:\n"
            "        while True:\n"
            "            pass\n"
            "    return a + b\n")
    t0 = time.monotonic()
    _, [r] = play(CodeTests(timeout_s=1.0), ADD, answer(code))
    assert time.monotonic() - t0 < 1.0 + 3.0
    assert r.reward == pytest.approx(2 / 3) and r.metrics["fail_timeout"] == 1
    # stuck in C (no Python-level signal gets in) and a hang that swallows the alarm: the CPU timer and the run's
    # wall limit end them, and the test after still runs in a fresh harness run
    code_c = "def add(a, b):\n    if a == -4:\n        return 10 ** 10 ** 9\n    return a + b\n"
    _, [r] = play(CodeTests(timeout_s=1.0), ADD, answer(code_c))
    assert r.reward == pytest.approx(2 / 3) and r.metrics["fail_timeout"] == 1
    # stdin form: the program itself hangs on one input
    hang = "a, b = map(int, input().split())\nwhile a == 5:\n    pass\nprint(a + b)"
    _, [r] = play(CodeTests(timeout_s=1.0), SUM_STDIN, answer(hang))
    assert r.reward == pytest.approx(2 / 3) and r.metrics["fail_timeout"] == 1


def test_the_step_budget_bounds_many_hanging_tests():
    item = {"question": "f", "tests": [f"assert f({i}) == {i}" for i in range(6)]}
    t0 = time.monotonic()
    _, [r] = play(CodeTests(timeout_s=1.0, time_budget_s=1.5), item,
                  answer("import time\ndef f(x):\n    time.sleep(100)"))
    assert time.monotonic() - t0 < 1.5 + 2.0
    # a count of 0 is left out of the metrics: on a loaded machine the budget can end even the first test
    assert r.reward == 0.0 and r.metrics.get("fail_timeout", 0) + r.metrics["fail_budget"] == 6
    assert r.metrics["fail_budget"] >= 4


@pytest.mark.parametrize("code, item", [
    ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", ADD),  # fork bomb
    ("def add(a, b):\n    import os\n    while True:\n        try:\n            os.fork()\n"
     "        except OSError:\n            pass", ADD),  # a fork bomb inside the tests
    ("while True:\n    print('x' * 65536)", SUM_STDIN),  # a flood of output: cut at the cap
    ("def add(a, b):\n    print('x' * 2**30)\n    return a + b + 1", ADD),  # a gigabyte: MemoryError at 512 MB
    ("def add(a, b):\n    return len(bytearray(2**34))", ADD),  # a huge allocation
    ("import os\nprint(open('/proc/%d/environ' % os.getppid()).read())", SUM_STDIN),  # the parent's environment
], ids=["fork_bomb", "fork_bomb_in_test", "output_flood", "gigabyte_print", "huge_alloc", "read_environ"])
def test_hostile_code_gets_zero_and_the_environment_keeps_working(code, item):
    _, [r] = play(CodeTests(timeout_s=1.0), item, answer(code))
    assert r.reward == 0.0 and r.done
    fails = {k: v for k, v in r.metrics.items() if k.startswith("fail_")}
    assert sum(fails.values()) == 3, fails
    # the next trajectory is scored normally
    good = "def add(a, b):\n    return a + b" if item is ADD else "print(sum(map(int, input().split())))"
    _, [r] = play(CodeTests(timeout_s=1.0), item, answer(good))
    assert r.reward == 1.0


def test_processes_a_test_leaves_running_are_killed_before_the_next_test():
    code = ("import os, time\n"
            "children = []\n"
            "def spawn():\n"
            "    pid = os.fork()\n"
            "    if pid == 0:\n"
            "        os.setsid()\n"
            "        while True:\n"
            "            pass\n"
            "    children.append(pid)\n"
            "    return True\n"
            "def alive():\n"
            "    time.sleep(0.05)\n"
            "    try:\n"
            "        os.kill(children[-1], 0)\n"
            "    except ProcessLookupError:\n"
            "        return False\n"
            "    return True\n")
    item = {"question": "q", "tests": ["assert spawn() == True", "assert alive() == False"] * 2}
    if not capabilities()["pids_cgroup"]:
        pytest.skip("no per-call pids cgroup here: leftovers live until the run ends")
    _, [r] = play(CodeTests(), item, answer(code))
    assert r.reward == 1.0, r.metrics


def test_shortcuts_do_not_pass():
    always_equal = "class Any:\n    def __eq__(self, other):\n        return True\n\ndef add(a, b):\n    return Any()"
    for code in [always_equal, "import sys\nsys.exit(0)", "import os\nos._exit(0)",
                 "def add(a, b):\n    import os\n    os._exit(0)"]:
        _, [r] = play(CodeTests(), ADD, answer(code))
        assert r.reward == 0.0, code


def test_feedback_names_the_first_failing_test_then_the_second_attempt_is_scored():
    env = CodeTests(max_attempts=2)
    wrong = answer("def add(a, b):\n    return a * b if a > 0 else a + b")  # passes only add(-4, 4)
    messages, results = play(env, ADD, wrong, answer("def add(a, b):\n    return a + b"))
    first, second = results
    assert (first.reward, first.done) == (0.0, False) and first.metrics == {
        "attempts": 1, "sandbox_s": first.metrics["sandbox_s"], "sandbox_runs": 1}
    [feedback] = first.observation
    assert feedback["role"] == "user"
    text = feedback["content"]
    assert "passed 1 of 3" in text and "assert add(1, 2) == 3" in text and "Expected: 3" in text
    assert "Got: 2" in text and "assert add(10, 5)" not in text
    assert (second.reward, second.done) == (1.0, True) and second.metrics["tests_passed"] == 3
    assert trajectory_reward(results) == 1.0  # the last attempt's reward only
    assert messages[-2] == feedback


def test_feedback_variants():
    # an error: the last lines of the traceback; hidden tests: no test content at all
    _, [r, _] = play(CodeTests(max_attempts=2), ADD, answer("def add(a, b):\n    return a / 0"),
                     answer("def add(a, b):\n    return 0"))
    assert "ZeroDivisionError" in r.observation[0]["content"] and "return a / 0" in r.observation[0]["content"]
    _, [r, last] = play(CodeTests(max_attempts=2, reveal_tests=False), ADD, answer("def add(a, b):\n    return 1 / 0"),
                        answer("def add(a, b):\n    return 0 if a == 10 else a + b"))
    text = r.observation[0]["content"]
    assert "raised ZeroDivisionError" in text and "add(1, 2)" not in text and "passed 0 of 3" in text
    assert last.done and last.reward == pytest.approx(2 / 3)
    # stdin form: the input, the expected output and what the program printed
    _, [r, _] = play(CodeTests(max_attempts=2), SUM_STDIN, answer("print(0)"), answer("print(0)"))
    text = r.observation[0]["content"]
    assert "1 2" in text and "Expected output:\n```\n3\n```" in text and "Your output:\n```\n0\n```" in text


def test_rows_without_tests_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="'tests'"):
        CodeTests().reset({"question": "q"})
    with pytest.raises(ValueError, match="empty"):
        parse_tests({"tests": []})
    with pytest.raises(ValueError, match=r"tests'\]\[1\].*one form"):
        parse_tests({"tests": ["assert f(1) == 1", {"input": "1", "output": "1"}]})
    with pytest.raises(ValueError, match=r"tests'\]\[0\] is not valid Python"):
        parse_tests({"tests": ["assert f(1) =="]})
    with pytest.raises(ValueError, match="fn_name"):
        parse_tests({"tests": {"inputs": [[1]], "outputs": [1], "fn_name": "f"}})
    with pytest.raises(ValueError, match="max_attempts"):
        CodeTests(max_attempts=0)


def test_through_the_environment_pool():
    """The real worker path: the class loaded by its import path in a worker, under the worker's soft timeout."""
    with EnvironmentPool("megatron_rl.environments.code_tests:CodeTests", {"max_attempts": 2}, num_workers=1,
                         timeout_s=10.0) as pool:
        openings = pool.reset(["good", "fixed"], [ADD, SUM_STDIN])
        assert all(isinstance(o, list) for o in openings), openings
        convs = [openings[0] + [answer("def add(a, b):\n    return a + b")], openings[1] + [answer("print(1)")]]
        good, retry = pool.step(["good", "fixed"], convs)
        assert (good.reward, good.done) == (1.0, True) and good.metrics["tests_passed"] == 3
        assert not retry.done and "Expected output" in retry.observation[0]["content"]
        convs[1] += retry.observation + [answer("print(sum(map(int, input().split())))")]
        [fixed] = pool.step(["fixed"], [convs[1]])
        assert (fixed.reward, fixed.done) == (1.0, True)
        assert pool.errors == {"raised": 0, "timeout": 0, "garbage": 0, "worker_died": 0}


def test_tool_math_python_tool():
    """ToolMath(python=True): a `python` tool call runs in the sandbox and is answered with its stdout; off by
    default."""
    def call(env, code):
        env.reset({"question": "What is 2 ** 10?", "answer": "1024"})
        text = '<tool_call>{"name": "python", "arguments": {"code": %s}}</tool_call>' % json.dumps(code)
        return validate_step(env.step([{"role": "assistant", "content": text}]))

    env = ToolMath(python=True, python_timeout_s=1.0)
    assert '"name": "python"' in env.reset({"question": "q", "answer": "1"})[0]["content"]
    r = call(env, "print(2 ** 10)")
    assert r.observation == [{"role": "tool", "content": "1024\n"}] and r.metrics["tool_errors"] == 0
    r = call(env, "1 / 0")
    text = r.observation[0]["content"]
    assert text.startswith("error: the code failed (exit status 1): Traceback") and "ZeroDivisionError" in text
    assert r.metrics["tool_errors"] == 1
    r = call(env, "while True:\n    pass")
    assert r.observation[0]["content"] == "error: timeout: the code did not finish within 1 s"
    r = call(ToolMath(), "print(1)")
    assert "unknown tool 'python'" in r.observation[0]["content"]
    assert '"python"' not in ToolMath().reset({"question": "q", "answer": "1"})[0]["content"]
