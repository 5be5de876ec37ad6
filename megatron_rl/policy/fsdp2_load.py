"""The FSDP2 worker's start-up without a full model on any device: the model is built on the `meta` device (no
memory), split (TP) and sharded (`fully_shard`) there, then each rank allocates its own shards (`to_empty`) and
fills them one tensor at a time.

Only global rank 0 reads the checkpoint, on the host, in the dtype the files store (a bf16 checkpoint: 2 bytes a
parameter, not fp32's 4), with transformers' own `from_pretrained`, so every name conversion it does (an MoE layer's
per-expert tensors fused into one, renamed keys, tied weights) stays transformers'. Each tensor then goes to the
device, is broadcast in that dtype, and every rank keeps its slice of it, cast to the fp32 master dtype: the values
are those of `from_pretrained(dtype=float32)`, since an upcast is exact. The device holds at most one full tensor
beyond the shards; the other ranks never hold the full model, not even on the host.

Buffers (rotary `inv_freq`, which are not in the checkpoint and have no values on `meta`) come from rank 0's loaded
model too, as from_pretrained computed them. The LoRA adapters have no checkpoint: their initial values are computed
on every rank (`fsdp2_lora.initial_values`).
"""
from __future__ import annotations

import json
import struct
from itertools import chain
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def stored_dtype(model_dir) -> torch.dtype:
    """The one floating dtype of the checkpoint's safetensors files; fp32 when they mix dtypes or there are none
    (`config.json`'s dtype is not used: a file saved in fp32 under a bf16 config would be rounded)."""
    seen = set()
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        seen |= {v["dtype"] for k, v in header.items() if k != "__metadata__" and v["dtype"] in _SAFETENSORS_DTYPES}
    return _SAFETENSORS_DTYPES[seen.pop()] if len(seen) == 1 else torch.float32


def auto_class(model_dir):
    """transformers' class for the folder (models/vlm.py: a causal LM, or a vision-language model's)."""
    from megatron_rl.models.vlm import auto_model_class

    return auto_model_class(json.loads((Path(model_dir) / "config.json").read_text()))


def skeleton(model_dir, **kw) -> nn.Module:
    """The model with every parameter and buffer on `meta`, fp32 (the master dtype) in its metadata."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        return auto_class(model_dir).from_config(config, dtype=torch.float32, **kw)


def _host_copy(model_dir, **kw) -> dict[str, torch.Tensor]:
    with torch.random.fork_rng(devices=[]):  # rank 0 alone loads: every rank's generator stays where it was
        lm = auto_class(model_dir).from_pretrained(model_dir, dtype=stored_dtype(model_dir), **kw)
    return dict(chain(lm.named_parameters(), lm.named_buffers()))


@torch.no_grad()
def load_shards(model: nn.Module, prefix: str, model_dir, device, computed: dict[str, torch.Tensor] | None = None,
                **kw) -> None:
    """Materialise the sharded meta `model` on `device` and fill every parameter and buffer: from rank 0's checkpoint
    (names minus `prefix` are the HF names), or from `computed` (full tensors every rank already has). Collective
    over all ranks."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    computed = computed or {}
    model.to_empty(device=device)
    root = dist.get_rank() == 0
    source = _host_copy(model_dir, **kw) if root else {}
    box = [{n: t.dtype for n, t in source.items()}]  # the shapes every rank knows; the dtypes only rank 0
    dist.broadcast_object_list(box, src=0)
    dtypes = box[0]
    for name, t in chain(model.named_parameters(), model.named_buffers()):
        key = name[len(prefix):] if name.startswith(prefix) else name
        if key in computed:
            full = computed[key].to(device)
        elif key in dtypes:
            full = source.pop(key).to(device) if root else torch.empty(t.shape, dtype=dtypes[key], device=device)
            dist.broadcast(full, src=0)
        else:
            raise KeyError(f"{model_dir}: transformers' loaded model has no {key!r} for the sharded model")
        if isinstance(t, DTensor):  # this rank's slice, cut locally (every rank has the full tensor)
            t.to_local().copy_(distribute_tensor(full, t.device_mesh, t.placements, src_data_rank=None).to_local())
        else:
            t.copy_(full)
        del full
