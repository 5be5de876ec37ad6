"""Checkpoints of the FSDP2 policy (`policy/fsdp2_worker.py`) in megatron-rl's checkpoint directory format.

The same directory as `models/checkpoint.py` writes (so the loop's resume, `latest_checkpoint`, the checksums and
the atomic rename all apply unchanged), with the model and AdamW state in `dist/` written by
torch.distributed.checkpoint (DCP: each rank writes its own shards, any DP size can read them) instead of megatron's
dist_checkpointing. metadata.json says `"backend": "fsdp2"`, so neither backend loads the other's checkpoint by
mistake. `extra_state.pt` (scheduler, step, RNG, the driver's state) is rank 0's, as the megatron worker stores it.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import torch

from megatron_rl.models import hf_io
from megatron_rl.models.checkpoint import (DIST_DIR, EXTRA_STATE, FORMAT, FORMAT_VERSION, HF_DIR, METADATA,
                                           CheckpointError, _bcast, _checksums, _fsync_write, read_metadata,
                                           verify_checkpoint)

BACKEND = "fsdp2"


def _options(adapters: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # a LoRA run's checkpoint holds its adapters (the trainable parameters) only: the base is its HF folder
    return StateDictOptions(ignore_frozen_params=adapters, strict=not adapters)


def _state(model, optimizer, adapters: bool = False):
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model, options=_options(adapters))}
    if optimizer is not None:  # a fresh AdamW gets its (zero) state here, for a load to fill
        state["optim"] = get_optimizer_state_dict(model, optimizer, options=_options(adapters))
    return state


def save_fsdp2_checkpoint(ckpt_dir, model, optimizer, *, step: int, extra_state: dict, hf_dir, dtype: torch.dtype,
                          dp: int, tp: int = 1, adapters: dict | None = None, value_head: bool = False) -> Path:
    """Collective over every rank: write `model`'s and `optimizer`'s shards and rank 0's extras atomically.
    adapters: a LoRA run's {"lora": policy.lora as a dict, "base": the base HF folder}: only the adapters are saved
    (models/checkpoint.py's rule for the megatron backend)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    ckpt_dir = Path(ckpt_dir).absolute()
    rank = dist.get_rank()
    tmp = None
    if rank == 0:
        ckpt_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=ckpt_dir.name + ".tmp-", dir=ckpt_dir.parent))
    tmp = Path(_bcast(str(tmp) if tmp else None))
    try:
        dcp.save(_state(model, optimizer, adapters is not None), checkpoint_id=str(tmp / DIST_DIR))
        config = json.loads((Path(hf_dir) / "config.json").read_text())
        if rank == 0:
            torch.save(extra_state, tmp / EXTRA_STATE)
            (tmp / HF_DIR).mkdir()
            hf_io.copy_tokenizer_files(hf_dir, tmp / HF_DIR)
            (tmp / HF_DIR / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        dist.barrier()
        files = _checksums(tmp)
        if rank == 0:
            meta = {"format": FORMAT, "format_version": FORMAT_VERSION, "backend": BACKEND, "step": int(step),
                    "created": time.time(), "hf_config": config, "tokenizer_path": str(hf_dir), "model_spec": None,
                    "params_dtype": str(dtype).replace("torch.", ""),
                    "layout": {"tp": tp, "pp": 1, "ep": 1, "dp": dp, "world_size": dp * tp},
                    "extra_sharded_keys": ["optim"] if optimizer is not None else [], "adapters": adapters,
                    "value_head": value_head,  # a reward model / critic (models/checkpoint.py's key)
                    "files": files}
            _fsync_write(tmp / METADATA, json.dumps(meta, indent=2) + "\n")
            hf_io.publish_permissions(tmp)
            old = None
            if ckpt_dir.exists():
                old = ckpt_dir.parent / f"{ckpt_dir.name}.old-{os.getpid()}"
                os.replace(ckpt_dir, old)
            os.replace(tmp, ckpt_dir)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        dist.barrier()
    except BaseException:
        if rank == 0 and tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return ckpt_dir


def load_fsdp2_checkpoint(ckpt_dir, model, optimizer, verify: bool = True) -> dict | None:
    """Fill `model` (and `optimizer`, unless None: weights only) from an FSDP2 checkpoint; collective. Returns the
    extra state (None when the checkpoint has none)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    root = Path(ckpt_dir)
    meta = verify_checkpoint(root) if verify else read_metadata(root)
    if meta.get("backend") != BACKEND:
        raise CheckpointError(f"{root} was written by the {meta.get('backend') or 'megatron'} backend; "
                              f"policy.backend={BACKEND} reads only its own checkpoints")
    lora = meta.get("adapters") is not None
    if lora != any(not p.requires_grad for p in model.parameters()):
        raise CheckpointError(f"{root} holds {'LoRA adapters' if lora else 'a full model'}, but this policy "
                              f"{'trains every weight' if lora else 'has policy.lora set'}: set policy.lora as the "
                              "run that wrote it did")
    state = _state(model, optimizer, lora)
    dcp.load(state, checkpoint_id=str(root / DIST_DIR))
    set_model_state_dict(model, state["model"], options=_options(lora))
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optim"], options=_options(lora))
    if not (root / EXTRA_STATE).is_file():
        return None
    try:
        return torch.load(root / EXTRA_STATE, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"{root / EXTRA_STATE} cannot be loaded: {e}") from e
