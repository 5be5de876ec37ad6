"""`megatron-rl plan` and the config: the workload read from a recipe, and the chosen layout written as a config.

The config is the one truth for what a step does. The planner's workload (sequences per step, context, micro-batch
tokens, optimizer steps, forward-only logprob passes, eager decode) is read from a `Config`: the `--base` recipe, or
the schema's defaults without one, after the command line's workload flags have been applied to it as config keys
(`WORKLOAD_KEYS`). So a plan and the config written for it describe the same run.

`--write-config OUT` writes a file that inherits the recipe (`defaults:`, a path relative to OUT) and sets the keys
of the chosen layout (cluster.*, policy.tp/pp/dp/activation_recompute, policy.ep for MoE models,
generation.tp/dp/gpu_memory_utilization, grpo.max_staleness) plus the workload keys the flags changed. It is written
only once the config loader (`load_config`, the same validation `megatron-rl train` runs) accepts it.
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

import yaml

from megatron_rl.config.loader import (
    ConfigError, apply_overrides, from_dict, load_config, read_yaml_tree, resolve_model_dir,
)
from megatron_rl.config.schema import Config
from megatron_rl.planner.cost_model import Infeasible, Plan, Workload
from megatron_rl.planner.presets import GPU

# command-line flag -> the config keys it sets (documentation for --help; `workload_overrides` applies them)
WORKLOAD_KEYS = {
    "--samples N": "grpo.num_prompts_per_step = N / grpo.num_generations_per_prompt",
    "--seq-len L": "generation.max_model_len = L, generation.max_new_tokens = L - data.max_prompt_tokens",
    "--optimizer-steps S": "grpo.optimizer_steps_per_rollout = S",
    "--mb-tokens T": "policy.max_tokens_per_microbatch = T",
    "--enforce-eager / --no-enforce-eager": "generation.enforce_eager",
    "--kl": "grpo.loss.kl_coef = 1e-3 where the config has no KL term",
}
# the workload flags' values when neither they nor a recipe say otherwise (the planner's historical defaults)
CLI_DEFAULTS = {"samples": 1024, "seq_len": 8192, "optimizer_steps": 1}
DEFAULT_KL_COEF = 1e-3  # --kl without a recipe: some KL term (its size does not change the step time)


def _key(value) -> str:
    """An override's value as YAML: JSON quoting keeps strings strings (a path named `1` or `true` included)."""
    return json.dumps(value)


def config_tree(base: Path | None, overrides: list[str]) -> dict:
    """The recipe's YAML tree (inheritance resolved; empty without a recipe) with `overrides` applied."""
    return apply_overrides(read_yaml_tree(base) if base else {}, overrides)


def typed_config(base: Path | None, overrides: list[str]) -> Config:
    """The typed config without the cross-field checks: the layout keys are the planner's to choose, so a recipe's
    own layout (say, one device) must not stop it from planning another."""
    return from_dict(config_tree(base, overrides), source=str(base or "the schema defaults"))


def workload_overrides(cfg: Config, *, samples: int | None, seq_len: int | None, optimizer_steps: int | None,
                       mb_tokens: int | None, enforce_eager: bool | None, kl: bool) -> list[str]:
    """Config keys for the workload flags that were given (None: keep the config's value); see WORKLOAD_KEYS."""
    out = []
    if samples is not None:
        g = cfg.grpo.num_generations_per_prompt
        if samples < g or samples % g:
            raise Infeasible(f"--samples {samples} is not a multiple of grpo.num_generations_per_prompt={g} "
                             "(a step samples whole groups)")
        out.append(f"grpo.num_prompts_per_step={samples // g}")
    if seq_len is not None:
        new = seq_len - cfg.data.max_prompt_tokens
        if new < 1:
            raise Infeasible(f"--seq-len {seq_len} leaves no response budget after data.max_prompt_tokens="
                             f"{cfg.data.max_prompt_tokens}")
        out += [f"generation.max_model_len={seq_len}", f"generation.max_new_tokens={new}"]
    if optimizer_steps is not None:
        out.append(f"grpo.optimizer_steps_per_rollout={optimizer_steps}")
    if mb_tokens is not None:
        out.append(f"policy.max_tokens_per_microbatch={mb_tokens}")
    if enforce_eager is not None:
        out.append(f"generation.enforce_eager={_key(enforce_eager)}")
    if kl and cfg.grpo.loss.kl_coef <= 0:
        out.append(f"grpo.loss.kl_coef={DEFAULT_KL_COEF}")
    return out


