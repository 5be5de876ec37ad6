"""Refit transports behind one interface: move the policy's exported weights (HF names, full tensors) into an engine.

A *sender* (`make_sender`) lays each bucket of `(hf_name, tensor)` out as one flat buffer and returns a small,
picklable `manifest.RefitHandle`; the handle travels to the generator by any control channel (a direct call, a Ray
actor call) and the engine's worker opens it (`open_buckets`) as `(name, tensor)` views, then checks after loading
that nothing changed underneath (`verify_after_load`). The bytes never go through the control channel.

Which transport runs is the platform's decision (`get_platform().refit_transport_*`), one module each:
- ``shared_memory`` (CPU, `shared_memory.py`): a persistent /dev/shm arena with seqlock version stamps.
- ``cuda_ipc`` (GPU, colocated, `cuda_ipc.py`): flat CUDA buffers shared through IPC handles.
- ``collective`` (disaggregated, `collective.py`): each pipeline stage broadcasts its buckets to every engine over
  a process group of its own (NCCL on GPU, gloo on CPU: the same code).
CUDA IPC and the NCCL backend are written against torch/vLLM 0.32 APIs but cannot be exercised on the CPU machines.
"""
from __future__ import annotations

import torch

from megatron_rl.platform import get_platform
from megatron_rl.weights.collective import TRANSPORT as COLLECTIVE
from megatron_rl.weights.collective import CollectiveReceiver
from megatron_rl.weights.cuda_ipc import CudaIpcSender, map_cuda_ipc
from megatron_rl.weights.manifest import RefitError, RefitHandle
from megatron_rl.weights.shared_memory import SharedMemorySender, map_shared_memory, verify_shared_memory_unchanged


def open_buckets(handle: RefitHandle, device: torch.device, receiver: CollectiveReceiver | None = None):
    """Receiver entry point: the buckets of `handle` as `(name, tensor)` lists, validated as far as the transport
    allows before the first tensor is handed out (shared memory: all sizes and stamps; CUDA IPC: all sizes;
    collective: none, each bucket is received as the previous one is taken, `collective.CollectiveReceiver`, after the
    driver checked the manifest). An in-band handle made on another device is refused before any
    byte is read (routing.py: the CPU refuses another slot's as a GPU cannot open another GPU's buffers)."""
    if handle.transport in ("shared_memory", "cuda_ipc") and handle.device is not None:
        mine = get_platform().device_identity(device)
        if handle.device != mine:
            raise RefitError(f"refit v{handle.version}: update exported on device {handle.device} was handed to an "
                             f"engine worker on device {mine} (colocated refits stay on one device)")
    if handle.transport == "shared_memory":
        return map_shared_memory(handle)
    if handle.transport == "cuda_ipc":
        return map_cuda_ipc(handle, device)
    if handle.transport == COLLECTIVE:
        if receiver is None:
            raise RefitError("collective refit requested but this engine has not joined the refit groups "
                             "(join_refit_groups)")
        return receiver.receive(handle)
    raise RefitError(f"unknown refit transport {handle.transport!r}")


def make_sender(transport: str) -> SharedMemorySender | CudaIpcSender:
    """Sender for the in-band transports. Keep it for the process's life: `send(buckets, version)` per update,
    `release()` once the receiver has loaded it, `close()` at the end. The collective transport needs its group:
    `collective.CollectiveSender`."""
    if transport == "shared_memory":
        return SharedMemorySender()
    if transport == "cuda_ipc":
        return CudaIpcSender()
    raise ValueError(f"transport {transport!r} cannot be used in-band; collective refits go through "
                     "collective.CollectiveSender")


def verify_after_load(handle: RefitHandle) -> None:
    """Receiver, after loading: raise `RefitError` if the bytes changed while they were read (shared memory);
    the other transports hand over buffers nobody rewrites during a load."""
    if handle.transport == "shared_memory":
        verify_shared_memory_unchanged(handle)
