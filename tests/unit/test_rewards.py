"""Rewards: extraction, math-verify equivalence, reasoning-gym scoring, and the sandbox (timeouts, errors, hostility).

The scorers below are injected into the worker processes by name (this module is imported there), so keep this
file's imports light.
"""
import os
import signal
import sys
import time

import pytest

from megatron_rl.config.schema import RewardConfig
from megatron_rl.data.datasets import PromptItem
from megatron_rl.rewards import (
    RewardFn, extract_answer, extract_answer_is, extract_answer_tag, extract_boxed, extract_last_number,
    is_well_formed, resolve_kind,
)
from megatron_rl.rewards.extract import extract_answer_with_source, has_latex
from megatron_rl.rewards import worker
from megatron_rl.rewards.pool import TimeoutPool

TIMEOUT = 1.0
SLACK = 2.5  # kill grace (1 s) + pool replacement + a loaded 2-core machine


# ---- scorers run inside the workers --------------------------------------------------------------------------------

def misbehaving_scorer(payload):
    c = payload["completion"]
    if c == "HANG_IN_C":  # SIGALRM blocked: like work stuck in C, only the parent's kill can end it
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
        time.sleep(120)
    if c == "SPIN":  # pure-python loop: the worker's soft timeout ends it without killing the worker
        while True:
            pass
    if c == "RAISE":
        raise RuntimeError("verifier bug")
    if c == "DIE":
        os._exit(3)
    if c == "ALLOC":  # beyond reward.worker_memory_mb: MemoryError in the worker, not a swapping host
        return {"score": min(1.0, float(len(bytearray(3 * 2 ** 30)))), "format_ok": True}
    if c == "BAD_SCORE":
        return {"score": float("nan"), "format_ok": True}
    return worker.score_sample(payload)


# ---- extraction (pure string functions) ----------------------------------------------------------------------------

@pytest.mark.parametrize("text, expected", [
    ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}} and then \\boxed{{a}+{b}}", "{a}+{b}"),
    ("$\\boxed{x^{2}}$.", "x^{2}"),
    ("\\boxed 5 is it", "5"),
    ("\\fbox{7}", "7"),
    ("\\boxed{unbalanced", None),
    ("no box", None),
])
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_extract_tag_answer_is_and_last_number():
    assert extract_answer_tag("think <answer>1</answer> no wait <answer> 17 </answer>") == "17"
    assert extract_answer_tag("<answer>\\boxed{\\frac{1}{2}}</answer>") == "\\frac{1}{2}"
    assert extract_answer_tag("<answer>$-4$.</answer>") == "-4"
    assert extract_answer_tag("<answer></answer>") is None
    assert extract_answer_is("So the answer is $\\frac{1}{2}$.\nDone") == "\\frac{1}{2}"
    assert extract_answer_is("The final answer is: **42**") == "42"
    assert extract_last_number("5 + 7 = 12, and 1,234.5 more") == "1234.5"
    assert extract_last_number("a/b is 3/4") == "3/4"
    assert extract_last_number("it costs 2,74 now") == "2.74" and extract_last_number("2,740 left") == "2740"
    assert extract_last_number("1,5 und 2,25") == "2.25" and extract_answer_tag("<answer>-0,5</answer>") == "-0.5"
    from megatron_rl.rewards.extract import trailing_number
    assert trailing_number("$x = 5$ is wrong; we get 7.") == "7" and trailing_number("\\(x\\) is 2,5") == "2.5"
    # no prose after the last formula, a number still inside math, or no closed formula at all
    assert [trailing_number(t) for t in ("so $x = 5$.", "so {3", "a $b$ c $d 4", "\\frac{1}{3", "x = 4")] == \
        [None, None, None, None, None]


def test_extract_answer_respects_answer_format():
    text = "The answer is 12. \\boxed{13} <answer>14</answer>"
    assert extract_answer(text, "answer_tag") == "14"
    assert extract_answer(text, "boxed") == "13"
    assert extract_answer(text, "auto") == "14"
    assert extract_answer("the answer is 12", "answer_tag") is None
    assert extract_answer("the answer is 12 (I think 13)", "auto") == "12 (I think 13)"
    assert extract_answer("I got 5 then 9", "auto") == "9"
    assert extract_answer("nothing here", "auto") is None


