"""The rules of the supervised sections (`sft:`, `dpo:`, `rm:`; docs/sft_dpo.md): their numbers always (a typo is
caught before the section is used), the data file and the batch against the data-parallel ranks when the run is one
of them, and what the reward model's run derives (a value head on the policy). Defaults live in the schema; this
module only checks and derives (the loader's `validate` calls it).
"""
from __future__ import annotations

from megatron_rl.config.loader import ConfigError
from megatron_rl.config.schema import Config
from megatron_rl.distributed.parallel_dims import layout_of

SECTIONS = ("sft", "dpo", "rm")


def validate_supervised(cfg: Config) -> None:
    for name in SECTIONS:
        s = getattr(cfg, name)
        for key, v, low in (("batch_size", s.batch_size, 1), ("epochs", s.epochs, 1), ("val_every", s.val_every, 0),
                            ("val_max_examples", s.val_max_examples, 1),
                            ("max_nonfinite_steps", s.max_nonfinite_steps, 1),
                            ("max_steps", s.max_steps, 1), ("max_seq_len", s.max_seq_len, 2)):
            if v is not None and v < low:
                raise ConfigError(f"{name}.{key} must be >= {low}, got {v}")
    d = cfg.dpo
    if d.beta <= 0:
        raise ConfigError(f"dpo.beta must be > 0, got {d.beta}")
    if not 0 <= d.label_smoothing < 0.5:
        raise ConfigError(f"dpo.label_smoothing must be in [0, 0.5), got {d.label_smoothing}")
    if d.label_smoothing and d.loss != "sigmoid":
        raise ConfigError(f"dpo.label_smoothing applies to dpo.loss=sigmoid only, not {d.loss!r}")
    if d.sft_loss_weight < 0:
        raise ConfigError(f"dpo.sft_loss_weight must be >= 0, got {d.sft_loss_weight}")
    coef = cfg.rm.center_rewards_coefficient
    if coef is not None and coef < 0:
        raise ConfigError(f"rm.center_rewards_coefficient must be >= 0 (or null: off), got {coef}")
    _value_head(cfg)
    if cfg.samples_rollouts():
        return
    if not cfg.data.path:
        raise ConfigError(f"data.path is required for algorithm={cfg.algorithm} (a JSONL file; docs/sft_dpo.md)")
    dp = layout_of(cfg).policy.dp
    s = getattr(cfg, cfg.algorithm)
    if s.batch_size < dp:
        raise ConfigError(f"{cfg.algorithm}.batch_size={s.batch_size} is smaller than the {dp} data-parallel ranks "
                          "(each needs an example)")


def _value_head(cfg: Config) -> None:
    """A reward model is the policy's decoder with a value head: algorithm=rm sets policy.value_head, which nothing
    else may (a GRPO policy with a value head would train values as logprobs)."""
    p = cfg.policy
    if cfg.algorithm != "rm":
        if p.value_head:
            raise ConfigError(f"policy.value_head is set by algorithm=rm (megatron-rl rm), not for "
                              f"algorithm={cfg.algorithm}")
        return
    if p.lora is not None:
        raise ConfigError("megatron-rl rm: policy.lora is not supported with a value head yet (the head would "
                          "train, the decoder would not merge into an HF ForSequenceClassification export); "
                          "remove policy.lora")
    p.value_head = True
    p.fused_lm_head = False  # no logits to fuse: the head is width 1
