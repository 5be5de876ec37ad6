"""Reductions of Python numbers (metrics, counters) across ranks, on the device the process group's backend needs.

NCCL moves only CUDA tensors and gloo CPU tensors, so a collective on a bare `torch.tensor(...)` passes every CPU
test and kills the first multi-GPU run. Every reduction of scalars goes through `all_reduce_scalars`, which asks
`Platform.collective_device` where the tensor goes at call time (tests patch that decision to check it is followed).

Collectives on tensors that already live with the model (TP all-gathers of parameters, vocab-parallel logit
statistics) and object collectives (torch picks their device) stay where they are; tests/unit/test_collectives.py
keeps the list of those and fails on any other raw torch.distributed collective in megatron_rl/ or kernels/.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from megatron_rl.platform import get_platform

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def all_reduce_scalars(values: Sequence[float] | Mapping[str, float], group=None,
                       op: str = "sum") -> list[float] | dict[str, float]:
    """Reduce numbers over `group` (default: the world); returns the same shape (list or dict) of Python floats.

    Every rank of the group must call it with the same length (or the same keys, in the same order). Without an
    initialised process group, or in a group of one, the values come back unchanged (as floats).
    """
    if op not in _OPS:
        raise ValueError(f"op must be one of {sorted(_OPS)}, got {op!r}")
    keys = list(values) if isinstance(values, Mapping) else None
    flat = [float(values[k]) for k in keys] if keys is not None else [float(v) for v in values]
    if flat and dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        device = get_platform().collective_device(dist.get_backend(group))
        # float64: sums over many micro-batches and ranks keep their precision; NCCL and gloo both reduce it
        t = torch.tensor(flat, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=_OPS[op], group=group)
        flat = t.tolist()
    return dict(zip(keys, flat)) if keys is not None else flat