def test_free_text_last_number_only_without_latex():
    # the false-credit cases: the last number of LaTeX is a piece of an expression, never an answer on its own
    for text in ["so $x = \\frac{1}{3}$", "$\\sqrt{2}$", "The result is 2^{10}", "so x = 2\\sqrt{2}", "3\\pi",
                 "so {3", "\\boxed{3", "a \\(x = 5\\) b"]:
        assert has_latex(text), text
        assert extract_answer_with_source(text, "auto") == (None, "free"), text
    for text, num in [("I got 5 then 9", "9"), ("x^2 is 4", "4"), ("total: 1,000 apples", "1000")]:
        assert not has_latex(text)
        assert extract_answer_with_source(text, "auto") == (num, "free")
    assert extract_answer_with_source("<answer>2</answer> $x$", "auto") == ("2", "tag")
    assert extract_answer_with_source("so \\boxed{2} and $y$", "auto") == ("2", "boxed")
    assert extract_answer_with_source("The answer is $3$.", "auto") == ("3", "answer_is")
    assert extract_answer_with_source("I got 5", "boxed") == (None, None)


def test_well_formed():
    assert is_well_formed("<answer>3</answer>", "answer_tag")
    assert not is_well_formed("<answer>3</answer><answer>4</answer>", "answer_tag")
    assert not is_well_formed("<answer>3", "answer_tag")
    assert not is_well_formed("<answer> </answer>", "answer_tag")
    assert is_well_formed("\\boxed{3}", "boxed") and not is_well_formed("\\boxed{3", "boxed")
    assert is_well_formed("\\boxed{3}", "auto") and is_well_formed("<answer>3</answer>", "auto")


def test_resolve_kind():
    assert resolve_kind("auto", "reasoning_gym") == "reasoning_gym"
    assert resolve_kind("auto", "jsonl") == "math"
    assert resolve_kind("auto", "hf") == "math"  # verl-style parquet: math-verify against the ground truth
    assert resolve_kind("math", "reasoning_gym") == "math"


# ---- the sandboxed reward function ---------------------------------------------------------------------------------

def item(answer, **meta):
    return PromptItem(prompt_ids=[], prompt_text="", answer=answer, meta=meta, source="test")


@pytest.fixture(scope="module")
def math_reward():
    rf = RewardFn(RewardConfig(kind="auto", answer_format="auto", timeout_s=TIMEOUT, format_reward=0.1),
                  "jsonl", scorer=misbehaving_scorer)
    yield rf
    rf.close()


def test_math_verify_equivalence(math_reward, monkeypatch):
    # a tripwire, whatever other tests imported before: `import math_verify` fails in this process from here on, so
    # a verification that ran here instead of in the workers would show as errors and wrong rewards
    monkeypatch.setitem(sys.modules, "math_verify", None)
    cases = [("\\frac{1}{2}", "<answer>0.5</answer>", 1.1),
             ("0.5", "therefore \\boxed{\\frac{1}{2}}", 1.1),  # auto format: a box is well-formed too
             ("1000", "The answer is 1,000.", 1.0),
             ("\\frac{\\sqrt{3}}{2}", "<answer>\\dfrac{\\sqrt{3}}{2}</answer>", 1.1),
             ("3", "<answer>4</answer>", 0.1),  # wrong, but well-formed: only the format bonus
             ("3", "I have no idea", 0.0)]
    rewards, stats = math_reward.score([item(g) for g, _, _ in cases], [c for _, c, _ in cases])
    assert rewards == pytest.approx([r for _, _, r in cases])
    assert stats["num_correct"] == 4 and stats["num_format_ok"] == 4 and stats["num_no_answer"] == 1
    assert stats["num_timeouts"] == stats["num_errors"] == 0


def test_pathological_math_times_out_and_is_counted(math_reward):
    t0 = time.monotonic()
    rewards, stats = math_reward.score([item("3")] * 4,
                                       ["<answer>\\prod_{n=1}^{10^{7}} n</answer>", "<answer>9^{9^{9^{9}}}</answer>",
                                        "<answer>9**9**9**9</answer>", "<answer>3</answer>"])
    assert time.monotonic() - t0 < TIMEOUT + SLACK
    # the product grinds in sympy until the timeout; the power tower is refused by its size at once (wrong, but
    # well-formed: the format bonus only)
    assert rewards == pytest.approx([0.0, 0.1, 0.1, 1.1])
    assert stats["num_timeouts"] == 1


