"""The `ppo` and `critic` sections' rules (`algorithm: ppo`; defaults in `config/ppo_schema.py`): what they may be and
what the run around them must be, and the PolicyConfig the critic's ranks build from.

- `validate_ppo`: the numbers and combinations, before any model is read (the loader's `validate`);
- `critic_policy_config`: the policy's own settings (split, backend, precision, micro-batches, packing) with the
  critic's model, optimizer and schedule, a value head, no LoRA;
- `critic_checkpoint`: the checkpoint to load after set-up when `critic.model` is one (its hf/ folder builds it).
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from megatron_rl.config.distillation import teacher_checkpoint, teacher_hf_dir
from megatron_rl.config.loader import ConfigError, resolve_model_dir
from megatron_rl.config.schema import Config, PolicyConfig


def validate_ppo(cfg: Config) -> None:
    if cfg.algorithm != "ppo":
        return
    p, c = cfg.ppo, cfg.critic
    for key, v in (("ppo.gamma", p.gamma), ("ppo.lam", p.lam)):
        if not 0.0 <= v <= 1.0:
            raise ConfigError(f"{key} must be in [0, 1], got {v}")
    if c.value_clip is not None and not c.value_clip > 0:
        raise ConfigError(f"critic.value_clip must be > 0 (or null: no value clipping), got {c.value_clip}")
    if c.optimizer.lr <= 0:
        raise ConfigError(f"critic.optimizer.lr must be > 0, got {c.optimizer.lr}")
    if not 0 <= c.warmup_steps < cfg.grpo.max_steps:
        raise ConfigError(f"critic.warmup_steps={c.warmup_steps} must be >= 0 and below grpo.max_steps="
                          f"{cfg.grpo.max_steps} (those steps train the critic alone)")
    if cfg.grpo.loss.variant == "gspo":
        raise ConfigError("algorithm=ppo gives every token its own advantage (GAE); grpo.loss.variant=gspo clips "
                          "one ratio per sequence: use variant grpo or cispo")
    if p.kl_in_reward and cfg.grpo.loss.kl_coef == 0:
        raise ConfigError("ppo.kl_in_reward=true folds grpo.loss.kl_coef x KL into the reward, but grpo.loss.kl_coef "
                          "is 0: set it (e.g. 0.05) or ppo.kl_in_reward=false")
    if cfg.grpo.optimizer_steps_per_rollout > 1:
        raise ConfigError("algorithm=ppo trains one policy and one critic step per rollout for now: set "
                          "grpo.optimizer_steps_per_rollout=1")
    if c.model is not None and teacher_checkpoint(c.model) is not None and cfg.policy.backend == "fsdp2":
        raise ConfigError(f"critic.model={c.model} is a megatron-rl checkpoint, which the fsdp2 backend does not "
                          "load: export it to an HF folder (megatron-rl convert megatron-to-hf) and name that")
    if c.model is not None and not (teacher_hf_dir(c.model) / "config.json").is_file():
        raise ConfigError(f"critic.model={c.model}: no config.json in {teacher_hf_dir(c.model)} (an HF folder or a "
                          "megatron-rl checkpoint directory)")


def critic_model_dir(cfg: Config) -> Path:
    """The HF folder the critic's ranks build from (a checkpoint's hf/ folder; default: the policy's model)."""
    m = cfg.critic.model
    return resolve_model_dir(cfg.policy.model) if m is None else teacher_hf_dir(m)


def critic_checkpoint(cfg: Config) -> Path | None:
    return teacher_checkpoint(cfg.critic.model) if cfg.critic.model is not None else None


def critic_policy_config(cfg: Config) -> PolicyConfig:
    c = cfg.critic
    return dataclasses.replace(cfg.policy, model=str(critic_model_dir(cfg)), tokenizer=None, optimizer=c.optimizer,
                               scheduler=c.scheduler, lora=None, value_head=True, fused_lm_head=False,
                               moe_routing_replay="off",  # its own router: the engine sampled with the policy's
                               precision=cfg.policy.precision if c.precision == "auto" else c.precision)


def check_critic_model(cfg: Config, policy_tok) -> None:
    """critic.model against the policy (the pre-flight, before anything starts): it reads the policy's token ids
    (one vocabulary), builds on the policy's backend, and splits as the policy does (policy.tp / policy.pp)."""
    m = cfg.critic.model
    if cfg.algorithm != "ppo" or m is None:
        return
    import json

    from megatron_rl.config.distillation import check_megatron_family, check_shared_vocab
    from megatron_rl.distributed.parallel_dims import check_policy_split

    check_shared_vocab(cfg, policy_tok, "critic.model", m, "the critic scores the policy's token ids")
    if cfg.policy.backend == "megatron":
        check_megatron_family("critic.model", m, "the critic")
    cfg_file = teacher_hf_dir(m) / "config.json"
    hf = json.loads(cfg_file.read_text())
    heads = hf.get("num_attention_heads")
    try:
        check_policy_split(tp=cfg.policy.tp, pp=cfg.policy.pp, heads=heads,
                           kv_heads=hf.get("num_key_value_heads") or heads, layers=hf.get("num_hidden_layers"),
                           ffn=hf.get("intermediate_size"))
    except ValueError as e:
        raise ConfigError(f"critic.model={m}: the critic takes the policy's split: {e} ({cfg_file})") from None
