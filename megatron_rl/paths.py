"""Where megatron-rl keeps things that are not source: the model cache and default run outputs.

One place for these defaults. The cache lives in the checkout (git-ignored `.cache/`) when running from a clone, so a
fresh clone's set-up and its tests agree on it; `MEGATRON_RL_CACHE` overrides it.
"""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def cache_dir() -> Path:
    env = os.environ.get("MEGATRON_RL_CACHE")
    if env:
        return Path(env)
    if (REPO_ROOT / "setup.py").exists():
        return REPO_ROOT / ".cache"
    return Path.home() / ".cache" / "megatron_rl"


def default_model_dir() -> Path:
    """The embedded default model (SmolLM2-135M-Instruct) as a plain HF folder, made by `launch/setup_env.sh`."""
    return cache_dir() / "models" / "SmolLM2-135M-Instruct"
