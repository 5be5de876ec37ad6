"""YAML + command-line overrides -> a validated `Config`.

    cfg = load_config("configs/demo_cpu.yaml", ["policy.tp=2", "grpo.max_steps=5"])

- A YAML file may inherit: `defaults: base.yaml` (or a list), paths relative to the file. Later files and then the
  command line override earlier values; mappings merge key by key, everything else is replaced.
- Every key is checked against the typed tree: an unknown key, a wrong type or a value outside a Literal's choices
  raises `ConfigError` naming the full key path (`policy.optimizer.lr`) and the file it came from.
- `validate()` then checks combinations (tp must divide the model's heads, pp its layers, ...) before any work starts.
"""
from __future__ import annotations

import dataclasses
import json
import re
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from megatron_rl.config.moe_rules import routing_replay_enabled
from megatron_rl.config.sequence_rules import check_sequence_heads, validate_sequence_split
from megatron_rl.config.schema import Config
from megatron_rl.platform import get_platform
from megatron_rl.distributed.parallel_dims import check_engine_split, check_expert_split, check_policy_split, layout_of


# generation.gpu_memory_utilization when unset: colocated engines leave half of each device to the trainer, whose
# state returns between rollouts; engines on devices of their own take vLLM's own default
COLOCATED_GPU_MEMORY_UTILIZATION = 0.5
OWN_DEVICE_GPU_MEMORY_UTILIZATION = 0.9
# the adapter ranks vLLM 0.32 can serve (its LoRAConfig.max_lora_rank choices): generation.lora_refit=adapter starts
# the engine with the smallest one >= policy.lora.rank (generation/lora_serving.py)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class ConfigError(ValueError):
    """A configuration problem, always naming the key path."""


# Values a user may reasonably try that the schema leaves out on purpose: key path -> value -> why.
REFUSED_VALUES = {
    "policy.precision": {
        "fp16": "fp16 needs dynamic loss scaling, which megatron-rl does not wire (megatron's fp16 optimizer would "
                "unscale gradients of a loss that was never scaled, so the run cannot learn); use bf16 (or fp32)",
    },
}


# "package.module:Class": dotted identifiers, one colon; the attribute may itself be dotted (Outer.Inner)
_CLASS_PATH_RE = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*$")


def check_class_path(value: Any, key: str) -> tuple[str, str]:
    """(module, qualname) of "package.module:Class", or a ConfigError naming `key` (the form; loaders import it)."""
    if not isinstance(value, str) or not _CLASS_PATH_RE.match(value.strip()):
        raise ConfigError(f"{key}={value!r} must be an import path 'package.module:Class' (a module Python can "
                          "import, a colon, the class name; e.g. megatron_rl.environments.guess_number:GuessNumber)")
    module, qualname = value.strip().split(":")
    return module, qualname


# ---------------------------------------------------------------------------------------------------- YAML layering

