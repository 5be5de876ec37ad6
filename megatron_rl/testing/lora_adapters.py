"""Random LoRA adapters for an HF model folder, in the form an adapter-only refit carries them
(`WeightsOut.adapter_update`: PEFT-named tensors + adapter_config.json's content), and the merged weights that the
merged refit would send for them. For tests/integration/test_lora_serving.py and bench/refit_bench.py --lora.

B is random here, not zero as at PEFT's start: with B = 0 an adapter is the base model, and serving it proves
nothing.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from megatron_rl.config.schema import LoraConfig
from megatron_rl.models.lora_targets import hf_weight_name, peft_name, resolve_targets
from megatron_rl.models.peft_folder import peft_config

PEFT_PREFIX = "base_model.model."


def _shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    shapes = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                shapes[k] = tuple(sf.get_slice(k).get_shape())
    return shapes


def random_adapters(model_dir, rank: int, alpha: float, target_modules=("all-linear",), seed: int = 0,
                    std: float = 0.1) -> dict:
    """{"tensors": A [r, in] and B [out, r] of every target of every layer, N(0, std^2), "config": PEFT's}."""
    model_dir = Path(model_dir)
    hf = json.loads((model_dir / "config.json").read_text())
    targets = resolve_targets(list(target_modules), hf)
    shapes = _shapes(model_dir)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(hf["num_hidden_layers"]):
        for t in targets:
            out, inp = shapes[hf_weight_name(i, t)]
            tensors[peft_name(i, t, "A")] = torch.randn(rank, inp, generator=g) * std
            tensors[peft_name(i, t, "B")] = torch.randn(out, rank, generator=g) * std
    cfg = LoraConfig(rank=rank, alpha=alpha, target_modules=list(target_modules))
    return {"tensors": tensors, "config": peft_config(cfg, [t.hf for t in targets], str(model_dir))}


def merged_weights(state: dict[str, torch.Tensor], update: dict) -> dict[str, torch.Tensor]:
    """`state` (HF names) with every adapted weight replaced by W + (alpha / r) B A, in fp32 then W's dtype, as
    the trainer's merged export computes it (models/lora.merged_hf_tensors)."""
    scale = update["config"]["lora_alpha"] / update["config"]["r"]
    out = dict(state)
    for name, a in update["tensors"].items():
        if not name.endswith(".lora_A.weight"):
            continue
        b = update["tensors"][name.replace(".lora_A.", ".lora_B.")]
        w_name = name[len(PEFT_PREFIX):].replace(".lora_A.weight", ".weight")
        w = state[w_name]
        out[w_name] = (w.float() + scale * (b.float() @ a.float())).to(w.dtype)
    return out
