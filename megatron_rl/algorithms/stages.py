"""Stage chains: several configs run in order, each starting from the previous stage's final weights (GRPO stages,
or SFT / DPO ones with `algorithm: sft | dpo`, e.g. SFT then GRPO).

A chain file has one key, `stages`, a list of {config: FILE, overrides: [..]} (paths relative to the chain file).
Command-line overrides apply to every stage. A stage whose newest checkpoint already reached its `grpo.max_steps`
is skipped, so re-running the chain command resumes the first unfinished stage.
"""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from megatron_rl.config import Config, ConfigError, load_config, read_yaml_tree
from megatron_rl.config.loader import from_dict
from megatron_rl.config.schema import StageConfig


def is_chain(path: str | Path) -> bool:
    return "stages" in read_yaml_tree(path)


def load_stages(path: str | Path) -> list[StageConfig]:
    tree = read_yaml_tree(path)
    extra = set(tree) - {"stages"}
    if extra:
        raise ConfigError(f"{path}: a stage chain holds only 'stages', found {sorted(extra)}")
    raw = tree["stages"]
    if not isinstance(raw, list) or not raw:
        raise ConfigError(f"{path}: 'stages' must be a non-empty list")
    out = []
    for i, st in enumerate(raw):
        if not isinstance(st, dict):
            raise ConfigError(f"{path}: stages[{i}] must be a mapping with 'config'")
        unknown = set(st) - {"config", "overrides"}
        if unknown:
            raise ConfigError(f"{path}: unknown key 'stages[{i}].{sorted(unknown)[0]}'")
        s = StageConfig(config=str(Path(path).parent / st.get("config", "")), overrides=list(st.get("overrides", [])))
        if not Path(s.config).is_file():
            raise ConfigError(f"{path}: stages[{i}].config: no such file {s.config}")
        out.append(s)
    return out


def run_chain(path: str | Path, overrides: list[str], *, run: Callable[[Config], int], dry_run: bool = False) -> int:
    """Run the chain's unfinished stages in order with `run` (one training run of a stage's config: `build.run`);
    the first non-zero status stops the chain and is returned. dry_run: print each stage's output and init_from."""
    from megatron_rl.models.checkpoint import latest_checkpoint, read_metadata

    previous: Path | None = None
    for i, st in enumerate(load_stages(path)):
        extra = [f"init_from={previous}"] if previous is not None else []
        cfg = load_config(st.config, st.overrides + list(overrides) + extra)
        root = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else Path(cfg.output.dir) / "checkpoints"
        latest = latest_checkpoint(root)
        # SFT / DPO stages: their step count may come from the data (epochs), which `run` reads; it then says
        # "already complete" itself, before starting anything
        last = cfg.grpo.max_steps if cfg.samples_rollouts() else getattr(cfg, cfg.algorithm).max_steps
        if dry_run:
            print(f"stage {i}: {st.config} -> {cfg.output.dir} (init_from={cfg.init_from})")
        elif cfg.samples_rollouts() and latest is not None and read_metadata(latest).get("step", 0) >= last:
            print(f"[megatron-rl] stage {i} ({st.config}) already finished at {latest}")
        else:
            print(f"[megatron-rl] stage {i}: {st.config}", flush=True)
            rc = run(cfg)
            if rc:
                return rc
            latest = latest_checkpoint(root)
        previous = latest if latest is not None else root / f"step_{last or 'N'}"
    return 0


__all__ = ["is_chain", "load_stages", "run_chain", "from_dict"]
