"""The weights of an FSDP2 checkpoint (`policy.backend: fsdp2`) as HF tensors, for `megatron-rl convert
megatron-to-hf` (weights/convert.py), which writes them out as it writes a megatron checkpoint's.

That backend trains transformers' own model, so its checkpoint (torch.distributed.checkpoint, `dist/`) already holds
the HF names under `FSDP2_PREFIX`. One process reads every tensor in full, whatever the DP size that wrote it (DCP
reassembles shards without a process group), into a model transformers builds from the checkpoint's config (on the
meta device, then filled: no random initialisation); `disk_state_dict` then gives the on-disk names (MoE experts
split, a tied lm_head dropped). The Adam state is not read.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from megatron_rl.models.checkpoint import DIST_DIR, FSDP2_PREFIX, CheckpointError
from megatron_rl.models.hf_io import disk_state_dict


def fsdp2_hf_state(ckpt: Path, hf_config: dict) -> dict[str, torch.Tensor]:
    """{HF on-disk name: full fp32 tensor} of an FSDP2 checkpoint's model."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(hf_config)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.to_empty(device="cpu")  # every persistent tensor is filled below; non-persistent buffers are not exported
    stored = set(FileSystemReader(str(ckpt / DIST_DIR)).read_metadata().state_dict_metadata)
    want = {FSDP2_PREFIX + k: v for k, v in model.state_dict().items()}
    # a tied lm_head is the embedding itself (one tensor, possibly stored under one name only)
    tied = {FSDP2_PREFIX + "lm_head.weight"} if getattr(config, "tie_word_embeddings", False) else set()
    missing = [k for k in want if f"model.{k}" not in stored and k not in tied]
    if missing:
        raise CheckpointError(f"{ckpt / DIST_DIR}: no tensor for {', '.join(missing[:4])}"
                              f"{' ...' if len(missing) > 4 else ''} (the checkpoint's config is {config.model_type})")
    dcp.load({"model": {k: v for k, v in want.items() if f"model.{k}" in stored}}, checkpoint_id=str(ckpt / DIST_DIR))
    return disk_state_dict(model)


def fsdp2_export_part(ckpt: Path, hf_config: dict, tmp: str, out_dtype: torch.dtype, max_shard_bytes: int) -> dict:
    """Write the checkpoint's weights as safetensors parts into `tmp`: the result record of one exporting rank, in
    the megatron path's shape (weights/convert.py finishes the folder from it)."""
    from megatron_rl.models.hf_io import write_safetensors_parts

    t0 = time.perf_counter()
    state = fsdp2_hf_state(ckpt, hf_config)
    t1 = time.perf_counter()
    parts = write_safetensors_parts(((k, v.to(out_dtype)) for k, v in state.items()), Path(tmp), "part-pp0000",
                                    max_shard_bytes)
    return {"rank": 0, "pp_rank": 0, "parts": parts, "load_s": t1 - t0, "write_s": time.perf_counter() - t1}