def test_hang_in_c_is_killed_and_does_not_block_later_batches(math_reward):
    before = math_reward._pool.num_restarts
    t0 = time.monotonic()
    rewards, stats = math_reward.score([item("2")] * 4, ["HANG_IN_C", "<answer>2</answer>", "SPIN", "\\boxed{2}"])
    elapsed = time.monotonic() - t0
    assert elapsed < TIMEOUT + SLACK, elapsed
    assert rewards == pytest.approx([0.0, 1.1, 0.0, 1.1])
    assert stats["num_timeouts"] == 2 and stats["num_pool_restarts"] == 1
    assert math_reward._pool.num_restarts == before + 1
    t0 = time.monotonic()
    rewards, stats = math_reward.score([item("5")] * 3, ["<answer>5</answer>"] * 3)
    assert rewards == pytest.approx([1.1] * 3) and stats["num_pool_restarts"] == 0
    assert time.monotonic() - t0 < 2 * TIMEOUT


# (gold, completion, score): free text (no tag, box or "answer is") unless noted; the auto format of JSONL math data
ADVERSARIAL = [
    # fractions, roots, powers: the last bare number is part of a larger expression
    ("3", "so $x = \\frac{1}{3}$", 0.0), ("1/3", "so $x = \\frac{1}{3}$", 1.0),
    ("\\frac{1}{3}", "so $x = \\frac{1}{3}$", 1.0), ("3", "so x = 1/3", 0.0), ("1/3", "so x = 1/3", 1.0),
    ("2", "$\\sqrt{2}$", 0.0), ("\\sqrt{2}", "so it is $\\sqrt{2}$.", 1.0), ("2", "so x = 2\\sqrt{2}", 0.0),
    ("2\\sqrt{2}", "so $x = 2\\sqrt{2}$", 1.0), ("2", "The result is 2^{10}", 0.0),
    ("1024", "The result is $2^{10}$", 1.0), ("3", "$3^2$", 0.0), ("9", "$3^2$", 1.0), ("3", "$3\\pi$", 0.0),
    ("3", "3\\pi", 0.0), ("-3", "so $x=-3$", 1.0), ("3", "so $x=-3$", 0.0),
    # units
    ("3", "The length is $30\\,\\text{cm}$", 0.0), ("5", "The distance is $5\\text{ km}$", 1.0),
    ("5", "The distance is 5 km", 1.0),
    # several numbers: the final one counts
    ("3", "Maybe 3, maybe 5, I'd say 7", 0.0), ("7", "Maybe 3, maybe 5, I'd say 7", 1.0),
    # a box in the middle is the declared answer, whatever follows (boxed: well-formed, no bonus here)
    ("5", "First \\boxed{3}, then I changed my mind: 5", 0.0),
    ("3", "First \\boxed{3}, then I changed my mind: 5", 1.0),
    # unclosed braces
    ("3", "\\boxed{\\frac{1}{3}", 0.0), ("3", "\\boxed{3", 0.0), ("3", "so {3", 0.0),
    # a decimal comma (one or two digits after it) in a tag, after "answer is", in free text; three digits after a
    # comma are a thousands group
    ("2.74", "<answer>2,74</answer>", 1.0), ("2.74", "The answer is 2,74", 1.0), ("2.74", "Es sind 2,74 Euro", 1.0),
    ("-0.5", "<answer>-0,5</answer>", 1.0), ("2740", "The answer is 2,740", 1.0), ("2.74", "<answer>2,740</answer>", 0.0),
    # huge exponents: refused by size at once, no hang, no memory blow-up
    ("3", "$10^{10^{10}}$", 0.0), ("3", "\\boxed{10^{10^{10}}}", 0.0), ("3", "so 10^10^10", 0.0),
    ("3", "3 and then $9^{9^{9^{9}}}$", 0.0), ("3", "$(10^{10})!$", 0.0),
    # the final answer in reading order: prose after the last formula beats the formula; a formula last wins
    ("5", "$x=5$ is wrong; we get 7", 0.0), ("7", "$x=5$ is wrong; we get 7", 1.0),
    ("3", "$9^{9^{9^{9}}}$ and 3", 1.0), ("7", "We find $x = 5$. Then $y = 7$.", 1.0),
    ("5", "We find $x = 5$. Then $y = 7$.", 0.0), ("7", "First 7, then $x = \\frac{1}{2}$", 0.0),
]


