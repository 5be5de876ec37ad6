"""The built-in environments against hand-written conversations: the calculator (expected values by Python's own
arithmetic), tool-call parsing, guess-the-number (played by bisection), tool_math (scored like the demo)."""
import json
import random

import pytest

from megatron_rl.environments.calculator import MAX_INT_DIGITS, CalculatorError, calculator
from megatron_rl.environments.guess_number import GuessNumber, parse_guess, secret_for
from megatron_rl.environments.interface import validate_step
from megatron_rl.environments.runner import EnvironmentPool
from megatron_rl.environments.tool_calls import ToolCall, answer_calls, parse_tool_calls
from megatron_rl.environments.tool_math import ToolMath


def call(expression, name="calculator"):
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"expression": expression}}) + "</tool_call>"


# ---- calculator ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("expression, value", [
    ("2 + 3 * 4", 2 + 3 * 4),
    ("(2 + 3) * 4", (2 + 3) * 4),
    ("7 / 2", 7 / 2),
    ("6 / 2", 6 / 2),
    ("-7 // 2", -7 // 2),
    ("-7 % 3", -7 % 3),
    ("2 ** 10", 2 ** 10),
    ("2 ** -2", 2 ** -2),
    ("-2 ** 2", -2 ** 2),
    ("(-2) ** 3", (-2) ** 3),
    ("+5 - -3", +5 - -3),
    ("1.5e3 * 2", 1.5e3 * 2),
    ("0.1 + 0.2", 0.1 + 0.2),
    ("12345678901234567890 * 98765432109876543210", 12345678901234567890 * 98765432109876543210),
    ("10 ** 999", 10 ** 999),
    ("1_000 + 1", 1_000 + 1),
    ("  3  ", 3),
    ("(" * 100 + "1" + ")" * 100, 1),  # parentheses are no nodes of the tree
])
def test_calculator_matches_python_arithmetic(expression, value):
    assert calculator(expression) == (str(value) if isinstance(value, int) else repr(value))


@pytest.mark.parametrize("expression, message", [
    ("__import__('os').system('true')", "a function call is not allowed"),
    ("x + 1", "a name is not allowed"),
    ("(1).real", "an attribute is not allowed"),
    ("[1, 2][0]", "a subscript is not allowed"),
    ("1 < 2", "a comparison is not allowed"),
    ("'a' * 3", "only numbers are allowed"),
    ("True + 1", "only numbers are allowed"),
    ("1j * 2", "only numbers are allowed"),
    ("1 << 100", "the operator LShift"),
    ("1 / 0", "division by zero"),
    ("5 % 0", "division by zero"),
    ("0 ** -1", "division by zero"),
    ("9 ** 9 ** 9", "exponent 387420489 larger than"),
    ("10 ** 1001", "more than 1000"),
    ("(10 ** 600) * (10 ** 600)", f"more than {MAX_INT_DIGITS} digits"),
    ("2.0 ** 5000", "result too large"),
    ("1e308 * 10", "not finite"),
    ("(-8) ** 0.5", "not a real number"),
    ("1 +", "not an arithmetic expression"),
    ("", "empty expression"),
    ("1" * 1001, "longer than 1000"),
    ("(" * 499 + "1" + ")" * 499, "not an arithmetic expression"),  # Python's parser: too many parentheses
    ("-" * 100 + "1", "nested deeper"),
    ("1 + " * 60 + "1", "nested deeper"),
])
def test_calculator_refuses_with_a_reason(expression, message):
    with pytest.raises(CalculatorError) as e:
        calculator(expression)
    assert message in str(e.value), str(e.value)


# ---- tool calls ---------------------------------------------------------------------------------------------------

def test_parse_tool_calls_forms():
    text = ('Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "2+2"}}</tool_call> and '
            '<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"3*3\\"}"}\n</tool_call>')
    assert [(c.name, c.arguments, c.error) for c in parse_tool_calls(text)] == [
        ("calculator", {"expression": "2+2"}, None), ("calculator", {"expression": "3*3"}, None)]
    # cut off by the stop string: the last call has no closing tag
    cut = parse_tool_calls('ok <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}')
    assert [(c.name, c.arguments) for c in cut] == [("calculator", {"expression": "1+1"})]
    assert parse_tool_calls("no calls here, just <tool> talk") == []


@pytest.mark.parametrize("body, error", [
    ('{"name": "calculator", "arguments": {"expression": "1"}', "not valid JSON"),
    ("", "empty call"),
    ("[1, 2]", "must be a JSON object"),
    ('{"arguments": {}}', 'no "name"'),
    ('{"name": "calculator", "arguments": [1]}', '"arguments" must be a JSON object'),
    ('{"name": "calculator", "arguments": "{oops"}', '"arguments" is a string but not valid JSON'),
    ("[" * 100_000, "longer than 10000"),
])
def test_malformed_calls_carry_an_error(body, error):
    (c,) = parse_tool_calls(f"<tool_call>{body}</tool_call>")
    assert c.error and error in c.error, c


