"""A PEFT adapter folder: `adapter_config.json` + `adapter_model.safetensors`, which `peft.PeftModel.from_pretrained`
loads onto the base model. The tensors carry PEFT's saved names (`base_model.model.model.layers.{i}.self_attn.
q_proj.lora_A.weight`, models/lora_targets.peft_name) at full HF shape: A [r, in], B [out, r].

The config lists the resolved projections rather than `all-linear`: on an MoE model all-linear means the attention
projections here (models/lora_targets.py), which PEFT's own expansion need not agree with.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def peft_config(lora_cfg, target_names: list[str], base_model: str) -> dict:
    """adapter_config.json's content for a `policy.lora` section (the fields PEFT's LoraConfig reads)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": int(lora_cfg.rank), "lora_alpha": float(lora_cfg.alpha), "lora_dropout": float(lora_cfg.dropout),
            "target_modules": sorted(target_names), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": False, "inference_mode": True, "modules_to_save": None}


def write_peft_folder(out_dir, state: dict[str, torch.Tensor], lora_cfg, target_names: list[str],
                      base_model: str) -> Path:
    return write_peft_files(out_dir, state, peft_config(lora_cfg, target_names, base_model))


def write_peft_files(out_dir, state: dict[str, torch.Tensor], config: dict) -> Path:
    """The folder from the tensors and adapter_config.json's content (`peft_config`): what an engine serving the
    adapters by request loads (generation/lora_serving.py)."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in sorted(state.items())}, str(out / ADAPTER_WEIGHTS),
              metadata={"format": "pt"})
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out