@pytest.fixture(scope="module")
def patient_math_reward():
    # a generous timeout: on a loaded 2-core machine a first sympy comparison can take a second, and a right answer
    # lost to a timeout would hide a false negative
    rf = RewardFn(RewardConfig(kind="math", answer_format="auto", timeout_s=20.0), "jsonl")
    yield rf
    rf.close()


def test_adversarial_completions_score_only_when_right(patient_math_reward, monkeypatch):
    monkeypatch.setitem(sys.modules, "math_verify", None)  # the tripwire of test_math_verify_equivalence
    t0 = time.monotonic()
    rewards, stats = patient_math_reward.score([item(g) for g, _, _ in ADVERSARIAL], [c for _, c, _ in ADVERSARIAL])
    got = {(g, c): r for (g, c, _), r in zip(ADVERSARIAL, rewards)}
    assert got == {(g, c): s for g, c, s in ADVERSARIAL}
    assert stats["num_timeouts"] == stats["num_errors"] == 0  # the huge ones were refused, not timed out
    assert time.monotonic() - t0 < 30
    assert stats["answers"][0] == "x = \\frac{1}{3}"  # what math-verify read, for the logged samples


def test_size_guard_sizes_without_computing():
    import sympy

    from megatron_rl.rewards.math_answer import too_large

    def P(b, e):
        return sympy.Pow(b, e, evaluate=False)

    x = sympy.Symbol("x")
    assert not too_large([sympy.Integer(2) ** 100, sympy.Rational(1, 3), P(2, 1000), P(x, 10 ** 50), "a string"])
    assert not too_large([sympy.factorial(sympy.Integer(100), evaluate=False), sympy.Float(1e-300)])
    assert too_large([P(10, P(10, 10))]) and too_large([P(9, P(9, P(9, 9)))]) and too_large([P(2, 40_000)])
    assert too_large([P(x, P(10, P(10, 10)))]) and too_large([sympy.factorial(P(10, 10), evaluate=False)])
    assert too_large([sympy.Integer(3), 3 * P(10, 10 ** 6)])  # any candidate too large: the answer is refused


def test_raising_dying_and_invalid_verifiers_score_zero_and_are_counted(math_reward):
    rewards, stats = math_reward.score([item("1")] * 6, ["RAISE", "DIE", "<answer>1</answer>", "BAD_SCORE",
                                                         "<answer>1</answer>", "\\boxed{1}"])
    # the crash is pinned on its own sample: the ones in flight with it are retried, not blamed
    assert rewards == pytest.approx([0.0, 0.0, 1.1, 0.0, 1.1, 1.1])
    assert stats["num_errors"] == 3 and stats["num_timeouts"] == 0


def test_worker_memory_limit(math_reward):
    # 3 GiB against reward.worker_memory_mb=2048: refused at once (MemoryError), not minutes of host swapping
    rewards, stats = math_reward.score([item("1")] * 2, ["ALLOC", "<answer>1</answer>"])
    assert rewards == pytest.approx([0.0, 1.1])
    assert stats["num_errors"] == 1 and stats["num_timeouts"] == 0


def scorer_of_a_missing_module(payload):  # its __module__ is rewritten below: the worker cannot import it
    return worker.score_sample(payload)


def test_worker_start_up_failure_reports_the_workers_own_exception(monkeypatch):
    # a verifier whose module does not import in the worker (a dependency missing there): the message carries the
    # worker's traceback, not a guess about memory
    monkeypatch.setattr(scorer_of_a_missing_module, "__module__", "verifier_dependency_not_installed")
    pool = TimeoutPool(1, 2048, warm=(scorer_of_a_missing_module,))
    try:
        with pytest.raises(RuntimeError) as e:
            pool.map(scorer_of_a_missing_module, [{}], TIMEOUT)
    finally:
        pool.close()
    msg = str(e.value)
    assert "failed to start" in msg and "raised ModuleNotFoundError" in msg, msg
    assert "No module named 'verifier_dependency_not_installed'" in msg and "Traceback" in msg, msg
    assert "worker_memory_mb" not in msg, msg


