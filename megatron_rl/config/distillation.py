"""The `distillation:` section's rules (docs/distillation.md): what the teacher is, and what it must share with the
student. Defaults live in the schema (`schema.DistillationConfig`); this module only checks and derives.

- `validate_distillation`: the section's own numbers and combinations, before any model is read (the loader's
  `validate`);
- `validate_teacher_model`: the teacher's split against its config.json (the loader, with check_model);
- `check_teacher_vocab`: the teacher scores the student's token ids, so both tokenizers must map every token string
  to the same id (the pre-flight; one line naming both models otherwise);
- `check_teacher_family`: the teacher is a megatron model on either policy backend, so its family must be one the
  megatron backend builds (the pre-flight);
- `teacher_policy_config`: the PolicyConfig the teacher's ranks build from (the policy's model-building code).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Optional

from megatron_rl.config.loader import ConfigError, resolve_model_dir
from megatron_rl.config.schema import Config, PolicyConfig


def teacher_checkpoint(teacher: str) -> Optional[Path]:
    """The megatron-rl checkpoint directory `teacher` names (a `step_N` with metadata.json), else None (an HF
    folder)."""
    path = Path(teacher).expanduser()
    if not (path / "metadata.json").is_file():  # an HF folder: no need to import the checkpoint code (torch)
        return None
    from megatron_rl.models.checkpoint import is_checkpoint

    return path if is_checkpoint(path) else None


def teacher_hf_dir(teacher: str) -> Path:
    """The HF folder of the teacher's config and tokenizer: the folder itself, or a checkpoint's hf/ copy."""
    ckpt = teacher_checkpoint(teacher)
    if ckpt is None:
        return resolve_model_dir(teacher)
    from megatron_rl.models.checkpoint import HF_DIR

    return ckpt / HF_DIR


def validate_distillation(cfg: Config) -> None:
    """ConfigError naming the key path for a section that cannot run (module doc)."""
    d = cfg.distillation
    if d is None:
        return
    if not d.teacher:
        raise ConfigError("distillation.teacher is required: an HF folder or a megatron-rl checkpoint directory")
    for key, v in (("distillation.tp", d.tp), ("distillation.pp", d.pp)):
        if v < 1:
            raise ConfigError(f"{key} must be >= 1, got {v}")
    for key, v in (("distillation.kl_coef", d.kl_coef), ("distillation.reward_weight", d.reward_weight),
                   ("distillation.topk", d.topk)):
        if v < 0:
            raise ConfigError(f"{key} must be >= 0, got {v}")
    if d.kl_coef == 0 and d.reward_weight == 0:
        raise ConfigError("distillation.kl_coef and distillation.reward_weight are both 0: the loss would be 0")
    if cfg.algorithm != "grpo":
        raise ConfigError(f"distillation is on-policy (the student samples): it runs with algorithm grpo "
                          f"(megatron-rl train), not {cfg.algorithm}")
    if cfg.grpo.loss.variant == "gspo":
        raise ConfigError("distillation gives every token its own advantage; grpo.loss.variant=gspo clips one ratio "
                          "per sequence: use variant grpo or cispo")
    if cfg.grpo.advantage.dynamic_sampling and d.reward_weight == 0:
        raise ConfigError("grpo.advantage.dynamic_sampling drops groups whose rewards are all equal, but with "
                          "distillation.reward_weight=0 the rewards carry no gradient and every token has a teacher "
                          "signal: turn dynamic sampling off")
    from megatron_rl.distributed.parallel_dims import layout_of

    world = layout_of(cfg).policy.world_size
    if world % (d.tp * d.pp):
        raise ConfigError(f"distillation.tp*pp = {d.tp * d.pp} does not divide the policy's {world} ranks (the "
                          "teacher runs one rank on each of the policy's devices)")


def check_frozen_split(section: str, key: str, path: str, tp: int, pp: int, what: str) -> dict:
    """A frozen scorer's (teacher's, reward model's) split `section`.tp/pp against its own config.json (the policy's
    rules, `parallel_dims.check_policy_split`); returns that config."""
    from megatron_rl.distributed.parallel_dims import check_policy_split

    cfg_file = teacher_hf_dir(path) / "config.json"
    if not cfg_file.is_file():
        raise ConfigError(f"{key}={path}: no config.json in {cfg_file.parent} (an HF folder or a megatron-rl "
                          "checkpoint directory)")
    hf = json.loads(cfg_file.read_text())
    if hf.get("num_experts") or hf.get("num_local_experts"):
        raise ConfigError(f"{key}={path}: mixture-of-experts {what}s are not supported yet ({cfg_file})")
    heads = hf.get("num_attention_heads")
    try:
        check_policy_split(tp=tp, pp=pp, heads=heads, kv_heads=hf.get("num_key_value_heads") or heads,
                           layers=hf.get("num_hidden_layers"), ffn=hf.get("intermediate_size"))
    except ValueError as e:
        raise ConfigError(f"{str(e).replace('policy.', section + '.')} of the {what} ({cfg_file})") from None
    return hf


def validate_teacher_model(cfg: Config) -> None:
    """The teacher's split against its own shape (the policy's rules, `parallel_dims.check_policy_split`)."""
    from megatron_rl.distributed.parallel_dims import check_policy_split

    d = cfg.distillation
    if d is None:
        return
    hf = check_frozen_split("distillation", "distillation.teacher", d.teacher, d.tp, d.pp, "teacher")
    if d.topk > hf.get("vocab_size", d.topk):
        raise ConfigError(f"distillation.topk={d.topk} is more than the teacher's vocab_size {hf['vocab_size']}")
    ckpt = teacher_checkpoint(d.teacher)
    if ckpt is not None:
        from megatron_rl.models.checkpoint import read_metadata

        if read_metadata(ckpt).get("adapters") is not None:
            raise ConfigError(f"distillation.teacher={d.teacher} is a LoRA checkpoint (adapters only): export it "
                              "merged to an HF folder (megatron-rl export) and distil from that")


def check_teacher_vocab(cfg: Config, student_tok) -> None:
    """One line naming both models when their tokenizers map tokens to ids differently (module doc); also every
    student id must index a row of the teacher's embedding."""
    if cfg.distillation is not None:
        check_shared_vocab(cfg, student_tok, "distillation.teacher", cfg.distillation.teacher,
                           "the teacher must score the student's token ids")


