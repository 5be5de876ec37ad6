"""Where megatron-rl keeps things that are not source: the model cache, default run outputs, and a run's metrics.

One place for these defaults. The cache lives in the checkout (git-ignored `.cache/`) when running from a clone, so a
fresh clone's set-up and its tests agree on it; `MEGATRON_RL_CACHE` overrides it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
# where an adapter-serving engine writes each LoRA adapter version (generation/lora_serving.py) and what the pre-flight
# checks for free space (config/preflight.py: check_adapter_shm)
SHM_DIR = "/dev/shm"


def cache_dir() -> Path:
    env = os.environ.get("MEGATRON_RL_CACHE")
    if env:
        return Path(env)
    if (REPO_ROOT / "setup.py").exists():
        return REPO_ROOT / ".cache"
    return Path.home() / ".cache" / "megatron_rl"


# an HF export's copy of the training run's config.yaml (weights/convert.py writes it, `megatron-rl eval` reads it)
EXPORT_RUN_CONFIG = "megatron_rl.yaml"


def default_model_dir() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct) as a plain HF folder, made by `launch/setup_env.sh`."""
    return cache_dir() / "models" / "SmolLM2-135M-Instruct"


def read_metrics(out_dir: str | Path) -> list[dict]:
    """The records of a run's metrics.jsonl (`<output.dir>/metrics.jsonl`, written by `algorithms/tracking.py`), in
    order (empty when there is none). Read by the tracker when a run resumes, the model card and the Python API."""
    path = Path(out_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