def test_start_up_error_gives_the_memory_hint_only_for_memory():
    pool = TimeoutPool(2, 512)
    mem = pool._startup_error((11, "MemoryError", "Traceback ...\nMemoryError\n"), {}, 0)
    assert "raised MemoryError" in mem and "reward.worker_memory_mb=512" in mem
    imp = pool._startup_error((11, "ImportError", "Traceback ...\nImportError: x\n"), {}, 0)
    assert "ImportError: x" in imp and "worker_memory_mb" not in imp
    # died before reporting: the OOM killer's SIGKILL earns the hint, a plain exit does not; the sibling the
    # broken pool terminated is not blamed
    oom = pool._startup_error(None, {11: -signal.SIGKILL, 12: -signal.SIGTERM}, 0)
    assert "worker 11 exit status -9" in oom and "worker 12" not in oom and "worker_memory_mb=512" in oom
    died = pool._startup_error(("", None, None), {11: 1, 12: None}, 0)
    assert "worker 11 exit status 1" in died and "worker_memory_mb" not in died
    assert "1 of 2 reported ready" in pool._startup_error(None, {11: None, 12: None}, 1)


@pytest.mark.parametrize("kind", ["math", "reasoning_gym"])
def test_hostile_strings_score_zero_and_do_nothing(tmp_path, kind):
    marker = tmp_path / "pwned"
    payloads = [f"__import__('os').system('touch {marker}')",
                f"<answer>__import__('os').system('touch {marker}')</answer>",
                f"\\boxed{{__import__('pathlib').Path('{marker}').touch()}}",
                f"The answer is eval(\"open('{marker}', 'w')\")",
                "<answer>" + "{" * 5000 + "</answer>"]
    import reasoning_gym

    entry = reasoning_gym.create_dataset("chain_sum", seed=0, size=1)[0]
    it = item(entry["answer"], task="chain_sum", task_params={}, entry=entry)
    with RewardFn(RewardConfig(kind=kind, timeout_s=TIMEOUT), "reasoning_gym") as rf:
        rewards, stats = rf.score([it] * len(payloads), payloads)
    assert rewards == [0.0] * len(payloads)
    assert not marker.exists()


def test_reasoning_gym_chain_sum_scoring():
    import reasoning_gym

    ds = reasoning_gym.create_dataset("chain_sum", seed=3, size=3)
    entries = [ds[i] for i in range(3)]
    items = [item(e["answer"], task="chain_sum", task_params={}, entry=e) for e in entries]
    completions = [f"<answer>{entries[0]['answer']}</answer>",
                   f"<answer>{int(entries[1]['answer']) + 1}</answer>",
                   f"The sum is {entries[2]['answer']}"]  # right number, but no tags
    cfg = RewardConfig(kind="auto", answer_format="answer_tag", timeout_s=TIMEOUT, format_reward=0.5)
    with RewardFn(cfg, "reasoning_gym") as rf:
        rewards, stats = rf.score(items, completions)
    assert rewards == pytest.approx([1.5, 0.5, 0.0])
    assert stats["num_format_ok"] == 2 and stats["num_no_answer"] == 1 and stats["num_correct"] == 1


_PROBE = '''
import sys

def score(payload):  # 1.0 when the worker has math-verify loaded
    return {"score": float("math_verify" in sys.modules), "format_ok": False, "answer": None}
'''


@pytest.mark.parametrize("kind,loaded", [("reasoning_gym", 0.0), ("math", 1.0)])
def test_verifier_workers_preload_only_their_reward_kinds_libraries(tmp_path, kind, loaded):
    """A pool's forkserver preloads its reward kind's libraries only (reward_fn.PRELOAD): reasoning-gym rewards never
    call math-verify, whose import and warm-up cost ~2.5 s of a core per run. Each kind in a fresh process (the
    forkserver is one per process); the probe scorer reports what its worker has loaded."""
    import subprocess

    (tmp_path / "probe_scorer.py").write_text(_PROBE)
    code = (f"from megatron_rl.config.schema import RewardConfig\n"
            f"from megatron_rl.rewards.reward_fn import RewardFn\n"
            f"from tests.unit.test_rewards import item\n"
            f"import probe_scorer\n"
            f"with RewardFn(RewardConfig(timeout_s=30.0), {kind!r}, scorer=probe_scorer.score) as rf:\n"
            f"    print(rf.score([item('1', task='chain_sum', task_params={{}}, entry={{}})], ['x'])[0])\n")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), root]))
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == str([loaded]), r.stdout
