"""CUDA IPC refit transport (GPU, colocated): each bucket one flat device buffer shared through an IPC handle.

Written against torch 2.x's `torch.multiprocessing.reductions`; not runnable on the CPU machines (see README, "What
has and has not run on a GPU"; `bench/gpu_check.py` exercises it between two processes on a GPU).
"""
from __future__ import annotations

import pickle
from collections.abc import Iterable

import torch

from megatron_rl.platform import get_platform
from megatron_rl.weights.fingerprint import fingerprint_flat
from megatron_rl.weights.manifest import (Bucket, BucketSpec, RefitError, RefitHandle, as_bytes, bucket_layout,
                                          typed_views)

class CudaIpcSender:
    """Packs each bucket into one flat CUDA buffer and exports an IPC handle for it.

    The buffers must outlive the receiver's use: keep them until `receive_weights` returned, then `release()` (which
    also lets the CUDA driver reclaim the exported memory via `torch.cuda.ipc_collect`).
    """

    def __init__(self):
        self._keepalive: list[torch.Tensor] = []

    def send(self, buckets: Iterable[Bucket], version: int) -> RefitHandle:
        from torch.multiprocessing.reductions import reduce_tensor

        device = torch.cuda.current_device()
        uuid_ = get_platform().device_identity(torch.device("cuda", device))
        handle = RefitHandle("cuda_ipc", int(version), device=uuid_)
        for bucket in buckets:
            specs, size = bucket_layout(bucket)
            flat = torch.empty(size, dtype=torch.uint8, device=device)
            for spec, (_, t) in zip(specs, bucket):
                flat[spec.offset:spec.offset + spec.nbytes].copy_(as_bytes(t.to(device, non_blocking=True)))
            self._keepalive.append(flat)
            _rebuild, args = reduce_tensor(flat)
            # pickled here so the handle stays plain bytes for msgpack-based RPC (vLLM multiprocess executors)
            # GPU only (no CPU test can open a CUDA IPC buffer): the fingerprints gather from `flat` on its own
            # stream, after the copies above, and `.cpu()` waits for them. The same `fingerprint_flat` on the same
            # bucket layout runs on CPU in the shared-memory sender (test_generation, test_refit_fingerprint).
            handle.buckets.append(BucketSpec(specs, size, pickle.dumps({uuid_: args}), fingerprint_flat(flat, specs)))
        torch.cuda.synchronize(device)  # the receiver reads on another stream/process: data must be complete
        return handle

    def release(self) -> None:
        self._keepalive.clear()
        torch.cuda.ipc_collect()

    def close(self) -> None:
        self.release()


def map_cuda_ipc(handle: RefitHandle, device: torch.device) -> list[Bucket]:
    """Open the sender's buffers in this (engine worker) process; checks each buffer's size against the manifest."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    my_uuid = get_platform().device_identity(device)
    out = []
    for k, b in enumerate(handle.buckets):
        per_gpu = pickle.loads(b.location)
        if my_uuid not in per_gpu:
            raise RefitError(f"refit v{handle.version}: bucket {k} was exported from GPU(s) {list(per_gpu)}, "
                             f"not from this worker's GPU {my_uuid} (colocated CUDA IPC needs the same device)")
        args = list(per_gpu[my_uuid])
        args[6] = device.index  # reduce_tensor's device slot: the receiver's ordinal for the same physical GPU
        flat = rebuild_cuda_tensor(*args)
        if flat.numel() != b.nbytes:
            raise RefitError(f"refit v{handle.version}: bucket {k} has {flat.numel()} bytes, manifest {b.nbytes}")
        out.append(typed_views(flat, b.tensors))
    return out
