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


def generation_bundles(*, policy_world: int, colocated: bool, tp: int, dp: int | None) -> list[list[int]]:
    """Placement-group bundle indices of each rollout engine (`generation.dp` engines x `generation.tp` devices).

    Colocated: the engines share the policy's bundles, engine i on bundles [i*tp, (i+1)*tp); by default as many
    engines as fit. Disaggregated: the engines get bundles after the policy's (policy_world ...); by default one."""
    if colocated:
        dp = policy_world // tp if dp is None else dp
        if dp < 1 or dp * tp > policy_world:
            raise ValueError(f"generation.dp*tp = {dp}*{tp} engine devices do not fit the {policy_world} devices "
                             "the colocated policy holds")
        first = 0
    else:
        dp = 1 if dp is None else dp
        if dp < 1:
            raise ValueError(f"generation.dp must be >= 1, got {dp}")
        first = policy_world
    return [list(range(first + i * tp, first + (i + 1) * tp)) for i in range(dp)]