def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def read_yaml_tree(path: str | Path, _seen: tuple = ()) -> dict:
    """Read a YAML config, resolving `defaults:` inheritance (depth-first, cycle-checked)."""
    path = Path(path).resolve()
    if path in _seen:
        raise ConfigError(f"{path}: 'defaults' inheritance cycle through {[str(p) for p in _seen]}")
    if not path.is_file():
        where = f" (inherited by {_seen[-1]})" if _seen else ""
        raise ConfigError(f"config file not found: {path}{where}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    parents = data.pop("defaults", None) or []
    if isinstance(parents, str):
        parents = [parents]
    merged: dict = {}
    for parent in parents:
        merged = _merge(merged, read_yaml_tree(path.parent / parent, _seen + (path,)))
    return _merge(merged, data)


def apply_overrides(tree: dict, overrides: list[str]) -> dict:
    """Apply `a.b.c=value` strings; the value is parsed as YAML (`3`, `1e-6`, `true`, `[a, b]`, `null`)."""
    tree = json.loads(json.dumps(tree))  # deep copy of plain data
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like key.path=value")
        key, raw = item.split("=", 1)
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {key}: cannot parse value {raw!r}: {e}") from e
        node = tree
        parts = key.strip().split(".")
        for p in parts[:-1]:
            if node.get(p) is None:  # absent, or an optional section that is off (`wandb: null` in a saved config)
                node[p] = {}
            node = node[p]
            if not isinstance(node, dict):
                raise ConfigError(f"override {key}: '{p}' is not a section")
        node[parts[-1]] = value
    return tree


# ------------------------------------------------------------------------------------------------- typed conversion

def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def _convert(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(value, a, path)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0] if len(errors) == 1 else f"{path}: {value!r} matches none of {args}")
    if origin is typing.Literal:
        if isinstance(value, bool) and ("on" if value else "off") in args:  # YAML 1.1 reads bare on/off as booleans
            value = "on" if value else "off"
        why = REFUSED_VALUES.get(path, {}).get(value) if isinstance(value, str) else None
        if why:
            raise ConfigError(f"{path}: {value!r} is refused: {why}")
        if value not in args:
            raise ConfigError(f"{path}: {value!r} is not one of {list(args)}")
        return value
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a section (mapping), got {value!r}")
        return _build_dataclass(tp, value, path)
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{path}: expected a list, got {value!r}")
        return [_convert(v, args[0], f"{path}[{i}]") for i, v in enumerate(value)] if args else list(value)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path}: expected a mapping, got {value!r}")
        return {str(k): _convert(v, args[1], f"{path}.{k}") if args else v for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ConfigError(f"{path}: expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str):  # YAML reads "1e-6" (no dot) as a string
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{path}: expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{path}: expected a string, got {value!r}")
    raise ConfigError(f"{path}: unsupported config type {_type_name(tp)}")


def _build_dataclass(cls: type, data: dict, path: str) -> Any:
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    spell = getattr(cls, "spelled", None)  # a section that also takes another library's spellings (LoraConfig: PEFT's)
    if spell is not None:
        try:
            data = spell(data)
        except ValueError as e:
            raise ConfigError(f"{path}.{e}" if path else str(e)) from None
    unknown = [k for k in data if k not in names]
    if unknown:
        where = f"{path}." if path else ""
        known = ", ".join(sorted(names))
        raise ConfigError(f"unknown key '{where}{unknown[0]}' (known keys here: {known})")
    kwargs = {k: _convert(v, hints[k], f"{path}.{k}" if path else k) for k, v in data.items()}
    return cls(**kwargs)


def from_dict(data: dict, source: str = "") -> Config:
    try:
        return _build_dataclass(Config, data, "")
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}" if source else str(e)) from None


def to_dict(cfg: Any) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config, path: str | Path) -> None:
    Path(path).write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


# ------------------------------------------------------------------------------------------------------ validation

def resolve_model_dir(model: str) -> Path:
    if model == "default":
        from megatron_rl.paths import default_model_dir

        return default_model_dir()
    return Path(model).expanduser()


def validate(cfg: Config, check_model: bool = True) -> Config:
    """Cross-field checks. Raises ConfigError naming the key path(s) involved."""
    p, g, c = cfg.policy, cfg.grpo, cfg.cluster
    positive = {"policy.tp": p.tp, "policy.pp": p.pp, "policy.cp": p.cp, "policy.sp": p.sp, "generation.tp": cfg.generation.tp,
                "grpo.num_prompts_per_step": g.num_prompts_per_step, "cluster.num_nodes": c.num_nodes,
                "grpo.num_generations_per_prompt": g.num_generations_per_prompt, "cluster.devices_per_node":
                c.devices_per_node, "grpo.optimizer_steps_per_rollout": g.optimizer_steps_per_rollout,
                "policy.max_tokens_per_microbatch": p.max_tokens_per_microbatch,
                "generation.max_new_tokens": cfg.generation.max_new_tokens}
    for key, v in positive.items():
        if v < 1:
            raise ConfigError(f"{key} must be >= 1, got {v}")
    try:  # the devices each part gets: the same function build() places with
        layout_of(cfg)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if g.max_minutes is not None and not g.max_minutes > 0:
        raise ConfigError(f"grpo.max_minutes must be > 0 (or null: no time budget), got {g.max_minutes}")
    if not 0.0 < cfg.generation.top_p <= 1.0:
        raise ConfigError(f"generation.top_p must be in (0, 1], got {cfg.generation.top_p}")
    if cfg.generation.temperature <= 0:
        raise ConfigError(f"generation.temperature must be > 0 (the loss needs sampling logprobs), "
                          f"got {cfg.generation.temperature}")
    if p.moe_aux_loss_coef < 0:
        raise ConfigError(f"policy.moe_aux_loss_coef must be >= 0, got {p.moe_aux_loss_coef}")
    if g.loss.ratio_clip_c is not None and g.loss.ratio_clip_c <= 1.0:
        raise ConfigError(f"grpo.loss.ratio_clip_c (dual clip) must be > 1, got {g.loss.ratio_clip_c}")
    _validate_algorithm(cfg)
    _validate_lora(cfg)
    _validate_backend(cfg)
    if cfg.generation.precision == "auto":
        cfg.generation.precision = cfg.policy.precision
    try:
        validate_sequence_split(cfg)  # config/sequence_rules.py: before packing's default, which CP fixes
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.policy.packing == "auto":  # fsdp2: none, its varlen row has a [t, t] mask; megatron: Platform.packing_for
        cfg.policy.packing = "none" if cfg.policy.backend == "fsdp2" else get_platform().packing_for(
            cfg.longest_train_row() if cfg.samples_rollouts() else 0)  # SFT/DPO/RM rows: 0, the platform's
    if cfg.generation.gpu_memory_utilization is None:
        cfg.generation.gpu_memory_utilization = (COLOCATED_GPU_MEMORY_UTILIZATION if cfg.cluster.colocated
                                                 else OWN_DEVICE_GPU_MEMORY_UTILIZATION)
    if not 0.0 < cfg.generation.gpu_memory_utilization <= 1.0:
        raise ConfigError(f"generation.gpu_memory_utilization must be in (0, 1], got "
                          f"{cfg.generation.gpu_memory_utilization}")
    _validate_data(cfg)
    _validate_environment(cfg)
    # these modules import this one's ConfigError
    from megatron_rl.config.distillation import validate_distillation
    from megatron_rl.config.reward_model import validate_reward_model
    from megatron_rl.config.ppo_rules import validate_ppo
    from megatron_rl.config.supervised_rules import validate_supervised
    from megatron_rl.config.inflight_rules import validate_inflight

    validate_supervised(cfg)
    validate_inflight(cfg)
    validate_distillation(cfg)
    validate_reward_model(cfg)
    validate_ppo(cfg)
    if check_model:
        validate_against_model(cfg)
    return cfg


