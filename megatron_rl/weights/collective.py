"""Collective refit transport (disaggregated engines): each pipeline stage broadcasts its own weights to every engine.

One process group per pipeline stage: rank 0 is the stage's exporting rank (TP rank 0 of DP replica 0), ranks 1..
are the engines' workers. The group is built straight from a TCP store and torch's process-group class for the
platform's backend (NCCL on GPU, gloo on CPU: the same code), so it touches neither torch.distributed's default group
(Megatron's) nor vLLM's own. A refit goes in two phases:

1. `stage(buckets, version)` on each exporter: the stage's buckets are laid out in flat buffers on its device and
   described in a manifest (the `RefitHandle`), which the driver merges and hands to the engines;
2. `broadcast()` on the exporters while the engines `receive(handle)`: every bucket lands in a buffer of the engine's
   before any weight is loaded, so an update is all or nothing, as with the in-band transports. Stages send
   concurrently on their own groups; nothing of the model is gathered on one rank.

An engine that refuses an update after the manifest check still drains the broadcast (`receive` then discard), so the
exporters never wait on a receiver that will not come.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from megatron_rl.platform import get_platform
from megatron_rl.weights.manifest import Bucket, BucketSpec, RefitHandle, as_bytes, bucket_layout, typed_views

TRANSPORT = "collective"
_TIMEOUT = datetime.timedelta(seconds=600)


def open_group(host: str, port: int, rank: int, world_size: int):
    """Join the refit group of one stage (blocks until every member has joined; rank 0 hosts the store)."""
    store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=_TIMEOUT)
    if get_platform().dist_backend == "nccl":
        # GPU only (no CPU test can reach it: NCCL needs CUDA devices); the gloo branch below is the same protocol
        return dist.ProcessGroupNCCL(store, rank, world_size)
    return dist.ProcessGroupGloo(store, rank, world_size, _TIMEOUT)


def _broadcast(group, flat: torch.Tensor) -> None:
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    group.broadcast([flat], opts).wait()


class CollectiveSender:
    """The exporting rank of pipeline stage `stage`; rank 0 of that stage's refit group."""

    def __init__(self, group, stage: int, device: torch.device):
        self.group, self.stage_index, self.device = group, stage, device
        self._flats: list[torch.Tensor] = []

    def send(self, buckets, version: int) -> RefitHandle:
        """Phase 1: lay the stage's buckets out in flat device buffers (kept until `release`) and describe them."""
        self._flats = []
        handle = RefitHandle(TRANSPORT, int(version))
        for bucket in buckets:
            specs, size = bucket_layout(bucket)
            flat = torch.empty(size, dtype=torch.uint8, device=self.device)
            for spec, (_, t) in zip(specs, bucket):
                flat[spec.offset:spec.offset + spec.nbytes].copy_(as_bytes(t.to(self.device)))
            self._flats.append(flat)
            handle.buckets.append(BucketSpec(specs, size, location=str(self.stage_index)))
        return handle

    def broadcast(self) -> int:
        """Phase 2: send every staged bucket, in manifest order. Returns the bytes sent."""
        for flat in self._flats:
            _broadcast(self.group, flat)
        get_platform().synchronize()
        return sum(f.numel() for f in self._flats)

    def release(self) -> None:
        self._flats = []

    def close(self) -> None:
        self.release()


class CollectiveReceiver:
    """An engine worker's side: a member of every stage's group (`groups[stage]`)."""

    def __init__(self, groups: list, device: torch.device):
        self.groups, self.device = groups, device

    def receive(self, handle: RefitHandle) -> list[Bucket]:
        """Every bucket of the update, in receive buffers of this worker's, before anything is loaded. Buckets of a
        stage arrive in the order that stage sent them; the stages' groups are independent, so reading stage by stage
        cannot deadlock."""
        out = []
        for b in handle.buckets:
            flat = torch.empty(b.nbytes, dtype=torch.uint8, device=self.device)
            _broadcast(self.groups[int(b.location)], flat)
            out.append(typed_views(flat, b.tensors))
        return out
