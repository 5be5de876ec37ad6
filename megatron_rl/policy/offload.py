"""Move a trainer's device state out to host memory and back (the colocated handover), on GPU and CPU alike.

What moves: the model's parameters (views into megatron DDP's contiguous parameter buffer with the distributed
optimizer; separate tensors without it, where DDP keeps only a gradient buffer), DDP's gradient buffers, the
optimizer's own parameters where they are separate tensors (fp32 main weights under bf16, distributed-optimizer
shards) and every optimizer state tensor (Adam moments). Each distinct storage is copied to a host buffer and then
*released* (`untyped_storage().resize_(0)`): every tensor and view that uses it keeps its identity, shape and
strides, so megatron's views, the optimizer's param groups and DDP's bucket pointers stay valid, and `restore`
re-allocates the same storage objects and copies the bytes back. Gradient buffers are not copied, only released and
zeroed on the way back: a train step zeroes them first anyway.

Why our own and not megatron's `offload_to_cpu`/`restore_from_cpu` (0.16): its optimizer path replaces `p.data` of
the optimizer's params with new CPU tensors, which for an fp32 optimizer are the model's parameters themselves,
cutting them loose from DDP's buffers (updates would stop reaching the model); its buffer path pins memory, which a
CPU-only torch cannot do, and on CPU its "host copy" would alias the storage it then frees. This module runs the
same steps on both platforms; only the host buffer's kind (pinned or not) and the synchronisation come from the
platform. On CPU the released storage is observable: a forward, a save or an export that touches offloaded state
reads a zero-size storage and fails, which is how CPU tests catch a handover in the wrong order.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.platform import get_platform


@dataclass
class _Moved:
    owner: torch.Tensor  # any tensor on the storage (keeps the storage object alive and reachable)
    nbytes: int
    host: torch.Tensor | None  # uint8 host copy; None: contents not kept (gradient buffers)


def _byte_view(owner: torch.Tensor, nbytes: int) -> torch.Tensor:
    """The whole storage of `owner` as a flat uint8 tensor (views may cover only part of it)."""
    flat = torch.empty(0, dtype=torch.uint8, device=owner.device)
    return flat.set_(owner.untyped_storage(), 0, (nbytes,), (1,))


class DeviceStateOffloader:
    """Offload/restore the storages of a set of tensors; the set is re-collected at each offload (optimizer state
    appears after the first step). Host buffers are kept between handovers and reused when the sizes match.

    The pool is keyed by size alone: a host buffer only holds bytes between an offload and its restore, so any
    buffer of the right size serves any storage. Keying by the tensor's identity never hit for callers that pass
    fresh views each time (FSDP2's `DTensor.to_local()` returns a new object at every call), and pinned host memory
    was allocated anew at every handover."""

    def __init__(self):
        self._moved: list[_Moved] = []
        self._host_pool: dict[int, list[torch.Tensor]] = {}  # nbytes -> host buffers of that size

    @property
    def offloaded(self) -> bool:
        return bool(self._moved)

    def offload(self, keep: list[torch.Tensor], drop: list[torch.Tensor]) -> int:
        """Release the storages of `keep` (contents copied to host) and `drop` (contents discarded). Storages shared
        between tensors are handled once. Returns the bytes released."""
        if self._moved:
            raise RuntimeError("offload() called twice without restore()")
        plat = get_platform()
        seen: set[int] = set()
        moved: list[_Moved] = []
        free = {n: list(bufs) for n, bufs in self._host_pool.items()}  # last handover's buffers, not yet reused
        pool: dict[int, list[torch.Tensor]] = {}
        for tensors, keep_contents in ((keep, True), (drop, False)):
            for t in tensors:
                st = t.untyped_storage()
                nbytes = st.nbytes()
                if nbytes == 0 or st.data_ptr() in seen:
                    continue
                seen.add(st.data_ptr())
                host = None
                if keep_contents:
                    host = free[nbytes].pop() if free.get(nbytes) else plat.host_buffer(nbytes)
                    pool.setdefault(nbytes, []).append(host)
                    host.copy_(_byte_view(t, nbytes), non_blocking=True)
                moved.append(_Moved(t, nbytes, host))
        # the copies must have landed before the device memory can be reused by someone else
        plat.synchronize()
        for m in moved:
            m.owner.untyped_storage().resize_(0)
        self._host_pool = pool  # buffers no storage used this time (vanished tensors) are freed
        self._moved = moved
        plat.release_cached_memory()
        return sum(m.nbytes for m in moved)

    def restore(self) -> int:
        """Re-allocate every released storage and copy its contents back (gradient buffers: zeros)."""
        for m in self._moved:
            m.owner.untyped_storage().resize_(m.nbytes)
            view = _byte_view(m.owner, m.nbytes)
            if m.host is None:
                view.zero_()
            else:
                view.copy_(m.host, non_blocking=True)
        get_platform().synchronize()
        n = sum(m.nbytes for m in self._moved)
        self._moved = []
        return n

    def host_bytes(self) -> int:
        return sum(h.numel() for bufs in self._host_pool.values() for h in bufs)


def resident_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes currently allocated in the distinct storages of `tensors` (0 for released ones)."""
    seen: set[int] = set()
    total = 0
    for t in tensors:
        st = t.untyped_storage()
        if st.nbytes() == 0 or st.data_ptr() in seen:
            continue
        seen.add(st.data_ptr())
        total += st.nbytes()
    return total
