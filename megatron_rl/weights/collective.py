"""Collective refit transport (disaggregated engines): each pipeline stage broadcasts its own weights to every engine.

One process group per pipeline stage: rank 0 is the stage's exporting rank (TP rank 0 of DP replica 0), ranks 1..
are the engines' workers. The group is built straight from a TCP store and torch's process-group class for the
platform's backend (NCCL on GPU, gloo on CPU: the same code), so it touches neither torch.distributed's default group
(Megatron's) nor vLLM's own. A refit goes in two phases, each a bucket at a time on both ends: a disaggregated
engine runs at high memory utilisation and the exporter's device still holds the training state, so neither end
may hold a second copy of the stage's weights:

1. `send(buckets, version)` on each exporter: the manifest (the `RefitHandle`: every bucket's layout), which the
   driver checks against the engine's model, merges and hands to the engines; each bucket is dropped once described;
2. `broadcast(buckets)` on the exporters, over the same buckets exported again (deterministic: the same layout, which
   is checked), while the engines `receive(handle)`: each bucket goes through one flat device buffer of the sender's
   (the largest bucket's size) and lands in a buffer of the engine's that lives until the engine has loaded it, so
   each end holds one bucket or two beyond the model. The price: the stage's export runs twice (a second gather)
   instead of a stage-sized copy. The manifest was checked before any byte moves; a failure in the middle of the
   stream leaves the engine's weights undefined (raised, as for any transport once loading has begun).
   Stages send concurrently on their own groups; nothing of the model is gathered on one rank.

An engine that refuses an update after the manifest check still drains the broadcast (`receive` then discard), so the
exporters never wait on a receiver that will not come; so does a receive abandoned part-way.
"""
from __future__ import annotations

import datetime
from collections.abc import Iterator

import torch
import torch.distributed as dist

from megatron_rl.platform import get_platform
from megatron_rl.weights.fingerprint import fingerprint_bucket
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
        self._handle: RefitHandle | None = None

    def send(self, buckets, version: int) -> RefitHandle:
        """Phase 1: the manifest of the stage's buckets (layouts and fingerprints: nothing is kept)."""
        handle = RefitHandle(TRANSPORT, int(version))
        for bucket in buckets:
            specs, size = bucket_layout(bucket)
            handle.buckets.append(BucketSpec(specs, size, str(self.stage_index), fingerprint_bucket(bucket)))
        self._handle = handle
        return handle

    def broadcast(self, buckets) -> int:
        """Phase 2: send `buckets` (the same export as `send`'s, again), one at a time through one reused flat
        buffer, in manifest order. Returns the bytes sent."""
        if self._handle is None:
            raise RuntimeError("collective broadcast before send()")
        want = self._handle.buckets
        flat = torch.empty(max((b.nbytes for b in want), default=1), dtype=torch.uint8, device=self.device)
        sent, i = 0, 0
        for i, bucket in enumerate(buckets, 1):
            specs, size = bucket_layout(bucket)
            if i > len(want) or specs != want[i - 1].tensors:
                raise RuntimeError(f"refit v{self._handle.version}, stage {self.stage_index}: bucket {i} of the "
                                   "second export differs from the manifest's (the export is not deterministic)")
            view = flat[:size]
            for spec, (_, t) in zip(specs, bucket):
                view[spec.offset:spec.offset + spec.nbytes].copy_(as_bytes(t.to(self.device)))
            # NCCL: wait() orders the device stream after the broadcast, so the next copy cannot overwrite it early
            _broadcast(self.group, view)
            sent += size
        if i != len(want):
            raise RuntimeError(f"refit v{self._handle.version}, stage {self.stage_index}: the second export gave "
                               f"{i} buckets, the manifest {len(want)}")
        get_platform().synchronize()
        return sent

    def release(self) -> None:
        self._handle = None

    def close(self) -> None:
        self.release()


class CollectiveReceiver:
    """An engine worker's side: a member of every stage's group (`groups[stage]`)."""

    def __init__(self, groups: list, device: torch.device):
        self.groups, self.device = groups, device

    def receive(self, handle: RefitHandle) -> Iterator[Bucket]:
        """The update's buckets, each received when the previous one has been taken (a generator: its buffer is
        freed once the caller has loaded it and dropped the views). Buckets of a stage arrive in the order that stage
        sent them; the stages' groups are independent, so reading stage by stage cannot deadlock. Closed early (the
        load failed), it still receives the rest, so the exporters finish."""
        for i, b in enumerate(handle.buckets):
            flat = torch.empty(b.nbytes, dtype=torch.uint8, device=self.device)
            _broadcast(self.groups[int(b.location)], flat)
            views, flat = typed_views(flat, b.tensors), None  # only the caller's views keep the buffer alive
            try:
                yield views
            except GeneratorExit:  # abandoned: the exporters still send the rest
                del views
                for rest in handle.buckets[i + 1:]:
                    _broadcast(self.groups[int(rest.location)],
                               torch.empty(rest.nbytes, dtype=torch.uint8, device=self.device))
                raise
            del views

    def drain(self, handle: RefitHandle) -> None:
        for _ in self.receive(handle):
            pass
