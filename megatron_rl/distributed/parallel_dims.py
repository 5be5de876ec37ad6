"""Named parallel dimensions: the one place that maps a global rank to its (tp, dp, pp) coordinates.

The order matches megatron-core's default `initialize_model_parallel(order="tp-cp-ep-dp-pp")`: TP varies fastest,
then DP, then PP, so TP groups are contiguous ranks (one node) and PP stages are the slowest-varying dimension.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    tp: int = 1
    pp: int = 1
    dp: int = 1

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None) -> "ParallelDims":
        if world_size % (tp * pp):
            raise ValueError(f"tp*pp={tp * pp} does not divide world size {world_size}")
        dims = cls(tp=tp, pp=pp, dp=dp if dp is not None else world_size // (tp * pp))
        if dims.world_size != world_size:
            raise ValueError(f"tp*pp*dp={dims.world_size} != world size {world_size}")
        return dims

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        return {"tp": rank % self.tp, "dp": (rank // self.tp) % self.dp, "pp": rank // (self.tp * self.dp)}

    def rank(self, tp: int = 0, dp: int = 0, pp: int = 0) -> int:
        return tp + self.tp * (dp + self.dp * pp)

    def ranks_where(self, **fixed: int) -> list[int]:
        """Global ranks whose coordinates match `fixed`, e.g. ranks_where(tp=0, pp=0) = one rank per DP replica."""
        return [r for r in range(self.world_size) if all(self.coords(r)[k] == v for k, v in fixed.items())]

    def describe(self, rank: int) -> str:
        c = self.coords(rank)
        return f"rank {rank} (tp={c['tp']}, dp={c['dp']}, pp={c['pp']})"
