"""The lifecycle calls every driver-side group of rank actors forwards the same way (the policy's `PolicyGroup`, the
distillation teacher's `TeacherGroup`): each goes to every rank, and the ranks must agree on their state."""
from __future__ import annotations

from megatron_rl.distributed.worker_group import WorkerGroup


class LifecycleCalls:
    group: WorkerGroup
    role = "worker"  # names the ranks in errors ("policy", "teacher")

    def __init__(self, group: WorkerGroup):
        self.group = group
        self.info = group.call("setup")

    def offload(self) -> list[dict]:
        """Every rank's state to host memory (colocated handover); returns each rank's memory report."""
        return self.group.call("offload")

    def onload(self) -> list[dict]:
        return self.group.call("onload")

    def memory_report(self) -> list[dict]:
        return self.group.call("memory_report")

    def state(self) -> str:
        """The ranks' common lifecycle state; ranks that disagree mean a handover half-happened."""
        states = {r["state"] for r in self.memory_report()}
        if len(states) != 1:
            raise RuntimeError(f"{self.role} ranks disagree on their lifecycle state: {sorted(states)}")
        return states.pop()

    def set_threads(self, n: int) -> None:
        self.group.call("set_threads", n)