def _validate_backend(cfg: Config) -> None:
    """What the FSDP2 backend (policy/fsdp2_worker.py) does not do yet refuses to start, naming the key: it shards
    over data- and tensor-parallel ranks (no pipeline or expert parallelism)."""
    p = cfg.policy
    if p.backend != "fsdp2":
        return
    unsupported = {"policy.pp": (p.pp, 1), "policy.ep": (p.ep, 1)}
    for key, (value, only) in unsupported.items():
        if value != only:
            raise ConfigError(f"{key}={value}: policy.backend=fsdp2 runs data and tensor parallelism only (set "
                              f"{key}={only}, or policy.backend=megatron)")


def _validate_lora(cfg: Config) -> None:
    """policy.lora's numbers (its targets need the model: `validate_against_model`), and what an adapter-only refit
    (generation.lora_refit=adapter) needs."""
    lora = cfg.policy.lora
    if cfg.generation.lora_refit == "adapter":
        _validate_adapter_refit(cfg)
    if lora is None:
        return
    if lora.rank <= 0:
        raise ConfigError(f"policy.lora.rank must be >= 1, got {lora.rank}")
    if lora.alpha <= 0:
        raise ConfigError(f"policy.lora.alpha must be > 0, got {lora.alpha}")
    if not 0.0 <= lora.dropout < 1.0:
        raise ConfigError(f"policy.lora.dropout must be in [0, 1), got {lora.dropout}")


def _validate_adapter_refit(cfg: Config) -> None:
    lora = cfg.policy.lora
    if lora is None:
        raise ConfigError("generation.lora_refit=adapter sends the engines LoRA adapters, but policy.lora is not set "
                          "(this policy trains every weight): set policy.lora or generation.lora_refit=merged")
    if lora.rank > VLLM_LORA_RANKS[-1]:
        raise ConfigError(f"policy.lora.rank={lora.rank}: vLLM serves adapters of rank <= {VLLM_LORA_RANKS[-1]} "
                          "(generation.lora_refit=adapter); use generation.lora_refit=merged")
    if cfg.samples_rollouts() and cfg.cluster.colocated and cfg.generation.sleep_level == 2:
        # level 2 drops the engine's weights while the trainer holds the device; the merged refit rewrites them all,
        # an adapter refit never sends the base again
        raise ConfigError("generation.sleep_level=2 discards the engine's base weights at every handover, and "
                          "generation.lora_refit=adapter never sends them again: set generation.sleep_level=1 "
                          "(or generation.lora_refit=merged)")


