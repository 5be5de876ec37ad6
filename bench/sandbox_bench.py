"""Sandbox throughput: executions per second of a trivial program through `run_python`, next to plain subprocesses.

    python bench/sandbox_bench.py [--runs N] [--threads 1,2,4] [--smoke]

Runs `print(sum(range(100)))` --runs times per row: sequentially in the main thread, then spread over N concurrent
threads for each N of --threads. Side by side in the same run, on the same machine: a plain
`subprocess.run([sys.executable, "-c", ...])` (the venv's interpreter with its site-packages, the usual way to run a
snippet), and the same interpreter with the sandbox's own flags (`-E -s -S -B`) but no sandbox, which separates what
the containment costs from what the interpreter's start costs. Every run's output is checked. --smoke does a handful
of runs and fails unless all of them worked (CI runs it: tests/unit/test_bench_sandbox.py).
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CODE = "print(sum(range(100)))"
EXPECTED = "4950\n"


def _sandbox() -> str:
    from megatron_rl.environments.sandbox import run_python

    r = run_python(CODE)
    assert (r.reason, r.stdout) == ("ok", EXPECTED), r
    return r.stdout


def _plain(argv: list[str]):
    def run() -> str:
        out = subprocess.run(argv, capture_output=True, text=True, check=True).stdout
        assert out == EXPECTED, out
        return out
    return run


def _rate(fn, runs: int, threads: int) -> float:
    """Executions per second of `runs` calls of fn: in this thread (threads=0) or split over that many threads."""
    if threads == 0:
        t = time.perf_counter()
        for _ in range(runs):
            fn()
        return runs / (time.perf_counter() - t)
    shares = [runs // threads + (i < runs % threads) for i in range(threads)]
    errors: list[BaseException] = []

    def worker(n: int) -> None:
        try:
            for _ in range(n):
                fn()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    pool = [threading.Thread(target=worker, args=(n,)) for n in shares]
    t = time.perf_counter()
    for th in pool:
        th.start()
    for th in pool:
        th.join()
    elapsed = time.perf_counter() - t
    if errors:
        raise errors[0]
    return runs / elapsed


def main() -> None:
    from megatron_rl.environments.sandbox import INTERPRETER, PY_FLAGS, capabilities

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--runs", type=int, default=200, help="executions per row and side")
    p.add_argument("--threads", default="1,2,4", help="comma-separated thread counts")
    p.add_argument("--smoke", action="store_true", help="a handful of runs: check it works, no real numbers")
    args = p.parse_args()
    runs, threads = (6, [1, 2]) if args.smoke else (args.runs, [int(x) for x in args.threads.split(",")])

    caps = capabilities()  # the one-off probes, outside the timing
    enforced = [k for k in ("pids_cgroup", "memory_cgroup", "network_isolated", "private_mounts", "unprivileged")
                if caps[k]]
    print(f"sandbox enforces: {', '.join(enforced) or 'nothing beyond rlimits'}; {runs} runs per cell")
    sides = {"sandbox": _sandbox, "plain": _plain([sys.executable, "-c", CODE]),
             "same flags": _plain([INTERPRETER, *PY_FLAGS, "-c", CODE])}
    for fn in sides.values():  # warm the page cache and the probes
        fn()
    print("executions per second; the ratios are the sandbox's rate over the plain ones")
    print(f"{'':<12}{'sandbox':>10}{'plain':>10}{'same flags':>12}{'vs plain':>10}{'vs same flags':>15}")
    for n in [0, *threads]:
        rates = {s: _rate(fn, runs, n) for s, fn in sides.items()}
        sb = rates["sandbox"]
        print(f"{'sequential' if n == 0 else f'{n} threads':<12}{sb:10.1f}{rates['plain']:10.1f}"
              f"{rates['same flags']:12.1f}{sb / rates['plain']:9.2f}x{sb / rates['same flags']:14.2f}x")
    if args.smoke:
        print("smoke ok")


if __name__ == "__main__":
    main()
