"""Every bench's --smoke, each in its own process: its real code path at tiny shapes, one step/rep, through the
bench's own report. A bench whose side fails to run exits non-zero, so an API change that breaks a bench fails here.

(multiturn_bench.py, sandbox_bench.py, tool_demo.py, sft_dpo_demo.py and code_tests_bench.py have their own test_bench_*.py; the
GPU check's --dry-run is tests/unit/test_gpu_check.py.) Each case: the bench's argv, lines its report must print
(substrings), and a timeout well above its wall time on 2 busy cores.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.paths import default_model_dir

pytestmark = pytest.mark.bench  # a bench's --smoke: not in the quick tier (launch/run_tests.sh)

ROOT = Path(__file__).resolve().parents[2]

CASES = {
    "plan_vs_nemo_rl": (["--smoke"], ["NeMo-RL TP1/PP2", "one-step-off speed-up", "smoke ok"], 120),
    "logprob_bench": (["--smoke"], ["forward+backward", "naive ", "fused ", "fused_ent ", "head_unfused ",
                                    "head_fused ", "fused / unfused:", "smoke ok"], 180),
    "fused_head_memory": (["--smoke"], ["228 unfused", "228 fused", "fused/unfused step growth", "smoke ok"], 240),
    "convert_bench": (["--smoke"], ["hf-to-megatron", "megatron-to-hf", "ratios vs reference (wall)",
                                    "round trip exact", "smoke ok"], 300),
    "policy_bench": (["--smoke"], ["batch: 4 x 32 tokens", "megatron-rl ", "hf+adamw ", "ratio "], 300),
    "shared_prefix_bench": (["--smoke"], ["padded ", "shared (mask) ", "varlen ", "varlen + cascade ",
                                          "lm_head everywhere", "shared (mask), megatron attention"], 300),
    # one dtype here: the bf16 column runs the very same three processes again (--smoke alone runs both: 90 s of
    # CPU on 2 cores, the `slow` case below)
    "phase_limits": (["--smoke", "--dtypes", "fp32"], ["fp32 matmul GFLOP/s", "decode tok/s",
                                                      "memory bandwidth GB/s", "roofline:"], 400),
    "refit_bench": (["--smoke"], ["refit median after the first", "collective refit median after the first",
                                  "vLLM generate (1 thread(s))", "transformers generate (1 thread(s))"], 400),
    # refit_bench.py --lora: the merged and the adapter-only refit of LoRA adapters, an engine each
    "refit_bench_lora": (["--smoke", "--lora", "8"], ["merged refit:", "adapter refit:", "refit adapter / merged:",
                                                      "decode (1 thread(s)): merged",
                                                      "greedy tokens after the last refit: identical"], 400),
    # TRL comes from launch/requirements-cpu.lock: a missing TRL fails here (exit 3) rather than skipping
    "grpo_vs_trl": (["--smoke"], ["TRL GRPOTrainer", "megatron-rl", "speed-up per step (TRL / megatron-rl)",
                                  "prompt token ids identical to ours: 4/4",
                                  "learning at equal training wall time", " points per minute)"], 900),
    "sft_dpo_vs_trl": (["--smoke"], ["TRL SFTTrainer", "TRL DPOTrainer", "sft: tokens/s ratio", "dpo: tokens/s ratio",
                                     "sft: TRL's tokens per step", "identical but for the newline"], 600),
}
# Opt-in (`-m slow`): several minutes of start-ups between them on 2 cores, and their paths are paid for elsewhere in
# the default suite (the soak's child and judge by tests/integration/test_faults.py; demo_ab's build.run by every
# end-to-end training test; phase_limits' bf16 column is its fp32 column's code again)
SLOW = {
    "soak": (["--smoke"], ["leaked /dev/shm: mrl-refit-* 0", "checkpoints kept: ['step_2']",
                           "processes left after shutdown: []"], 600),
    "demo_ab": (["--smoke"], ["median over steps 1..1", "bf16 vs fp32: step time"], 900),
    # the two training backends; the fsdp2 trainer's own path runs in the default suite (tests/integration's
    # lifecycle, resume and fault tests are parametrised by policy.backend)
    "demo_ab_backend": (["--smoke", "--compare", "backend"], ["median over steps 1..1", "fsdp2 vs megatron: speed",
                                                              "smoke ok"], 900),
    "phase_limits_both_dtypes": (["--smoke"], ["fp32 matmul GFLOP/s", "bf16 matmul GFLOP/s", "bf16/fp32"], 900),
}
PARAMS = [pytest.param(k, *v, id=k) for k, v in sorted(CASES.items())] + \
    [pytest.param(k, *v, id=k, marks=pytest.mark.slow) for k, v in sorted(SLOW.items())]


@pytest.mark.skipif(not (default_model_dir() / "tokenizer.json").is_file(),
                    reason="the embedded model's tokenizer is missing: run launch/setup_env.sh")
@pytest.mark.parametrize("bench,argv,expect,timeout", PARAMS)
def test_bench_smoke(bench, argv, expect, timeout):
    script = bench.removesuffix("_both_dtypes").removesuffix("_lora").removesuffix("_backend")
    # the benches import megatron_rl from this checkout, whatever the venv's editable install points at
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / f"{script}.py"), *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    out = proc.stdout
    assert proc.returncode == 0, f"exit {proc.returncode}\n" + out[-4000:] + proc.stderr[-4000:]
    missing = [e for e in expect if e not in out]
    assert not missing, f"report lacks {missing}:\n{out[-4000:]}"
    assert out.rstrip().splitlines()[-1] == "smoke ok", out[-2000:]
    print(f"{bench} --smoke: {time.perf_counter() - t0:.1f} s")