def _validate_data(cfg: Config) -> None:
    """The data source's own keys, and a reward kind that can score its items."""
    d = cfg.data
    if d.source == "jsonl" and not d.path:
        raise ConfigError("data.path is required when data.source is 'jsonl'")
    if d.source == "hf":
        if not d.path:
            raise ConfigError("data.path is required when data.source is 'hf' (a .parquet, .jsonl, .json or .csv "
                              "file, or a folder written by datasets' save_to_disk or holding .parquet shards)")
        for key in ("prompt_key", "answer_key"):
            value = getattr(d, key)
            if not value or any(not part for part in value.split(".")):
                raise ConfigError(f"data.{key}={value!r} must be a field name or a dotted path into nested fields "
                                  "(e.g. reward_model.ground_truth)")
    # a multi-turn run's reward is the environment's: the verifier is never asked
    if cfg.reward.kind == "reasoning_gym" and d.source != "reasoning_gym" and cfg.environment.cls is None:
        raise ConfigError(f"reward.kind=reasoning_gym scores reasoning-gym tasks only, not data.source={d.source}; "
                          "use reward.kind=auto (math-verify for jsonl and hf data) or math")


def _validate_environment(cfg: Config) -> None:
    """The environment section's numbers always (a typo is caught before it is switched on); the class path's form
    and the token budget against the prompt and the engine's context only when an environment is set."""
    e = cfg.environment
    for key, v in {"environment.max_turns": e.max_turns, "environment.max_tokens": e.max_tokens,
                   "environment.num_workers": e.num_workers}.items():
        if v < 1:
            raise ConfigError(f"{key} must be >= 1, got {v}")
    if not e.timeout_s > 0:
        raise ConfigError(f"environment.timeout_s must be > 0, got {e.timeout_s}")
    for i, s in enumerate(e.stop):
        if not s:
            raise ConfigError(f"environment.stop[{i}] is empty: an empty stop string would end every turn at once")
    if e.cls is None:
        return
    check_class_path(e.cls, "environment.cls")
    if e.max_tokens <= cfg.data.max_prompt_tokens:
        raise ConfigError(f"environment.max_tokens={e.max_tokens} (a whole trajectory) leaves no room after "
                          f"data.max_prompt_tokens={cfg.data.max_prompt_tokens}")
    if cfg.generation.max_model_len is not None and cfg.generation.max_model_len < e.max_tokens:
        raise ConfigError(f"generation.max_model_len={cfg.generation.max_model_len} is shorter than "
                          f"environment.max_tokens={e.max_tokens}: the engine could not hold a whole trajectory "
                          "(leave generation.max_model_len unset to size it from environment.max_tokens)")


def _validate_algorithm(cfg: Config) -> None:
    """Loss variants, mismatch corrections, overlong shaping and the mismatch guard; fills in the constant
    normaliser's length (grpo.loss.normalizer_max_len: None means generation.max_new_tokens)."""
    loss, g = cfg.grpo.loss, cfg.grpo
    if loss.ratio_clip_c is not None and loss.variant != "grpo":
        raise ConfigError(f"grpo.loss.ratio_clip_c (dual clip) applies to variant grpo only, not {loss.variant!r}")
    nonneg = {"grpo.loss.gspo_clip_low": loss.gspo_clip_low, "grpo.loss.gspo_clip_high": loss.gspo_clip_high,
              "grpo.loss.cispo_clip_low": loss.cispo_clip_low, "grpo.loss.cispo_clip_high": loss.cispo_clip_high,
              "grpo.loss.importance_mask_low": loss.importance_mask_low,
              "reward.overlong_buffer_len": cfg.reward.overlong_buffer_len,
              "reward.overlong_penalty": cfg.reward.overlong_penalty,
              "logging.samples_per_step": cfg.logging.samples_per_step}
    for key, v in nonneg.items():
        if v < 0:
            raise ConfigError(f"{key} must be >= 0, got {v}")
    if loss.kl_value_clamp is not None and loss.kl_value_clamp <= 0:
        raise ConfigError(f"grpo.loss.kl_value_clamp must be > 0 (or null to turn it off), got {loss.kl_value_clamp}")
    if loss.importance_mask_high <= loss.importance_mask_low:
        raise ConfigError(f"grpo.loss.importance_mask_high ({loss.importance_mask_high}) must be > "
                          f"grpo.loss.importance_mask_low ({loss.importance_mask_low})")
    if loss.normalizer_max_len is not None and loss.normalizer_max_len < 1:
        raise ConfigError(f"grpo.loss.normalizer_max_len must be >= 1, got {loss.normalizer_max_len}")
    if loss.effective_normalizer() == "constant" and loss.normalizer_max_len is None:
        loss.normalizer_max_len = cfg.generation.max_new_tokens
    if g.max_staleness < 0:
        raise ConfigError(f"grpo.max_staleness must be >= 0, got {g.max_staleness}")
    # max_staleness >= 1 with colocated placement is a layout rule (parallel_dims.device_layout)
    if loss.importance_correction is None:
        loss.importance_correction = "token" if g.max_staleness > 0 else "off"
    if cfg.reward.overlong_buffer_len > cfg.generation.max_new_tokens:
        raise ConfigError(f"reward.overlong_buffer_len={cfg.reward.overlong_buffer_len} is longer than "
                          f"generation.max_new_tokens={cfg.generation.max_new_tokens}")
    if g.mismatch_max_token_mult_prob_error <= 1.0:
        raise ConfigError("grpo.mismatch_max_token_mult_prob_error must be > 1 (1.0 means identical), got "
                          f"{g.mismatch_max_token_mult_prob_error}")
    if g.mismatch_max_gen_kl_error <= 0:
        raise ConfigError(f"grpo.mismatch_max_gen_kl_error must be > 0, got {g.mismatch_max_gen_kl_error}")


