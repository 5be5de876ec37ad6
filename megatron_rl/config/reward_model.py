"""The `reward.model:` section's rules (a trained reward model as the reward; docs/algorithms.md): what the model is
and what the run around it must be. Defaults live in the schema (`schema.RewardModelConfig`); this module checks and
derives:

- `validate_reward_model`: the section's numbers and combinations, before any model is read (the loader's
  `validate`);
- `reward_model_policy_config`: the PolicyConfig its ranks build from (the policy's model-building code, a value
  head, no optimizer use), as the distillation teacher's (`distillation.teacher_policy_config`).
"""
from __future__ import annotations

import dataclasses

from megatron_rl.config.distillation import teacher_checkpoint, teacher_hf_dir
from megatron_rl.config.loader import ConfigError
from megatron_rl.config.schema import Config, PolicyConfig

# a reward model's path is a checkpoint directory or an HF folder, as a distillation teacher's
reward_model_checkpoint = teacher_checkpoint
reward_model_hf_dir = teacher_hf_dir


def validate_reward_model(cfg: Config) -> None:
    r, m = cfg.reward, cfg.reward.model
    if r.kind == "model" and (m is None or not m.path):
        raise ConfigError("reward.kind=model needs reward.model.path: an HF folder of a reward model (megatron-rl rm, "
                          "then convert megatron-to-hf) or a megatron-rl reward-model checkpoint")
    if m is None:
        return
    if not m.path:
        raise ConfigError("reward.model.path is required when the reward.model section is set")
    for key, v in (("reward.model.tp", m.tp), ("reward.model.pp", m.pp)):
        if v < 1:
            raise ConfigError(f"{key} must be >= 1, got {v}")
    if m.weight == 0:
        raise ConfigError("reward.model.weight is 0: the model's score would count for nothing (remove the section)")
    if m.clip is not None and not m.clip > 0:
        raise ConfigError(f"reward.model.clip must be > 0 (or null: no clipping), got {m.clip}")
    if not cfg.samples_rollouts():
        raise ConfigError(f"reward.model scores rollouts (megatron-rl train); algorithm={cfg.algorithm} has none")
    if cfg.environment.cls is not None:
        raise ConfigError("reward.model with environment.cls: a multi-turn run's reward is its environment's; remove "
                          "one of them")
    if cfg.grpo.max_staleness > 0:
        raise ConfigError("reward.model with grpo.max_staleness > 0: asynchronous rollouts are not scored by a reward "
                          "model yet; set grpo.max_staleness=0")
    if cfg.distillation is not None:
        raise ConfigError("reward.model with distillation: one frozen model at a time for now; remove one of them")
    from megatron_rl.distributed.parallel_dims import layout_of

    world = layout_of(cfg).policy.world_size
    if world % (m.tp * m.pp):
        raise ConfigError(f"reward.model.tp*pp = {m.tp * m.pp} does not divide the policy's {world} ranks (the reward "
                          "model runs one rank on each of the policy's devices)")


def reward_model_policy_config(cfg: Config) -> PolicyConfig:
    """Its ranks' PolicyConfig: the model's folder and split, a value head (its export's `score`), the policy's
    forward settings (micro-batch budget, shared prefix; packing as the megatron backend resolves it), no LoRA. A
    megatron model whatever the policy's backend: it only scores."""
    from megatron_rl.platform import get_platform

    m = cfg.reward.model
    packing = get_platform().default_packing if cfg.policy.backend == "fsdp2" else cfg.policy.packing
    return dataclasses.replace(cfg.policy, backend="megatron", model=str(reward_model_hf_dir(m.path)), tokenizer=None,
                               tp=m.tp, pp=m.pp, packing=packing, dp=None, ep=1, moe_aux_loss_coef=0.0, lora=None,
                               activation_recompute=False, value_head=True, fused_lm_head=False,
                               moe_routing_replay="off",  # another model: the engine's routing is the policy's
                               precision=cfg.policy.precision if m.precision == "auto" else m.precision)
