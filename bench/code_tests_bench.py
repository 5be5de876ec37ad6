"""Seconds per hidden test in code_tests: the assert harness (one sandbox run for all the asserts) vs one sandbox run
per assert, and stdin/stdout cases (one run each, as graded).

    python bench/code_tests_bench.py [--runs N] [--tests 1,10,50] [--smoke]

For each number of tests, a correct `add(a, b)` is graded --runs times each way, every test checked to pass; the
table gives the median wall time of grading all of them and per test. The per-run alternative is what the harness
replaces: `run_python(code + "\\n" + assert)` once per test. --smoke: one grading of 1 and 3 tests each way (CI runs
it: tests/unit/test_bench_sandbox.py).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CODE = "def add(a, b):\n    return a + b\n"
PROGRAM = "a, b = map(int, input().split())\nprint(a + b)\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10, help="gradings per cell (the median is shown)")
    ap.add_argument("--tests", default="1,10,50", help="comma-separated numbers of tests")
    ap.add_argument("--smoke", action="store_true", help="a quick run of every code path")
    args = ap.parse_args()
    if args.smoke:
        args.runs, args.tests = 1, "1,3"
    from megatron_rl.environments.code_grader import grade_asserts, grade_stdio
    from megatron_rl.environments.sandbox import run_python

    run_python("pass")  # the sandbox's one-time probes, outside the timings
    print(f"{'tests':>5} | {'harness ms (per test)':>22} | {'run per assert ms (per test)':>29} | "
          f"{'stdin cases ms (per case)':>26}")
    for n in (int(x) for x in args.tests.split(",")):
        asserts = [f"assert add({i}, 1) == {i + 1}" for i in range(n)]
        cases = [(f"{i} 1\n", f"{i + 1}\n") for i in range(n)]
        cols: list[list[float]] = [[], [], []]
        for _ in range(args.runs):
            t = time.monotonic()
            g = grade_asserts(CODE, asserts, timeout_s=5.0, memory_mb=512, deadline=time.monotonic() + 120)
            cols[0].append(time.monotonic() - t)
            assert g.passed == n, g
            t = time.monotonic()
            for a in asserts:
                r = run_python(CODE + "\n" + a, timeout_s=5.0)
                assert r.reason == "ok", r
            cols[1].append(time.monotonic() - t)
            t = time.monotonic()
            g = grade_stdio(PROGRAM, cases, timeout_s=5.0, memory_mb=512, deadline=time.monotonic() + 120)
            cols[2].append(time.monotonic() - t)
            assert g.passed == n, g
        cells = [f"{statistics.median(c) * 1000:.1f} ({statistics.median(c) / n * 1000:.1f})" for c in cols]
        print(f"{n:>5} | {cells[0]:>22} | {cells[1]:>29} | {cells[2]:>26}")
    if args.smoke:
        print("smoke ok")


if __name__ == "__main__":
    main()
