"""bench/multiturn_bench.py --smoke: both scheduling modes on a tiny model (the embedded tokenizer and chat
template) with real environment workers, in a fresh process; fails unless they ran and gave the same trajectories."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.paths import default_model_dir

pytestmark = pytest.mark.bench  # a bench's --smoke: not in the quick tier (launch/run_tests.sh)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not (default_model_dir() / "tokenizer.json").is_file(),
                    reason="the embedded model's tokenizer is missing: run launch/setup_env.sh")
def test_multiturn_bench_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "multiturn_bench.py"), "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    assert out.splitlines()[-1] == "smoke ok"
    assert "same trajectories in both modes: True" in out and "interleaved / barrier speed:" in out
