"""Driver-side `PolicyWorker`: the Megatron ranks as one object, results in batch order.

Every rank gets the whole batch (one object-store put, shared by all actors) and computes the same micro-batch plan;
the output ranks (last pipeline stage, TP rank 0, one per DP replica) return {batch index: tensor}, merged here.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron_rl.policy.group_calls import LifecycleCalls
from megatron_rl.policy.interface import LossFn, RolloutBatch, TrainResult
from megatron_rl.weights.manifest import RefitHandle
from megatron_rl.weights.routing import RoutedUpdate


def _merge(per_rank: list[dict | None], n: int, what: str) -> list:
    out: dict[int, Any] = {}
    for r in per_rank:
        if r:
            out.update(r)
    missing = [i for i in range(n) if i not in out]
    if missing:
        raise RuntimeError(f"policy returned no {what} for sequences {missing[:8]}")
    return [out[i] for i in range(n)]


class PolicyGroup(LifecycleCalls):
    role = "policy"

    def _put(self, batch: RolloutBatch):
        import ray

        return ray.put(batch)

    def logprobs(self, batch: RolloutBatch, temperature: float = 1.0) -> list[torch.Tensor]:
        return _merge(self.group.call("logprobs", self._put(batch), temperature), len(batch), "logprobs")

    def reference_logprobs(self, batch: RolloutBatch, temperature: float = 1.0) -> list[torch.Tensor]:
        res = self.group.call("reference_logprobs", self._put(batch), temperature)
        return _merge(res, len(batch), "reference logprobs")

    def train(self, batch: RolloutBatch, loss_fn: LossFn, temperature: float = 1.0) -> TrainResult:
        outs = [o for o in self.group.call("train", self._put(batch), loss_fn, temperature) if o]
        lps = _merge([o["logprobs"] for o in outs], len(batch), "training logprobs")
        return TrainResult(metrics=outs[0]["metrics"], logprobs=lps, skipped=outs[0]["skipped"])

    def send_weights(self, version: int, transport: str, bucket_bytes: int,
                     senders: list[int] | None = None) -> RefitHandle | RoutedUpdate:
        """In-band with `senders` (colocated, `routing.plan_senders`): one whole-model handle per sender's device.
        Otherwise each pipeline stage exports its tensors, merged here into one update for every engine."""
        results = self.group.call("send_weights", version, transport, bucket_bytes, senders)
        if senders is not None:
            devices = self.device_ids()
            return RoutedUpdate(version, {devices[r]: RefitHandle.from_dict(results[r]) for r in senders})
        handles = [RefitHandle.from_dict(h) for h in results if h]
        devices = {h.device for h in handles}
        if len(devices) > 1:  # in-band buffers on several devices: no one engine worker could open them all
            raise ValueError(f"the stages exported on devices {sorted(devices)}: an in-band refit needs `senders` "
                             "(weights/routing.py)")
        return RefitHandle(handles[0].transport, version, [b for h in handles for b in h.buckets], devices.pop())

    def adapter_update(self) -> dict:
        """The LoRA adapters for an adapter-only refit (`WeightsOut.adapter_update`: rank 0's answer)."""
        return next(u for u in self.group.call("adapter_update") if u is not None)

    def device_ids(self) -> list[str]:
        """Each rank's device identity, in rank order (fixed for the group's life: asked once)."""
        if getattr(self, "_device_ids", None) is None:
            self._device_ids = self.group.call("device_id")
        return self._device_ids

    def refit_endpoints(self, host: str | None) -> list[dict]:
        """One meeting point per pipeline stage for the collective refit groups, in stage order."""
        return sorted((e for e in self.group.call("refit_endpoint", host) if e), key=lambda e: e["stage"])

    def join_refit_group(self, endpoints: list[dict], world_size: int) -> None:
        self.group.call("join_refit_group", endpoints, world_size)

    def broadcast_refit(self) -> None:
        self.group.call("broadcast_refit")

    def save(self, path: str, extra: dict | None = None) -> None:
        self.group.call("save", path, extra)

    def load(self, path: str) -> dict:
        return self.group.call("load", path)[0]

    def release_refit(self) -> None:
        self.group.call("release_refit")

    def offload_train_state(self) -> list[dict]:
        """Gradients and optimizer state to host memory, weights kept (before a colocated refit)."""
        return self.group.call("offload_train_state")

    def shutdown(self) -> None:
        try:
            # Ray kills actors without running their atexit handlers; a rank stuck in a collective with a dead peer
            # does not answer, hence the timeout
            self.group.call("close_refit", timeout=10)
        except Exception:
            pass  # a dead rank's files are swept by `remove_orphaned_files` at the driver's shutdown
        self.group.shutdown()