def workload_from_config(cfg: Config, *, prompt_len: int, avg_len: int | None) -> Workload:
    """What one step of `cfg` does, for the planner. Prompt and mean lengths are properties of the data, not keys."""
    g = cfg.grpo
    return Workload(samples=g.num_prompts_per_step * g.num_generations_per_prompt, seq_len=cfg.max_model_len(),
                    avg_len=avg_len, prompt_len=prompt_len, mb_tokens=cfg.policy.max_tokens_per_microbatch,
                    optimizer_steps=g.optimizer_steps_per_rollout, logprob_passes=g.logprob_passes(),
                    distributed_optimizer=cfg.policy.optimizer.distributed, enforce_eager=cfg.generation.enforce_eager)


def layout_overrides(p: Plan, gpu: GPU) -> list[str]:
    """The config keys of a plan's layout. Every count is explicit (policy.dp, generation.dp), so the devices the
    run takes do not depend on defaults; nodes are filled evenly, at most gpu.gpus_per_host devices each."""
    total = p.total_gpus
    nodes = math.ceil(total / gpu.gpus_per_host)
    # vLLM sizes itself (weights + KV cache) as a fraction of the device: the plan's KV cache, rounded down
    util = math.floor(p.vllm_gib / gpu.memory_gib * 100) / 100
    return [f"cluster.num_nodes={nodes}", f"cluster.devices_per_node={math.ceil(total / nodes)}",
            f"cluster.colocated={_key(p.colocated)}", f"policy.tp={p.tp}", f"policy.pp={p.pp}", f"policy.dp={p.dp}",
            f"policy.activation_recompute={_key(p.recompute)}", f"generation.tp={p.gen_tp}",
            f"generation.dp={p.gen_instances}", f"generation.gpu_memory_utilization={util}",
            f"grpo.max_staleness={p.max_staleness}"] + ([f"policy.ep={p.ep}"] if p.ep > 1 else []) \
        + ([f"policy.cp={p.cp}"] if p.cp > 1 else [])


def _shape(spec) -> tuple:
    return (spec.num_layers, spec.hidden_size, spec.ffn_hidden_size, spec.num_heads, spec.num_kv_heads,
            spec.head_dim, spec.vocab_size, spec.tied_embeddings, spec.moe and spec.moe.num_experts,
            spec.moe and spec.moe.topk, spec.moe and spec.moe.ffn_hidden_size)


def model_overrides(model_arg: str, label: str, spec, cfg: Config, *, has_base: bool) -> tuple[list[str], str]:
    """policy.model for the written config, and a note when the loader cannot see the model's config.json here.

    `--model FOLDER` is what the run trains. With a preset name the recipe's policy.model stays; when that folder
    exists here it must be the planned architecture."""
    if Path(model_arg).exists():
        folder = Path(model_arg).resolve()
        return [f"policy.model={_key(str(folder.parent if folder.is_file() else folder))}"], ""
    if not has_base:
        raise Infeasible(f"--write-config: a preset name ({label}) does not say where the weights are; give --model "
                         "as the HF folder to train, or a --base recipe whose policy.model is it")
    folder = resolve_model_dir(cfg.policy.model)
    if not (folder / "config.json").is_file():
        return [], (f"policy.model={cfg.policy.model} is not on this machine: the loader checked the layout "
                    f"against the {label} preset's shape instead of its config.json")
    from megatron_rl.models.provider import model_spec

    theirs = model_spec(folder)
    if _shape(theirs) != _shape(spec):
        raise Infeasible(f"the plan is for {label}, but the config trains policy.model={cfg.policy.model} "
                         f"({theirs.num_parameters() / 1e9:.2f}B parameters, another shape); give --model as the "
                         "HF folder to train, or a --base recipe whose policy.model is this model")
    return [], ""


def write_config(out: Path, base: Path | None, overrides: list[str], *, check_model: bool, header: str) -> Config:
    """Write `overrides` on top of `base` to `out`, once `load_config` accepts the file as written."""
    out = Path(out)
    doc = {"defaults": os.path.relpath(Path(base).resolve(), out.parent.resolve())} if base else {}
    doc.update(apply_overrides({}, overrides))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")  # same folder: `defaults:` resolves the same way
    tmp.write_text(header + yaml.safe_dump(doc, sort_keys=False))
    try:
        cfg = load_config(tmp, check_model=check_model)
    except ConfigError as e:
        raise Infeasible(f"the config for this layout does not load: {str(e).replace(str(tmp), str(out))}") from None
    else:
        os.replace(tmp, out)
        return cfg
    finally:
        tmp.unlink(missing_ok=True)
