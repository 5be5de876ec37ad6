"""The weights of an FSDP2 checkpoint (`policy.backend: fsdp2`) as HF tensors, for `megatron-rl convert
megatron-to-hf` (weights/convert.py), which writes them out as it writes a megatron checkpoint's.

That backend trains transformers' own model, so its checkpoint (torch.distributed.checkpoint, `dist/`) already holds
the HF names under `FSDP2_PREFIX`. One process reads every tensor in full, whatever the DP size that wrote it (DCP
reassembles shards without a process group), into a model transformers builds from the checkpoint's config (on the
meta device, then filled: no random initialisation); `disk_state_dict` then gives the on-disk names (MoE experts
split, a tied lm_head dropped). The Adam state is not read.

A LoRA checkpoint (metadata `adapters`, policy/fsdp2_lora.py) holds the adapters only, as `<module path>.lora.A` /
`.lora.B`: the base comes from its HF folder (`adapters["base"]`) and each adapted weight is exported merged,
W + (alpha / r) B A, or, with --peft, the adapters in PEFT's names.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from megatron_rl.models.checkpoint import DIST_DIR, FSDP2_PREFIX, CheckpointError
from megatron_rl.models.hf_io import disk_state_dict


ADAPTER_KEY = ".lora."  # policy/fsdp2_lora.py's parameter names (not imported: this tool needs no worker code)


def fsdp2_adapters(ckpt: Path) -> dict[str, dict[str, torch.Tensor]]:
    """{adapted module path (`model.layers.0.self_attn.q_proj`): {"A": [r, in], "B": [out, r]}} of a LoRA checkpoint,
    full fp32 tensors whatever sharding wrote them."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(ckpt / DIST_DIR)).read_metadata().state_dict_metadata
    head = "model." + FSDP2_PREFIX
    keys = [k for k in meta if k.startswith(head) and ADAPTER_KEY in k]
    if not keys:
        raise CheckpointError(f"{ckpt / DIST_DIR}: a LoRA checkpoint (metadata.json's adapters) with no adapter tensor")
    state = {k[len("model."):]: torch.zeros(tuple(meta[k].size), dtype=torch.float32) for k in keys}
    dcp.load({"model": state}, checkpoint_id=str(ckpt / DIST_DIR))
    out: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in state.items():
        path, matrix = k[len(FSDP2_PREFIX):].rsplit(ADAPTER_KEY, 1)
        out.setdefault(path, {})[matrix] = v
    return out


def _merged_base(adapters: dict, lora: dict) -> dict[str, torch.Tensor]:
    """lora: metadata.json's `adapters` ({"lora": policy.lora, "base": its HF folder}). The base HF model with every adapted weight replaced by W + (alpha / r) B A (fp32), in on-disk names."""
    import json

    from megatron_rl.models.vlm import auto_model_class

    config = json.loads((Path(lora["base"]) / "config.json").read_text())
    model = auto_model_class(config).from_pretrained(lora["base"], dtype=torch.float32)
    scale = float(lora["lora"]["alpha"]) / int(lora["lora"]["rank"])
    with torch.no_grad():
        for path, ab in adapters.items():
            w = model.get_submodule(path).weight
            w.add_(scale * (ab["B"] @ ab["A"]))
    return disk_state_dict(model)


def fsdp2_hf_state(ckpt: Path, hf_config: dict, lora: dict | None = None,
                   value_head: bool = False) -> dict[str, torch.Tensor]:
    """{HF on-disk name: full fp32 tensor} of an FSDP2 checkpoint's model (a LoRA one's, `lora` its metadata
    `adapters`, merged onto its base; a value model's as transformers' ...ForSequenceClassification)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoConfig, AutoModelForSequenceClassification

    from megatron_rl.models.value_head import HF_SCORE, value_model_hf_config
    from megatron_rl.models.vlm import auto_model_class

    if lora is not None:
        return _merged_base(fsdp2_adapters(ckpt), lora)

    cfg = value_model_hf_config(hf_config) if value_head else dict(hf_config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        auto = AutoModelForSequenceClassification if value_head else auto_model_class(hf_config)
        model = auto.from_config(config, dtype=torch.float32)
    model.to_empty(device="cpu")  # every persistent tensor is filled below; non-persistent buffers are not exported
    stored = set(FileSystemReader(str(ckpt / DIST_DIR)).read_metadata().state_dict_metadata)
    # the worker's names: the HF model under FSDP2_PREFIX, a value model's head beside it (fsdp2_scorer.Scorer)
    want = {(k if k == HF_SCORE else FSDP2_PREFIX + k): v for k, v in model.state_dict().items()}
    # a tied lm_head is the embedding itself (one tensor, possibly stored under one name only)
    tied = {FSDP2_PREFIX + "lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [k for k in want if f"model.{k}" not in stored and k not in tied]
    if missing:
        raise CheckpointError(f"{ckpt / DIST_DIR}: no tensor for {', '.join(missing[:4])}"
                              f"{' ...' if len(missing) > 4 else ''} (the checkpoint's config is {config.model_type})")
    dcp.load({"model": {k: v for k, v in want.items() if f"model.{k}" in stored}}, checkpoint_id=str(ckpt / DIST_DIR))
    return disk_state_dict(model)


def fsdp2_export_part(ckpt: Path, hf_config: dict, tmp: str, out_dtype: torch.dtype, max_shard_bytes: int,
                      lora: dict | None = None, peft: bool = False, value_head: bool = False) -> dict:
    """Write the checkpoint's weights as safetensors parts into `tmp`: the result record of one exporting rank, in
    the megatron path's shape (weights/convert.py finishes the folder from it). peft: the record carries the
    adapters in PEFT's names and their module names instead."""
    from megatron_rl.models.hf_io import write_safetensors_parts
    from megatron_rl.models.lora_targets import peft_hf_name

    t0 = time.perf_counter()
    if peft:
        adapters = fsdp2_adapters(ckpt)
        return {"rank": 0, "pp_rank": 0, "parts": [], "load_s": time.perf_counter() - t0, "write_s": 0.0,
                "adapters": {peft_hf_name(p, m): t for p, ab in adapters.items() for m, t in ab.items()},
                "target_names": sorted({p.rsplit(".", 1)[-1] for p in adapters})}
    state = fsdp2_hf_state(ckpt, hf_config, lora, value_head)
    t1 = time.perf_counter()
    parts = write_safetensors_parts(((k, v.to(out_dtype)) for k, v in state.items()), Path(tmp), "part-pp0000",
                                    max_shard_bytes)
    return {"rank": 0, "pp_rank": 0, "parts": parts, "load_s": t1 - t0, "write_s": time.perf_counter() - t1}
