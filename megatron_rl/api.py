"""The Python API: what `megatron-rl train` and `megatron-rl eval` do, as functions for scripts and notebooks.

    import megatron_rl

    cfg = megatron_rl.load_config("configs/demo_cpu.yaml", ["grpo.max_steps=5"])
    history = megatron_rl.train(cfg)                       # the records of metrics.jsonl, one dict per line
    history = megatron_rl.api.sft("configs/sft_cpu.yaml", ["data.path=my.jsonl"])   # or .dpo(...), .rm(...)
    result = megatron_rl.evaluate("trained_hf", config=cfg, n=4)

They run the CLI's own code paths (the config loader, `build.run` or a stage chain, `build.evaluate_model`)
and raise instead of printing: `ConfigError` for a bad config or a tracker whose package is missing,
`TrainingError` when a run stops with a non-zero status. In a script, call them under `if __name__ == "__main__":`:
spawned helper processes (conversion ranks) import the main script again, as every multiprocessing program's do
(the reward verifiers never do). Notebooks, the REPL and `python -` need nothing: a main that is no file is not
re-run (`megatron_rl.mp_main`).
"""
from __future__ import annotations

from pathlib import Path
from typing import Union

from megatron_rl.config import Config, ConfigError

__all__ = ["train", "sft", "dpo", "rm", "load_config", "evaluate", "ConfigError", "TrainingError"]
ConfigLike = Union[str, Path, dict, Config]


class TrainingError(RuntimeError):
    """A training run stopped with a non-zero status (its message was printed to stderr)."""


def load_config(config: ConfigLike, overrides: list[str] | None = None) -> Config:
    """A validated `Config` from a YAML path (with `defaults:` inheritance), a dict of sections, or a `Config`.

    overrides are the command line's `key.path=value` strings. A `Config` is checked again (fields set on it by hand
    included); overrides apply on top of its resolved values, as they do on a run's saved config.yaml."""
    from megatron_rl.config import load_config as load_yaml
    from megatron_rl.config.loader import apply_overrides, from_dict, to_dict, validate

    overrides = list(overrides or [])
    if isinstance(config, (str, Path)):
        return load_yaml(config, overrides)
    if isinstance(config, Config):
        config = to_dict(config)
    if not isinstance(config, dict):
        raise TypeError(f"config must be a YAML path, a dict or a Config, got {type(config).__name__}")
    return validate(from_dict(apply_overrides(config, overrides), source="<dict>"))


def train(config: ConfigLike, overrides: list[str] | None = None) -> list[dict]:
    """Run GRPO (re-running with the same output.dir resumes) and return the run's metrics history: the records of
    `<output.dir>/metrics.jsonl` in order (step 0 is the baseline validation when there is validation data).

    A stage-chain YAML (`stages:`) runs its stages in order, as `megatron-rl train` does; the history is then every
    stage's records in order, each with a `stage` index added."""
    from megatron_rl.build import run
    from megatron_rl.config.preflight import require_trackers
    from megatron_rl.paths import read_metrics

    _refuse_in_worker_import("train")
    overrides = list(overrides or [])
    if isinstance(config, (str, Path)):
        from megatron_rl.algorithms.stages import is_chain, load_stages, run_chain

        if is_chain(config):
            stages = [load_config(st.config, st.overrides + overrides) for st in load_stages(config)]
            for cfg in stages:  # every stage's trackers, before the first stage starts
                require_trackers(cfg.logging)
            _check(run_chain(config, overrides, run=run), config)
            return [{**rec, "stage": i} for i, cfg in enumerate(stages) for rec in read_metrics(cfg.output.dir)]
    cfg = load_config(config, overrides)
    require_trackers(cfg.logging)
    path = str(config) if isinstance(config, (str, Path)) else None
    _check(run(cfg, config_path=path, overrides=overrides), path or cfg.output.dir)
    return read_metrics(cfg.output.dir)


def sft(config: ConfigLike, overrides: list[str] | None = None) -> list[dict]:
    """Supervised fine-tuning (`megatron-rl sft`): `config` with algorithm=sft, run as `train` runs GRPO; returns
    the metrics history."""
    return train(config, ["algorithm=sft", *(overrides or [])])


def dpo(config: ConfigLike, overrides: list[str] | None = None) -> list[dict]:
    """DPO / IPO / hinge preference training (`megatron-rl dpo`); returns the metrics history."""
    return train(config, ["algorithm=dpo", *(overrides or [])])


def rm(config: ConfigLike, overrides: list[str] | None = None) -> list[dict]:
    """Reward-model (Bradley-Terry) training on preference pairs (`megatron-rl rm`); returns the metrics history."""
    return train(config, ["algorithm=rm", *(overrides or [])])


def evaluate(model: str | Path, config: ConfigLike | None = None, *, data: str | None = None,
             jsonl: str | Path | None = None, n: int = 4, num_prompts: int = 64, temperature: float | None = None,
             overrides: list[str] | None = None) -> dict:
    """pass@1 / pass@k of an HF model folder (e.g. `megatron-rl convert megatron-to-hf` output), as `megatron-rl
    eval` computes it: `val_accuracy` (pass@1, the mean over all n samples), `val_pass_at_k`, `val_k`, `val_samples`.

    config supplies the data, reward and generation sections (default: the schema's); data names a reasoning-gym
    task and jsonl a problem/answer file, as the CLI's --data / --jsonl."""
    from megatron_rl.algorithms.evaluate import eval_overrides
    from megatron_rl.build import evaluate_model

    _refuse_in_worker_import("evaluate")
    extra = eval_overrides(str(model), data=data, jsonl=str(jsonl) if jsonl else None)
    cfg = load_config(config if config is not None else {}, list(overrides or []) + extra)
    return evaluate_model(cfg, str(model), n=n, num_prompts=num_prompts, temperature=temperature)


def _refuse_in_worker_import(name: str) -> None:
    """A script without the main guard runs again in every worker process multiprocessing starts (while the worker
    imports it, `_inheriting` is set: CPython's own check before starting processes reads the same flag). Say so
    there, instead of starting a second run inside a verifier worker."""
    import multiprocessing

    if getattr(multiprocessing.current_process(), "_inheriting", False):
        raise RuntimeError(f"megatron_rl.{name}() called while a worker process imports the main script: put the "
                           "calls under `if __name__ == \"__main__\":`")


def _check(rc: int, what) -> None:
    if rc:
        raise TrainingError(f"training {what} stopped with status {rc} (the reason is printed above)")