def test_answer_calls_answers_each_and_errors_are_messages():
    text = call("6 * 7") + "<tool_call>{bad json</tool_call>" + call("1/0") + call("2", name="search") + \
        '<tool_call>{"name": "calculator", "arguments": {"expr": "1"}}</tool_call>'
    msgs, errors = answer_calls(parse_tool_calls(text), {"calculator": calculator})
    assert [m["role"] for m in msgs] == ["tool"] * 5
    assert msgs[0]["content"] == str(6 * 7)
    assert msgs[1]["content"].startswith("error: the call is not valid JSON")
    assert msgs[2]["content"] == "error: division by zero"
    assert msgs[3]["content"] == "error: unknown tool 'search' (available: calculator)"
    assert msgs[4]["content"].startswith("error: calculator:") and "expression" in msgs[4]["content"]
    assert errors == 4

    def buggy(expression):
        raise KeyError("tool bug")

    with pytest.raises(KeyError):  # a bug in a tool is not the model's error: it propagates
        answer_calls([ToolCall("calculator", {"expression": "1"})], {"calculator": buggy})


# ---- guess the number ---------------------------------------------------------------------------------------------

def say(messages, text):
    return messages + [{"role": "assistant", "content": text}]


def test_guess_number_played_by_bisection_wins():
    for seed in range(20):
        env = GuessNumber(lo=1, hi=100, max_turns=7)
        messages = env.reset({"seed": seed})
        assert [m["role"] for m in messages] == ["system", "user"] and "[1, 100]" in messages[1]["content"]
        lo, hi, result = 1, 100, None
        for turn in range(7):
            guess = (lo + hi) // 2
            messages = say(messages, f"I think <guess>{guess}</guess>")
            result = validate_step(env.step(messages))
            if result.done:
                break
            feedback = result.observation[0]
            assert feedback["role"] == "user"
            if feedback["content"].startswith("higher"):
                lo = guess + 1
            else:
                assert feedback["content"].startswith("lower")
                hi = guess - 1
            messages += result.observation
        assert result.done and result.reward == 1.0 and result.metrics["solved"] == 1
        assert guess == random.Random(seed).randint(1, 100)  # the documented derivation of the secret


def test_guess_number_runs_out_and_format_error():
    env = GuessNumber(lo=1, hi=10, max_turns=2)
    messages = env.reset({"secret": 7})
    r = env.step(say(messages, "<guess>3</guess>"))
    assert r.observation == [{"role": "user", "content": "higher (1 guess left)"}] and not r.done
    r = env.step(say(messages, "<guess> 9 </guess>"))
    assert (r.observation, r.reward, r.done, r.metrics) == (None, 0.0, True, {"solved": 0, "guesses": 1})
    env.reset({"secret": 7})
    r = env.step(say(messages, "seven!"))
    assert (r.reward, r.done, r.metrics["format_error"]) == (0.0, True, 1)
    assert parse_guess("<guess>1</guess> no, <GUESS>-4</GUESS>") == -4
    # without seed or secret: a stable hash of the item, the same across instances
    assert secret_for({"q": "a"}, 1, 100) == secret_for({"q": "a"}, 1, 100)
    assert len({secret_for({"q": i}, 1, 100) for i in range(50)}) > 20
    with pytest.raises(ValueError, match="lo <= hi"):
        GuessNumber(lo=5, hi=1)


# ---- tool math ----------------------------------------------------------------------------------------------------

CHAIN_SUM = {"question": "State the final answer to the following arithmetic problem: 37 + 45 - 19 =",
             "answer": str(37 + 45 - 19)}


def test_tool_math_calls_then_answers():
    env = ToolMath(max_tool_calls=3)
    messages = env.reset(CHAIN_SUM)
    assert [m["role"] for m in messages] == ["system", "user"] and messages[1]["content"] == CHAIN_SUM["question"]
    assert "<tool_call>" in messages[0]["content"] and "<answer></answer>" in messages[0]["content"]
    messages = say(messages, "First the sum. " + call("37 + 45"))
    r = env.step(messages)
    assert (r.observation, r.done, r.metrics) == ([{"role": "tool", "content": str(37 + 45)}], False,
                                                  {"tool_calls": 1, "tool_errors": 0})
    messages = say(messages + r.observation, call("82 - 19") + call("bad("))
    r = env.step(messages)
    assert r.observation == [{"role": "tool", "content": str(82 - 19)},
                             {"role": "tool", "content": r.observation[1]["content"]}]
    assert r.observation[1]["content"].startswith("error: not an arithmetic expression")
    assert r.metrics == {"tool_calls": 2, "tool_errors": 1}  # this step's: the loop sums them
    r = env.step(say(messages + r.observation, f"So it is {37 + 45 - 19}. <answer>{37 + 45 - 19}</answer>"))
    assert (r.observation, r.reward, r.done) == (None, 1.0, True)
    assert r.metrics == {"tool_calls": 0, "tool_errors": 0, "correct": 1, "answered": 1}


