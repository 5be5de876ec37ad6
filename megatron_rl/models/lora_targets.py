"""LoRA target names as PEFT users write them, and where each lives in megatron-core's fused linears.

PEFT wraps the HF projections one by one (`q_proj`, ..., `down_proj`); megatron fuses q/k/v into `linear_qkv` and
gate/up into `linear_fc1`. A target here is always one HF projection: it gets its own A and B, and its B writes only
that projection's rows of the fused output (`models/mapping.py` has the fused layouts), so a target list trains
exactly the matrices it trains in PEFT. `all-linear` is PEFT's shorthand for every linear layer but the lm_head.

This module is pure (no torch, no megatron): the config loader checks targets against the model's config.json with it
before anything starts, and the policy's adapters (`models/lora.py`) are built from its `resolve_targets`. The FSDP2
backend adapts transformers' modules as they are (`select_hf_linears`, policy/fsdp2_lora.py), so there a target is
any nn.Linear of the decoder layers, as in PEFT.
"""
from __future__ import annotations

from dataclasses import dataclass

ALL_LINEAR = "all-linear"
KEY = "policy.lora.target_modules"


@dataclass(frozen=True)
class Target:
    hf: str  # the HF projection: q_proj ... down_proj
    hf_parent: str  # its HF module under model.layers.{i}: self_attn or mlp
    module: str  # the megatron linear under decoder.layers.{j}
    kind: str  # column (A replicated over TP, B split like the output) or row (A split like the input, B replicated)
    slot: int  # its position in the fused output (q, k, v / gate, up); 0 for row-parallel linears


TARGETS = {t.hf: t for t in (
    Target("q_proj", "self_attn", "self_attention.linear_qkv", "column", 0),
    Target("k_proj", "self_attn", "self_attention.linear_qkv", "column", 1),
    Target("v_proj", "self_attn", "self_attention.linear_qkv", "column", 2),
    Target("o_proj", "self_attn", "self_attention.linear_proj", "row", 0),
    Target("gate_proj", "mlp", "mlp.linear_fc1", "column", 0),
    Target("up_proj", "mlp", "mlp.linear_fc1", "column", 1),
    Target("down_proj", "mlp", "mlp.linear_fc2", "row", 0),
)}
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# the expert projections' HF names per MoE architecture (models/mapping.HF_MOE_NAMES spells them on disk)
MOE_EXPERT_NAMES = {"qwen3_moe": ("gate_proj", "up_proj", "down_proj"), "mixtral": ("w1", "w2", "w3")}


def resolve_targets(target_modules, hf_config: dict) -> list[Target]:
    """The Targets a `policy.lora.target_modules` list names for this model (HF config.json as a dict), in a fixed
    order. Raises ValueError naming the key for a name that is no linear of the model, or an MoE expert projection
    (adapters on experts are not supported). `all-linear` on an MoE model means the attention projections."""
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules or [])
    if not names:
        raise ValueError(f"{KEY} is empty: name the projections to adapt (e.g. [q_proj, v_proj]) or 'all-linear'")
    experts = MOE_EXPERT_NAMES.get(hf_config.get("model_type"), ())
    chosen: set[str] = set()
    for n in names:
        if n == ALL_LINEAR:
            chosen.update(ATTENTION if experts else TARGETS)
        elif n in experts:
            raise ValueError(f"{KEY}: {n!r} is an expert projection of this mixture-of-experts model "
                             f"({hf_config.get('model_type')}); LoRA on experts is not supported (target the "
                             f"attention projections {', '.join(ATTENTION)}, or 'all-linear', which means them here)")
        elif n in TARGETS:
            chosen.add(n)
        else:
            known = [t for t in TARGETS if not (experts and t not in ATTENTION)]
            raise ValueError(f"{KEY}: {n!r} is no linear layer of this model that LoRA can adapt (known: "
                             f"{', '.join(known)}, or '{ALL_LINEAR}')")
    return [TARGETS[n] for n in TARGETS if n in chosen]


def peft_name(layer: int, target: Target, matrix: str) -> str:
    """PEFT's saved tensor name of one adapter matrix (A or B) of global layer `layer`."""
    return peft_hf_name(f"model.layers.{layer}.{target.hf_parent}.{target.hf}", matrix)


def hf_weight_name(layer: int, target: Target) -> str:
    """The HF base weight a target adapts (the merged export adds the adapter's product to it)."""
    return f"model.layers.{layer}.{target.hf_parent}.{target.hf}.weight"


def select_hf_linears(target_modules, linear_paths: list[str], moe: bool) -> list[str]:
    """The FSDP2 backend's targets (it adapts transformers' own modules, whatever the architecture): the paths under
    a decoder layer (`self_attn.q_proj`, Phi-3's `self_attn.qkv_proj`, ...) of the nn.Linear modules
    `target_modules` names, as PEFT matches them (a name is a path's last part, or the path itself). `all-linear`:
    every one of them (the lm_head is outside the layers), on an MoE model the attention ones (its routers and
    experts take no adapters, as on the megatron backend). ValueError naming the key for a name matching none."""
    names = [target_modules] if isinstance(target_modules, str) else list(target_modules or [])
    if not names:
        raise ValueError(f"{KEY} is empty: name the projections to adapt (e.g. [q_proj, v_proj]) or 'all-linear'")
    eligible = [p for p in linear_paths if not moe or p.split(".")[0] in ("self_attn", "attn", "attention")]
    chosen: set[str] = set()
    for n in names:
        hits = eligible if n == ALL_LINEAR else [p for p in eligible if p == n or p.endswith("." + n)]
        if not hits:
            last = sorted({p.rsplit(".", 1)[-1] for p in eligible})
            raise ValueError(f"{KEY}: {n!r} is no linear layer of this model's decoder layers that LoRA can adapt "
                             f"(known: {', '.join(last)}, or '{ALL_LINEAR}'"
                             f"{'; experts and routers take no adapters' if moe else ''})")
        chosen.update(hits)
    return [p for p in linear_paths if p in chosen]


def peft_hf_name(module_path: str, matrix: str) -> str:
    """PEFT's saved name of an adapter matrix on the HF module at `module_path` (`model.layers.0.self_attn.q_proj`)."""
    return f"base_model.model.{module_path}.lora_{matrix}.weight"