def validate_against_model(cfg: Config) -> None:
    """The trainer's and the engine's tensor/pipeline/expert split must suit the model's shape (its config.json): the
    rules of `parallel_dims.check_policy_split` / `check_engine_split` / `check_expert_split`, which the planner
    applies too."""
    model_dir = resolve_model_dir(cfg.policy.model)
    cfg_file = model_dir / "config.json"
    if not cfg_file.is_file():
        hint = " (run `bash launch/setup_env.sh` to prepare the default model)" if cfg.policy.model == "default" else ""
        raise ConfigError(f"policy.model: no config.json in {model_dir}{hint}")
    hf = json.loads(cfg_file.read_text())
    heads = hf.get("num_attention_heads")
    kv = hf.get("num_key_value_heads") or heads
    try:
        check_policy_split(tp=cfg.policy.tp, pp=cfg.policy.pp, heads=heads, kv_heads=kv,
                           layers=hf.get("num_hidden_layers"), ffn=hf.get("intermediate_size"))
        check_sequence_heads(cfg, heads, kv)  # config/sequence_rules.py: Ulysses' heads per SP rank
        check_engine_split(tp=cfg.generation.tp, heads=heads, kv_heads=kv)
    except ValueError as e:
        raise ConfigError(f"{e} of {cfg_file}") from None
    try:  # the expert count under either spelling (transformers saves Qwen3-MoE's as num_local_experts)
        check_expert_split(ep=cfg.policy.ep, tp=cfg.policy.tp, aux_loss_coef=cfg.policy.moe_aux_loss_coef,
                           num_experts=hf.get("num_experts") or hf.get("num_local_experts"))
    except ValueError as e:
        raise ConfigError(f"{e} (model: {cfg_file})") from None
    num_experts = hf.get("num_experts") or hf.get("num_local_experts")
    try:
        routing_replay_enabled(cfg, num_experts)
    except ValueError as e:
        raise ConfigError(f"{e} (model: {cfg_file})") from None
    if cfg.policy.lora is not None:
        try:
            _check_lora_targets(cfg, model_dir, hf)
        except ValueError as e:
            raise ConfigError(f"{e} (model: {cfg_file})") from None
    from megatron_rl.config.distillation import check_frozen_split, validate_teacher_model

    validate_teacher_model(cfg)
    m = cfg.reward.model
    if m is not None:
        check_frozen_split("reward.model", "reward.model.path", m.path, m.tp, m.pp, "reward model")


def _check_lora_targets(cfg: Config, model_dir: Path, hf: dict) -> None:
    """megatron: the HF projections its fused linears carry; fsdp2: any nn.Linear of transformers' decoder layers,
    listed on a meta-device copy of the model (its modules, no weights)."""
    from megatron_rl.models import lora_targets

    if cfg.policy.backend != "fsdp2":
        lora_targets.resolve_targets(cfg.policy.lora.target_modules, hf)
        return
    from megatron_rl.models.hf_layers import lora_linear_paths

    lora_linear_paths(cfg.policy.lora.target_modules, model_dir)


def load_config(path: str | Path, overrides: list[str] | None = None, check_model: bool = True) -> Config:
    """The validated config of YAML `path` + `overrides`; an error names the file or the override that wrote it."""
    overrides, yaml_tree = list(overrides or []), read_yaml_tree(path)
    from_dict(yaml_tree, source=str(path))  # the file's own errors, blamed on the file
    tree = apply_overrides(yaml_tree, overrides)
    try:
        cfg = from_dict(tree)
    except ConfigError as e:  # blame the last override whose key the error names (or lies under)
        keys = [(o, o.split("=", 1)[0].strip()) for o in reversed(overrides)]
        item = next((o for o, k in keys if f"'{k}" in str(e) or str(e).startswith(k)), None)
        where = f"command-line override '{item}'" if item else "command-line overrides"
        raise ConfigError(f"{where}: {e}") from None
    return validate(cfg, check_model=check_model)

