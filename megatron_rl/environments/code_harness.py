"""The assert-test harness: the program that code_grader.py runs INSIDE the sandbox, standard library only.

Never imported by the package: code_grader passes this file's source to `sandbox.run_python`, which runs it as
`python -c` (so `__name__ == "__main__"` there). One run loads the model's code once and runs every hidden assert from
`start` on, each separately, under its own timeout, reporting pass or fail per test as it goes: one process for all
the tests instead of one per test (measured in docs/environments.md).

Protocol. stdin: one dict literal {"nonce", "code", "tests", "start", "timeout_s"}, read whole before any model code
runs, so neither the tests nor the nonce are on disk or in the command line for the model's code to read. Reports go
to a copy of the original stdout as lines "<nonce> <dict literal>"; fds 0, 1 and 2 are /dev/null while model code
runs (its prints cannot flood the pipe, interleave with reports, or forge them without the nonce). Python literals
(ast.literal_eval, repr) rather than JSON: ast is needed anyway, and importing json (with re) would add about 10 ms to
every run's start:
    {"loaded": true} | {"loaded": false, "reason": ..., "error": ...}   after exec of the model's code
    {"start": i}                                                        before test i
    {"test": i, "passed": ..., "reason": ..., ["expected", "got", "error"]}
reason: ok, wrong (an assert failed), error (raised), timeout, memory (MemoryError). If the process dies during a test
(a segfault, os._exit, the CPU timer below, the sandbox's kill) the last {"start": i} without a result names the test
it died in; the grader fails that test and starts a new run at i + 1.

Per-test timeouts: ITIMER_REAL raises in Python code at timeout_s (the test fails, the run goes on); ITIMER_PROF with
its default action (terminate) ends a run stuck in C code, which no Python-level signal handler can interrupt
(`10 ** 10 ** 9`), after timeout_s + 0.5 s of CPU. A process the model's code forks returns into this harness as a
copy of it: every report checks the pid and such a copy exits instead of reporting. After each test, the processes
it left running (a fork bomb's) are killed through the sandbox's per-call pids cgroup where there is one; without it
they live until the run ends (the sandbox kills them then) and slow the tests after them.

Not a defence against code written to attack this harness (it could walk the frames to find the nonce, or patch the
builtins the tests use); it is a grader that the common shortcuts do not fool: exit(0), os._exit(0), printing "PASS",
and returning an object whose Python-defined __eq__ says True to any expected builtin value.
"""
import ast
import builtins
import linecache
import os
import reprlib
import signal
import sys
import traceback
import types

MAX_TEXT = 300  # characters of each expected / got / error string in a report
CPU_GRACE_S = 0.5
PLAIN = (int, float, complex, str, bytes, bool, type(None), list, tuple, dict, set, frozenset)


class _TestTimeout(BaseException):
    """A BaseException: the model's own `except Exception` must not swallow the end of its time."""


def _clip(text):
    return text if len(text) <= MAX_TEXT else text[:MAX_TEXT - 3] + "..."


def _error_text(e):
    """The exception's type and message, and the last frame of the model's code it passed through (its line)."""
    lines = traceback.format_exception(type(e), e, e.__traceback__)
    tail = [ln for ln in lines if 'File "solution.py"' in ln][-1:] + traceback.format_exception_only(type(e), e)
    return "".join(tail).strip()


def _fake_equal(value, budget=10_000):
    """True when `value`, or anything in a container inside it, has a type whose __eq__ is Python code from outside
    the standard library: such a value could claim equality with anything."""
    stack, stdlib = [value], sys.stdlib_module_names
    while stack and budget > 0:
        budget -= 1
        v = stack.pop()
        t = type(v)
        if isinstance(getattr(t, "__eq__", None), types.FunctionType) and \
                str(getattr(t, "__module__", "")).split(".")[0] not in stdlib:
            return True
        if isinstance(v, (list, tuple, set, frozenset)):
            stack.extend(v)
        elif isinstance(v, dict):
            stack.extend(v.keys())
            stack.extend(v.values())
    return False


def _sandbox_procs():
    """The cgroup.procs file of the sandbox's own per-call pids cgroup (v1 or v2), or None. Only a cgroup named like
    the sandbox's (megatron_rl_sandbox/slot-N) qualifies: without one this process shares a cgroup with its parents,
    whose processes must never be killed."""
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        base = "/sys/fs/cgroup/pids" if "pids" in controllers.split(",") else "/sys/fs/cgroup" if not controllers \
            else None
        if base and "/megatron_rl_sandbox/slot-" in path and os.path.exists(base + path + "/cgroup.procs"):
            return base + path + "/cgroup.procs"
    return None


def _kill_leftovers(procs_file, me):
    """SIGKILL every other process of the run (what a test forked and left running), so it cannot slow the tests
    after it; a few rounds, as a fork bomb's processes fork while they are being killed."""
    for _ in range(50):
        try:
            with open(procs_file) as f:
                pids = [int(p) for p in f.read().split() if int(p) != me]
        except (OSError, ValueError):
            return
        if not pids:
            break
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
    try:  # reap this process's own children (all killed: the wait is short), so no zombie takes a pid of the cap
        while True:
            os.waitpid(-1, 0)
    except ChildProcessError:
        pass


