"""bench/sandbox_bench.py and bench/code_tests_bench.py --smoke: the benches' code paths, a handful of sandboxed and
plain runs, in a fresh process (so that they keep working between the runs that record their numbers in
docs/benchmarks.md)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.bench  # a bench's --smoke: not in the quick tier (launch/run_tests.sh)

ROOT = Path(__file__).resolve().parents[2]


def test_sandbox_bench_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "sandbox_bench.py"), "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "smoke ok"
    assert [line.split()[0] for line in lines[3:-1]] == ["sequential", "1", "2"], proc.stdout


def test_code_tests_bench_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "code_tests_bench.py"), "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert lines[-1] == "smoke ok" and [line.split()[0] for line in lines[1:-1]] == ["1", "3"], proc.stdout
