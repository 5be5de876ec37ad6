"""Skip megatron's gradient reduce-scatter and parameter all-gather where they are identities: a group of one rank
whose input and output are the same memory.

With the distributed optimizer at data-parallel size 1 (the CPU demo: one policy rank), megatron-core 0.16 still
runs both collectives on the whole model every step, each rank's shard being the whole buffer. gloo implements
them with copies: the fp32 gradient buffer is cloned and copied back (two copies of 4 bytes x parameters), and the
bf16/fp32 parameter buffer goes through gloo's own memcpy and one more copy. For SmolLM2-135M that is three
whole-model copies of ~0.2 s each on 2 cores, plus a fresh half-gigabyte allocation per step. Over one rank a
reduction (any op) and a gather leave the buffer as it is, so skipping them changes no bit. Any other call (more
ranks, separate buffers, asynchronous calls whose handle the caller waits on) goes to the original function.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.numel() == b.numel() and a.dtype == b.dtype


def _skipping(orig):
    def call(output, input, *args, group=None, async_op=False, **kwargs):
        if not async_op and _same_memory(output, input) and dist.get_world_size(group) == 1:
            return None
        return orig(output, input, *args, group=group, async_op=async_op, **kwargs)

    call.skips_identity = True
    return call


def install() -> None:
    """Wrap megatron's module-level collective functions (idempotent). Call after building DistributedDataParallel:
    its constructor may re-point the reduce-scatter function (fp32-accumulation variant), which is wrapped too."""
    from megatron.core.distributed import param_and_grad_buffer as pgb

    for name in ("dist_reduce_scatter_func", "dist_all_gather_func"):
        fn = getattr(pgb, name)
        if not getattr(fn, "skips_identity", False):
            setattr(pgb, name, _skipping(fn))