def _compile_test(src):
    """(kind, code objects): ("eq", left, right) for a single `assert LEFT == RIGHT`, so a failure can say what was
    got; ("exec", code) for anything else (any statements: the test passes if they raise nothing)."""
    tree = ast.parse(src, "<test>", "exec")
    body = tree.body
    if len(body) == 1 and isinstance(body[0], ast.Assert) and isinstance(body[0].test, ast.Compare) \
            and len(body[0].test.ops) == 1 and isinstance(body[0].test.ops[0], ast.Eq):
        cmp = body[0].test
        return ("eq", compile(ast.Expression(cmp.left), "<test>", "eval"),
                compile(ast.Expression(cmp.comparators[0]), "<test>", "eval"))
    return ("exec", compile(tree, "<test>", "exec"))


def main():
    cfg = ast.literal_eval(sys.stdin.read())
    nonce, code, tests, start, timeout_s = cfg["nonce"], cfg["code"], cfg["tests"], cfg["start"], cfg["timeout_s"]
    del cfg
    me, write, getpid, _exit = os.getpid(), os.write, os.getpid, os._exit  # bound now: the model's code may patch os
    setitimer, sig, dumps = signal.setitimer, signal.signal, repr
    out = os.dup(1)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(null, fd)
    procs_file = _sandbox_procs()  # found before the model's code runs (it could not fake it anyway: root's files)
    short = reprlib.Repr()
    short.maxstring = short.maxother = MAX_TEXT
    armed = [False]

    def report(obj):
        if getpid() != me:  # a forked copy of this process, back in harness code: it must not report
            _exit(0)
        write(out, (nonce + " " + dumps(obj) + "\n").encode())

    def on_alarm(signum, frame):
        if armed[0]:  # an alarm that lands just after a test ended is ignored
            raise _TestTimeout()

    def arm():
        sig(signal.SIGALRM, on_alarm)  # again each time: the model's code may have replaced them
        sig(signal.SIGPROF, signal.SIG_DFL)
        armed[0] = True
        setitimer(signal.ITIMER_PROF, timeout_s + CPU_GRACE_S)
        setitimer(signal.ITIMER_REAL, timeout_s)

    def disarm():
        armed[0] = False
        setitimer(signal.ITIMER_REAL, 0)
        setitimer(signal.ITIMER_PROF, 0)

    def failure(e):
        if isinstance(e, _TestTimeout):
            return {"reason": "timeout"}
        if isinstance(e, MemoryError):
            return {"reason": "memory"}
        return {"reason": "wrong" if isinstance(e, AssertionError) else "error", "error": _clip(_error_text(e))}

    # the model's code gets a namespace of its own named "solution": an `if __name__ == "__main__":` demo with
    # input() calls is skipped, as when a test file imports it
    ns = {"__name__": "solution", "__builtins__": builtins}
    linecache.cache["solution.py"] = (len(code), None, code.splitlines(True), "solution.py")  # lines in tracebacks
    try:
        arm()
        exec(compile(code, "solution.py", "exec"), ns)
        disarm()
    except BaseException as e:  # noqa: BLE001 - SystemExit too: exit() before the tests is a failure to load
        disarm()
        try:
            arm()
            why = failure(e)
            disarm()
        except BaseException:  # noqa: BLE001 - as for a test's exception below
            disarm()
            why = {"reason": "error", "error": "(the exception could not be printed)"}
        report({"loaded": False, **why})
        return
    report({"loaded": True})
    for i in range(start, len(tests)):
        report({"start": i})
        result = {"test": i, "passed": False}
        try:
            arm()
            compiled = _compile_test(tests[i])
            if compiled[0] == "eq":
                got, expected = eval(compiled[1], ns), eval(compiled[2], ns)
                if isinstance(expected, PLAIN) and _fake_equal(got):
                    ok, why = False, "its type defines __eq__"
                else:
                    ok, why = bool(got == expected), None
                if ok:
                    result.update(passed=True, reason="ok")
                else:
                    result.update(reason="wrong", expected=_clip(short.repr(expected)), got=_clip(short.repr(got)))
                    if why:
                        result["error"] = why
            else:
                exec(compiled[1], ns)
                result.update(passed=True, reason="ok")
            disarm()
        except BaseException as e:  # noqa: BLE001 - whatever the test raised fails that test only
            disarm()
            try:
                arm()  # the exception's own __str__ is model code too: it gets a timeout of its own
                result.update(failure(e))
                disarm()
            except BaseException:  # noqa: BLE001 - a hostile __str__, or one that hangs
                disarm()
                result.update(reason="error", error="(the exception could not be printed)")
        report(result)
        if procs_file:
            _kill_leftovers(procs_file, me)


if __name__ == "__main__":
    main()