def test_tool_math_wrong_unformatted_and_over_budget():
    env = ToolMath(max_tool_calls=1)
    messages = env.reset(CHAIN_SUM)
    r = env.step(say(messages, "<answer>64</answer>"))
    assert (r.reward, r.done, r.metrics["correct"], r.metrics["answered"]) == (0.0, True, 0, 1)
    env.reset(CHAIN_SUM)
    r = env.step(say(messages, "It is 63."))  # right number, but not in the demo's answer tags
    assert (r.reward, r.done, r.metrics["answered"]) == (0.0, True, 0)
    env.reset(CHAIN_SUM)
    r = env.step(say(messages, call("1+1") + call("2+2")))
    assert (r.reward, r.done, r.metrics["tool_budget_exceeded"]) == (0.0, True, 1)
    # math-verify for rows that are not reasoning-gym's: equivalent forms count
    env = ToolMath(answer_format="boxed")
    messages = env.reset({"question": "Half of one?", "answer": "1/2"})
    assert env.step(say(messages, "\\boxed{0.5}")).reward == 1.0


def test_tool_math_in_workers_with_a_reasoning_gym_row():
    """Through the pool, as the rollout runs it: a chain_sum entry as reasoning-gym produces it, scored by
    reasoning-gym's own chain_sum scorer (the demo's)."""
    import reasoning_gym

    entry = reasoning_gym.create_dataset("chain_sum", seed=3, size=1, min_terms=2, max_terms=2, min_digits=1,
                                         max_digits=2)[0]
    item = {"question": entry["question"], "answer": entry["answer"], "task": "chain_sum", "entry": entry,
            "task_params": {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2}}
    expression = entry["metadata"]["expression"]
    a, op, b = expression.split()  # "a + b" or "a - b": the expected tool result, by Python's arithmetic
    value = int(a) + int(b) if op == "+" else int(a) - int(b)
    with EnvironmentPool("megatron_rl.environments.tool_math:ToolMath", {"max_tool_calls": 2}, num_workers=1,
                         timeout_s=30) as pool:
        (messages, messages_b) = pool.reset(["right", "wrong"], [item, item])
        convs = [say(messages, call(expression)), say(messages_b, "<answer>1000</answer>")]
        tool, wrong = pool.step(["right", "wrong"], convs)
        assert tool.observation == [{"role": "tool", "content": str(value)}] and str(value) == entry["answer"]
        assert (wrong.reward, wrong.done) == (0.0, True)
        (final,) = pool.step(["right"], [say(convs[0] + tool.observation, f"<answer>{entry['answer']}</answer>")])
        assert (final.reward, final.done, final.metrics["tool_calls"]) == (1.0, True, 0)
        assert tool.metrics["tool_calls"] == 1
        assert pool.errors == {"raised": 0, "timeout": 0, "garbage": 0, "worker_died": 0}


def test_tool_math_few_shot_and_no_calculator():
    """few_shot conversations go between the system message and the question, in order; calculator=false offers no
    tool (the no-tool arm of configs/tool_math_nocalc_cpu.yaml): its prompt names none and a call is an error."""
    shot = [{"role": "user", "content": "1 + 2 ="}, {"role": "assistant", "content": call("1 + 2")},
            {"role": "tool", "content": "3"}, {"role": "assistant", "content": "<answer>3</answer>"}]
    env = ToolMath(few_shot=[shot, shot[:1] + [{"role": "assistant", "content": "<answer>3</answer>"}]])
    messages = env.reset(CHAIN_SUM)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant", "user",
                                             "assistant", "user"]
    assert messages[1:5] == shot and messages[-1]["content"] == CHAIN_SUM["question"]
    bare = ToolMath(calculator=False)
    messages = bare.reset(CHAIN_SUM)
    assert "<tool_call>" not in messages[0]["content"] and "<answer></answer>" in messages[0]["content"]
    r = bare.step(say(messages, call("37 + 45")))
    assert r.observation[0]["content"].startswith("error: unknown tool 'calculator'") and not r.done
    assert r.metrics == {"tool_calls": 1, "tool_errors": 1}
    assert bare.step(say(messages, f"<answer>{37 + 45 - 19}</answer>")).reward == 1.0


@pytest.mark.parametrize("few_shot, message", [
    ("1 + 2", "few_shot must be a list"),
    ([[]], r"few_shot\[0\] must be a non-empty list"),
    ([[{"role": "user", "content": "q"}, {"role": "robot", "content": "a"}]], r"few_shot\[0\]\[1\] must be"),
    ([[{"role": "assistant", "content": "a"}]], r"few_shot\[0\] must start with a user message"),
])
def test_tool_math_few_shot_refused_with_its_position(few_shot, message):
    with pytest.raises(ValueError, match=message):
        ToolMath(few_shot=few_shot)
