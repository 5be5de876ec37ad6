"""Where a re-run continues, decided before Ray or any worker starts.

- Partial checkpoints of an interrupted save (`step_N.tmp-XXXX`) are removed.
- The newest checkpoint whose files all match its metadata.json is the one resumed; a newer damaged one (a truncated
  or corrupt shard) gets a warning naming it and the file at fault. Checkpoints but none intact: a one-line refusal.
- A config whose keys that change the run (the data, the model, the algorithm, the reward: `RUN_KEYS`) differ from
  the run's saved `<output.dir>/config.yaml` is refused, naming the keys, unless `checkpoint.allow_config_change`.
- The GRPO loop says "already complete at step N" and exits when that checkpoint reached `grpo.max_steps` (SFT/DPO:
  their own max_steps). SFT and DPO runs compare their own section instead of the GRPO ones (`SUPERVISED_RUN_KEYS`).
"""
from __future__ import annotations

import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config import Config, ConfigError, to_dict

# Key paths (a section or one key) whose change makes a resumed run a different run than the one checkpointed: the
# prompts it trains on and their order, the model, the objective, the sampling the loss assumes, the reward.
RUN_KEYS = ("data", "policy.model", "policy.tokenizer", "grpo", "reward", "init_from", "generation.temperature",
            "generation.top_p", "generation.top_k", "generation.max_new_tokens", "generation.stop", "environment",
            "distillation", "ppo", "critic")
# Keys inside those that do not: how long to train (raised to continue a finished run, or a time budget), validation, the run's
# abort thresholds, and the verifier's process count and memory cap.
FREE_KEYS = ("grpo.max_steps", "grpo.max_minutes", "grpo.val_every", "grpo.val_num_prompts", "grpo.val_pass_k", "grpo.max_nonfinite_steps",
             "grpo.max_empty_steps", "grpo.mismatch_guard", "grpo.mismatch_max_token_mult_prob_error",
             "grpo.mismatch_max_gen_kl_error", "data.val_seed", "data.val_path", "reward.num_workers",
             "reward.worker_memory_mb", "environment.num_workers", "environment.timeout_s")


@dataclass(frozen=True)
class ResumePoint:
    checkpoint: Path | None  # None: start from the initial weights (or init_from)
    step: int  # the step that checkpoint finished (0 without one)


# SFT / DPO runs (`algorithm: sft | dpo`): their own section instead of grpo, generation, reward and environment
SUPERVISED_RUN_KEYS = ("data", "policy.model", "policy.tokenizer", "init_from")
SUPERVISED_FREE_KEYS = ("max_steps", "val_every", "val_max_examples", "max_nonfinite_steps")


def _under(path: str, keys: tuple[str, ...]) -> bool:
    return any(path == k or path.startswith(k + ".") for k in keys)


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    """Dotted key path -> leaf value; mappings are descended (so data.task_params.min_terms is named), lists are
    leaves."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    return out


def changed_run_keys(saved: dict, current: dict) -> list[tuple[str, Any, Any]]:
    """(key path, saved value, current value) of each key in RUN_KEYS (but FREE_KEYS) that differs; a key present
    on one side only counts as changed (value None on the other)."""
    algos = (saved.get("algorithm") or "grpo", current.get("algorithm") or "grpo")  # saved before the key: grpo
    if algos[0] != algos[1]:
        return [("algorithm", *algos)]
    if algos[0] not in ("grpo", "ppo"):
        return _changed(saved, current, SUPERVISED_RUN_KEYS + (algos[0],),
                        ("data.val_seed", "data.val_path") + tuple(f"{algos[0]}.{k}" for k in SUPERVISED_FREE_KEYS))
    a, b = _flatten(saved), _flatten(current)
    single_turn = a.get("environment.cls") is None and b.get("environment.cls") is None
    # a single-turn run (on both sides) uses no other environment key; configs saved before the section existed lack
    # it, and their runs must still resume
    keys = sorted(k for k in set(a) | set(b) if _under(k, RUN_KEYS) and not _under(k, FREE_KEYS)
                  and not (single_turn and _under(k, ("environment",))))
    return [(k, a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)]


def _changed(saved: dict, current: dict, run_keys: tuple[str, ...], free_keys: tuple[str, ...]):
    a, b = _flatten(saved), _flatten(current)
    keys = sorted(k for k in set(a) | set(b) if _under(k, run_keys) and not _under(k, free_keys))
    return [(k, a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)]


def _short(v: Any, width: int = 40) -> str:
    r = repr(v)
    return r if len(r) <= width else r[:width - 3] + "..."


def check_config_change(cfg: Config, saved_path: Path, checkpoint: Path) -> None:
    """Refuse (ConfigError) to resume `checkpoint` with run-changing keys that differ from the run's config.yaml,
    unless checkpoint.allow_config_change; then warn naming them. Nothing to compare without a saved config."""
    if not saved_path.is_file():
        return
    try:
        saved = yaml.safe_load(saved_path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{saved_path}: the run's saved config is not valid YAML ({e})") from None
    changed = changed_run_keys(saved, to_dict(cfg))
    if not changed:
        return
    listed = ", ".join(f"{k} ({_short(old)} -> {_short(new)})" for k, old, new in changed)
    if cfg.checkpoint.allow_config_change:
        print(f"[megatron-rl] warning: resuming {checkpoint} with keys changed from {saved_path}: {listed} "
              "(checkpoint.allow_config_change=true)", file=sys.stderr, flush=True)
        return
    raise ConfigError(f"resuming {checkpoint} would change the run: {listed} (vs {saved_path}); use another "
                      "output.dir for a new run, or set checkpoint.allow_config_change=true to resume anyway")


def remove_partial_checkpoints(root: Path) -> None:
    """A run killed while saving leaves `step_N.tmp-XXXX` (never picked for resuming); remove it, so crashes do not
    pile up dead checkpoint-sized directories. Only `.tmp-` dirs: an `.old-` dir may hold the only complete copy."""
    for partial in sorted(root.glob("*.tmp-*")) if root.is_dir() else []:
        if partial.is_dir():
            print(f"[megatron-rl] removing partial checkpoint {partial} (a save was interrupted)", flush=True)
            shutil.rmtree(partial, ignore_errors=True)


def resume_point(cfg: Config, out: Path, root: Path) -> ResumePoint:
    """The checkpoint a run of `cfg` continues from (see the module doc); raises CheckpointError when checkpoints
    exist but none is intact, ConfigError when the config changed. Reads only the disk: nothing is started."""
    from megatron_rl.models.checkpoint import newest_intact_checkpoint

    remove_partial_checkpoints(root)
    if not cfg.checkpoint.resume:
        return ResumePoint(None, 0)

    damaged: list[tuple[Path, str]] = []
    # none intact: CheckpointError naming each damaged one (the one line the user reads, no warnings before it)
    found = newest_intact_checkpoint(root, on_damaged=lambda path, why: damaged.append((path, why)))
    if found is None:
        return ResumePoint(None, 0)
    path, meta = found
    for bad, why in damaged:
        print(f"[megatron-rl] warning: checkpoint {bad} is damaged: {why}; resuming from {path} instead",
              file=sys.stderr, flush=True)
    check_config_change(cfg, out / "config.yaml", path)
    return ResumePoint(path, int(meta.get("step", 0)))