def check_shared_vocab(cfg: Config, student_tok, key: str, path: str, why: str) -> None:
    """A frozen scorer at `path` (config key `key`: a teacher, a reward model) reads the policy's token ids: the same
    token-to-id map, and an embedding row for every id, else one line naming both models and `why`."""
    from megatron_rl.data.tokenizer import tokenizer_for

    hf_dir = teacher_hf_dir(path)
    try:
        other_tok = tokenizer_for(hf_dir)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key}={path}: cannot load its tokenizer: {e}") from None
    student = f"policy.model={cfg.policy.model}" + (f" (tokenizer {cfg.policy.tokenizer})" if cfg.policy.tokenizer
                                                     else "")
    sv, tv = student_tok.vocabulary(), other_tok.vocabulary()
    if sv != tv:
        differ = sorted(k for k in set(sv) | set(tv) if sv.get(k) != tv.get(k))
        raise ConfigError(f"{key}={path} and {student} do not share a tokenizer vocabulary "
                          f"({len(tv)} vs {len(sv)} tokens, {len(differ)} differ, e.g. {differ[0]!r}): {why}")
    hf = json.loads((hf_dir / "config.json").read_text())
    if hf.get("vocab_size", 0) < student_tok.vocab_size:
        raise ConfigError(f"{key}={path}: its vocab_size {hf.get('vocab_size')} is smaller than "
                          f"the policy's tokenizer ({student_tok.vocab_size} tokens, {student})")


def check_teacher_family(cfg: Config) -> None:
    """The teacher is built by the megatron backend's model code (policy/teacher_worker.py) whatever
    `policy.backend` is, so its family must be one that code represents (an fsdp2 student may be of another)."""
    d = cfg.distillation
    if d is not None:
        check_megatron_family("distillation.teacher", d.teacher, "the teacher")


def check_megatron_family(key: str, path: str, what: str) -> None:
    """A frozen scorer's family must be one the megatron backend builds (it runs there whatever policy.backend is)."""
    from megatron_rl.models.provider import UnsupportedModelError, model_spec

    try:
        model_spec(teacher_hf_dir(path))
    except UnsupportedModelError as e:
        raise ConfigError(f"{key}={path}: {e} ({what} runs on the megatron backend, whatever policy.backend is)") \
            from None


def teacher_policy_config(cfg: Config) -> PolicyConfig:
    """The teacher ranks' PolicyConfig: the teacher's folder and split, the policy's forward settings (micro-batch
    budget, packing as the megatron backend resolves it, shared prefix, fused head), no LoRA, no optimizer use. The teacher is a megatron model whatever
    the student's `policy.backend` (policy/teacher_worker.py): it only scores, and its logprobs and top-k come from
    the policy's own megatron forward; an fsdp2 student reads them like any other batch field."""
    from megatron_rl.platform import get_platform

    d = cfg.distillation
    # policy.packing was resolved for the student's backend: an fsdp2 student's `auto` is none (its varlen row carries
    # a mask), which would put the megatron teacher on explicit-mask, quadratic attention on GPU. The teacher takes
    # the megatron backend's own `auto` then; a megatron student's packing (auto or chosen) suits the teacher as is.
    packing = get_platform().default_packing if cfg.policy.backend == "fsdp2" else cfg.policy.packing
    return dataclasses.replace(cfg.policy, backend="megatron", model=str(teacher_hf_dir(d.teacher)), tokenizer=None,
                               tp=d.tp, pp=d.pp, packing=packing,
                               dp=None, ep=1, moe_aux_loss_coef=0.0, lora=None, activation_recompute=False,
                               moe_routing_replay="off",  # another model: the engine's routing is the student's
                               precision=cfg.policy.precision if d.precision == "auto" else d.precision)
