"""The Python API where its main module is no file: `megatron_rl.train` piped through `python -`, as a user
pastes a snippet. Its reward verifiers (and any other spawn/forkserver child) must not try to re-run `<stdin>`."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import megatron_rl
overrides = {overrides!r}
history = megatron_rl.train("configs/demo_cpu.yaml", overrides)
print("TRAINED", [r["step"] for r in history if "reward_mean" in r])
"""


def test_train_through_python_stdin(tmp_path, tiny_model_factory):
    model = tiny_model_factory("stdin_api_tiny", seed=5, tied=True)
    out = tmp_path / "run"
    # the smallest real run: 1 step, one verifier worker, no validation, no checkpoint
    overrides = [f"policy.model={model}", f"output.dir={out}", "grpo.max_steps=1", "grpo.num_prompts_per_step=2",
                 "grpo.num_generations_per_prompt=2", "generation.max_new_tokens=8", "grpo.val_every=0",
                 "logging.progress=false", "reward.num_workers=1", "generation.kv_cache_memory_mb=64",
                 "policy.precision=fp32", "checkpoint.every_steps=0"]
    r = subprocess.run([sys.executable, "-"], input=SCRIPT.format(overrides=overrides), capture_output=True,
                       text=True, timeout=600, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, f"{r.stdout[-3000:]}\n{r.stderr[-5000:]}"
    assert "TRAINED [1]" in r.stdout, r.stdout[-3000:]
    assert "<stdin>" not in r.stderr, r.stderr[-5000:]  # no child tried to open the main "file"
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1] and "reward_mean" in lines[0]
