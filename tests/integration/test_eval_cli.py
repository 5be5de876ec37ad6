"""`megatron-rl eval` runs the same generator and verifier as training and writes pass@1 / pass@k as JSON."""
import json
import sys
from pathlib import Path

from tests import cli_runner  # `python -m megatron_rl` forked from a preloaded server

REPO = Path(__file__).resolve().parents[2]


def test_eval_cli_writes_json_with_the_runs_own_config(tiny_model_factory, tmp_path):
    """pass@k as JSON (file and stdout), and every sample with --samples-out. The model sits in a run folder
    (runs/x/hf, convert's example) and no --config is given: the run's config.yaml is used, so the prompts carry its
    system prompt and few-shot examples, not the schema's bare defaults. One engine start for both checks."""
    import shutil

    from megatron_rl import load_config
    from megatron_rl.config.loader import dump_yaml

    run = tmp_path / "run"
    shutil.copytree(tiny_model_factory("eval_tiny", seed=2), run / "hf")
    dump_yaml(load_config(REPO / "configs" / "demo_cpu.yaml", ["generation.max_new_tokens=8"]), run / "config.yaml")
    out, samples = tmp_path / "eval.json", tmp_path / "samples.jsonl"
    r = cli_runner.run([sys.executable, "-m", "megatron_rl", "eval", "--model", str(run / "hf"), "--data",
                        "chain_sum", "--n", "3", "--num-prompts", "4", "--out", str(out), "--samples-out",
                        str(samples), "generation.kv_cache_memory_mb=64", "reward.num_workers=1"],
                       capture_output=True, text=True, timeout=600, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["val_k"] == 3 and res["val_num_prompts"] == 4
    assert 0.0 <= res["val_accuracy"] <= res["val_pass_at_k"] <= 1.0  # pass@1 can never exceed pass@k
    assert json.dumps(res, indent=2) in r.stdout  # the same JSON is printed
    assert f"the training run's config {run / 'config.yaml'}" in r.stderr
    rows = [json.loads(x) for x in samples.read_text().splitlines()]
    assert len(rows) == 4 * 3
    for row in rows:
        system = row["prompt"][0]
        assert system["role"] == "system" and system["content"].startswith("Solve the arithmetic problem")
        assert "<answer>17</answer>" in json.dumps(row["prompt"])  # the demo's few-shot example


def test_eval_cli_bad_config_names_key(tmp_path):
    r = cli_runner.run([sys.executable, "-m", "megatron_rl", "eval", "--model", str(tmp_path), "--n", "2",
                        "grpo.nope=1"], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2 and "grpo.nope" in r.stderr
