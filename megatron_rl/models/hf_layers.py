"""Where things are in a transformers causal LM, whatever its architecture: its decoder layers, the nn.Linear modules
in them (what LoRA can adapt on the FSDP2 backend), whether it routes over experts. The FSDP2 worker shards and
adapts these; the config loader lists them on a meta-device copy of the model (no weights read) to check
`policy.lora.target_modules` before anything starts."""
from __future__ import annotations

from pathlib import Path

from torch import nn


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    """The HF model's decoder blocks (one FSDP unit each)."""
    dec = lm.get_decoder()
    for name in ("layers", "h", "blocks"):
        layers = getattr(dec, name, None)
        if isinstance(layers, nn.ModuleList):
            return layers
    raise ValueError(f"{type(lm).__name__}: no decoder layer list found (looked for layers, h, blocks)")


def linear_paths(layers: nn.ModuleList) -> list[str]:
    """The nn.Linear modules' paths under a decoder layer (`self_attn.q_proj`, ...), in module order, over all
    layers (a model whose layers differ, dense and MoE ones, lists each path once)."""
    seen: dict[str, None] = {}
    for layer in layers:
        for name, m in layer.named_modules():
            if isinstance(m, nn.Linear):
                seen.setdefault(name)
    return list(seen)


def is_moe(config) -> bool:
    """Whether the model routes tokens over experts (config.json's expert count, under either spelling)."""
    get = config.get if isinstance(config, dict) else lambda k: getattr(config, k, None)
    return bool(get("num_experts") or get("num_local_experts"))


def meta_causal_lm(model_dir: str | Path) -> nn.Module:
    """The model folder's architecture on the meta device: its modules, no weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def lora_linear_paths(target_modules, model_dir: str | Path) -> list[str]:
    """`policy.lora.target_modules` as the FSDP2 backend resolves them for the model folder (its architecture on the
    meta device): the adapted paths under a decoder layer. ValueError naming the key for a name matching none."""
    import json

    from megatron_rl.models.lora_targets import select_hf_linears

    hf = json.loads((Path(model_dir) / "config.json").read_text())
    return select_hf_linears(target_modules, linear_paths(decoder_layers(meta_causal_lm(model_dir))), is_moe(hf))
