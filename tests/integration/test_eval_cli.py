"""`megatron-rl eval` runs the same generator and verifier as training and writes pass@1 / pass@k as JSON."""
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_eval_cli_writes_json(tiny_model_factory, tmp_path):
    model = tiny_model_factory("eval_tiny", seed=2)
    out = tmp_path / "eval.json"
    r = subprocess.run([sys.executable, "-m", "megatron_rl", "eval", "--model", str(model), "--config",
                        str(REPO / "configs" / "demo_cpu.yaml"), "--data", "chain_sum", "--n", "3",
                        "--num-prompts", "4", "--out", str(out), "generation.kv_cache_memory_mb=64",
                        "reward.num_workers=1", "generation.max_new_tokens=8"],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["val_k"] == 3 and res["val_num_prompts"] == 4
    assert 0.0 <= res["val_accuracy"] <= res["val_pass_at_k"] <= 1.0  # pass@1 can never exceed pass@k
    assert json.dumps(res, indent=2) in r.stdout  # the same JSON is printed


def test_eval_cli_bad_config_names_key(tmp_path):
    r = subprocess.run([sys.executable, "-m", "megatron_rl", "eval", "--model", str(tmp_path), "--n", "2",
                        "grpo.nope=1"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "grpo.nope" in r.stderr
