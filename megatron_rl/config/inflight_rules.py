"""What in-flight weight updates and partial rollouts (grpo.inflight_weight_updates, grpo.partial_rollouts;
algorithms/inflight_rollouts.py) need from the rest of a config. Each refusal names the key that decides it."""
from __future__ import annotations


def validate_inflight(cfg) -> None:
    from megatron_rl.config.loader import ConfigError

    g = cfg.grpo
    if g.partial_rollouts and not g.inflight_weight_updates:
        raise ConfigError("grpo.partial_rollouts needs grpo.inflight_weight_updates=true (unfinished groups keep "
                          "generating across the refit)")
    if not g.inflight_weight_updates:
        return
    if g.max_staleness < 1:
        raise ConfigError("grpo.inflight_weight_updates needs grpo.max_staleness >= 1 (and cluster.colocated=false): "
                          "the engines generate while the trainer trains, so what they generate is at least one "
                          "step old")
    if cfg.environment.cls is not None:
        raise ConfigError(f"grpo.inflight_weight_updates with environment.cls={cfg.environment.cls!r}: multi-turn "
                          "rollouts are not generated in flight yet; set grpo.inflight_weight_updates=false (async "
                          "multi-turn GRPO works with grpo.max_staleness alone)")
    if cfg.generation.lora_refit == "adapter":
        raise ConfigError("grpo.inflight_weight_updates with generation.lora_refit=adapter: a running request keeps "
                          "the adapter it started with; use generation.lora_refit=merged")
    if g.advantage.refill and not g.partial_rollouts:
        raise ConfigError("grpo.advantage.refill with grpo.inflight_weight_updates and without "
                          "grpo.partial_rollouts: a step's prompts are fixed when they are admitted; set "
                          "grpo.partial_rollouts=true (a dropped group is replaced by the next prompt) or "
                          "grpo.advantage.refill=false")
