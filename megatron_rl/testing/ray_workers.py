"""Small RankWorker subclasses for the Ray layer's tests (importable by Ray worker processes)."""
from __future__ import annotations

import os
import time

from megatron_rl.distributed.worker_group import RankWorker


class AllReduceWorker(RankWorker):
    def init_dist(self) -> str:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"

    def all_reduce(self, value: float) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([value])
        dist.all_reduce(t)  # a CPU tensor is right: init_dist made this group gloo
        return float(t)

    def env(self) -> dict:
        return {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}

    def slow_collective(self, seconds: float) -> float:
        """Rank 0 prints and sleeps, then every rank enters an all-reduce (a dead peer leaves the others blocked)."""
        print(f"rank {self.rank} entering slow_collective", flush=True)
        time.sleep(seconds)
        return self.all_reduce(1.0)

    def fail(self) -> None:
        raise ValueError(f"deliberate failure on rank {self.rank}")
