"""Rollout generation: the backend-free `Generator` interface and its vLLM implementation.

`VLLMGenerator` imports vLLM only when constructed, so importing this package stays cheap.
"""
from __future__ import annotations

from pathlib import Path

from megatron_rl.config.schema import Config
from megatron_rl.generation.interface import GenerationResult, Generator, StaleWeightsError
from megatron_rl.generation.vllm_generator import VLLMGenerator

__all__ = ["GenerationResult", "Generator", "StaleWeightsError", "VLLMGenerator", "build_engine"]


def build_engine(cfg: Config, model_dir: Path | str, seed: int = 0) -> Generator:
    """An in-process rollout engine for `cfg.generation` (evaluation, benches); the Ray-hosted engines of a training
    run are built by `build()` (`generation/actor.py`). The one place that names the concrete engine class for
    callers above the workers."""
    return VLLMGenerator(cfg.generation, str(model_dir), max_model_len=cfg.max_model_len(), seed=seed)
