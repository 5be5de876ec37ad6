"""Colocated refit routed by device: each engine worker loads the update a policy rank wrote on its own device.

An in-band transport's buffers belong to one device: CUDA IPC opens a buffer only on the GPU that holds it, so an
engine worker on GPU 3 needs an update exported by the policy rank on GPU 3, not by rank 0. The default colocated
layout has one engine per device (or per TP group of devices), so every device that hosts an engine worker gets
its own sender: the policy rank placed on the same bundle (`plan_senders`). Each sender exports the whole model
(its pipeline stage's tensors, plus the other stages' received over its pipeline group: `policy/weights_out.py`),
and the driver hands each engine only the handles of its own devices (`RoutedUpdate.only`); a worker takes the one of
its device (`RoutedUpdate.for_device`), and the transport refuses a handle made on another device
(`transport.open_buckets`). The routing code is the same on CPU, where a device is a placement slot
(`platform.device_identity`) and shared memory refuses another slot's update as CUDA IPC would refuse another GPU's.
vLLM's own IPC weight-transfer engine works the same way: every trainer rank exports, handles gathered by device UUID.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from megatron_rl.weights.manifest import RefitError, RefitHandle


@dataclass
class RoutedUpdate:
    """One weight version as per-device in-band handles (device identity -> handle of the rank on that device)."""
    version: int
    by_device: dict[str, RefitHandle] = field(default_factory=dict)

    @property
    def transport(self) -> str:
        return next(iter(self.by_device.values())).transport

    def handles(self) -> list[RefitHandle]:
        return list(self.by_device.values())

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.by_device.values())

    def only(self, devices: list[str], who: str) -> "RoutedUpdate":
        """The part of this update for an engine whose workers run on `devices`; RefitError naming what is missing."""
        missing = [d for d in devices if d not in self.by_device]
        if missing:
            raise RefitError(f"refit v{self.version}: {who} runs on device(s) {missing}, but the update was exported "
                             f"on {sorted(self.by_device)} only (colocated refits stay on one device)")
        return RoutedUpdate(self.version, {d: self.by_device[d] for d in devices})

    def for_device(self, device: str, who: str) -> RefitHandle:
        if device not in self.by_device:
            raise RefitError(f"refit v{self.version}: {who} on device {device} was handed updates exported on "
                             f"{sorted(self.by_device)} only (colocated refits stay on one device)")
        return self.by_device[device]

    def to_dict(self) -> dict:
        return {"routed": True, "version": self.version,
                "by_device": {d: h.to_dict() for d, h in self.by_device.items()}}

    @classmethod
    def from_dict(cls, d) -> "RoutedUpdate":
        if isinstance(d, RoutedUpdate):
            return d
        return cls(int(d["version"]), {dev: RefitHandle.from_dict(h) for dev, h in d["by_device"].items()})


def is_routed(update) -> bool:
    return isinstance(update, RoutedUpdate) or (isinstance(update, dict) and bool(update.get("routed")))


def plan_senders(policy_devices: list[str], engine_devices: list[list[str]], engine_names: list[str]) -> list[int]:
    """The policy ranks that export a colocated refit: for every device an engine worker runs on, the first policy
    rank on that device (ranks sorted ascending). ValueError naming an engine device that no policy rank shares."""
    first_rank: dict[str, int] = {}
    for rank, dev in enumerate(policy_devices):
        first_rank.setdefault(dev, rank)
    senders = set()
    for name, devices in zip(engine_names, engine_devices):
        for dev in devices:
            if dev not in first_rank:
                raise ValueError(f"{name} runs on device {dev}, which no policy rank shares (policy ranks are on "
                                 f"{sorted(first_rank)}); a colocated refit needs a policy rank on every engine "
                                 "device")
            senders.add(first_rank[dev])
    return sorted(senders)
