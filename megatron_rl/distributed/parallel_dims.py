"""Named parallel dimensions and device layouts: the one place for the rules of how a run splits its devices.

- `ParallelDims` maps a global policy rank to its (tp, cp, dp, pp) coordinates. The order matches megatron-core's
  default `initialize_model_parallel(order="tp-cp-ep-dp-pp")`: TP varies fastest, then CP, then DP, then PP, so TP
  groups are contiguous ranks (one node) and PP stages are the slowest-varying dimension. megatron-core is given the
  CP ranks as data-parallel ones (`policy/context_parallel.py`), which this order makes consecutive.
- `device_layout` decides which devices the policy ranks and the rollout engines get; the config loader validates
  with it, `build()` places with it and `megatron-rl plan` proposes only layouts it accepts.
- `check_policy_split` / `check_engine_split` are the model-shape rules of megatron-core and vLLM (heads, KV heads,
  layers, FFN width vs TP and PP), read by the loader (from the model's config.json) and the planner (from its spec);
  `check_expert_split` adds expert parallelism's (EP vs the expert count, MoE training vs TP).
- Expert parallelism (`ep`) does not add ranks: as in megatron-core, experts are laid out over the same world with
  their own order tp-ep-edp-pp (expert TP = TP), so EP ranks are data-parallel ranks and ep must divide dp; each
  expert's gradients average over the dp / ep expert-data-parallel replicas.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ParallelDims:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1  # expert parallelism, carved out of dp (module doc)
    # ranks that split each row: context parallelism (policy.cp, megatron) or Ulysses (policy.sp, fsdp2; never both)
    cp: int = 1

    def __post_init__(self):
        if self.ep < 1 or self.dp % self.ep:
            raise ValueError(f"policy.ep={self.ep} must divide the data-parallel size dp={self.dp} (expert "
                             "parallelism takes its ranks out of the data-parallel ones, as in megatron-core)")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def expert_dp(self) -> int:
        """Replicas of each expert (megatron's expert-data-parallel size)."""
        return self.dp // self.ep

    def expert_coords(self, rank: int) -> dict[str, int]:
        """megatron-core's expert coordinates of a rank (order tp-ep-edp-pp with expert TP = TP): which EP shard of
        the experts it holds ("ep") and which replica of that shard it is ("edp")."""
        c = self.coords(rank)
        if self.cp > 1:
            raise NotImplementedError("expert coordinates with policy.cp > 1")
        return {"tp": c["tp"], "ep": c["dp"] % self.ep, "edp": c["dp"] // self.ep, "pp": c["pp"]}

    @classmethod
    def from_world(cls, world_size: int, tp: int = 1, pp: int = 1, dp: int | None = None,
                   ep: int = 1, cp: int = 1) -> "ParallelDims":
        named = "tp*pp*cp" if cp > 1 else "tp*pp"
        if world_size % (tp * pp * cp):
            raise ValueError(f"{named}={tp * pp * cp} does not divide world size {world_size}")
        dims = cls(tp=tp, pp=pp, dp=dp if dp is not None else world_size // (tp * pp * cp), ep=ep, cp=cp)
        if dims.world_size != world_size:
            raise ValueError(f"{named}*dp={dims.world_size} != world size {world_size}")
        return dims

    def coords(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside world of {self.world_size}")
        inner = self.tp * self.cp
        return {"tp": rank % self.tp, "cp": (rank // self.tp) % self.cp, "dp": (rank // inner) % self.dp,
                "pp": rank // (inner * self.dp)}

    def rank(self, tp: int = 0, dp: int = 0, pp: int = 0, cp: int = 0) -> int:
        return tp + self.tp * (cp + self.cp * (dp + self.dp * pp))

    def ranks_where(self, **fixed: int) -> list[int]:
        """Global ranks whose coordinates match `fixed`, e.g. ranks_where(tp=0, pp=0) = one rank per DP replica."""
        return [r for r in range(self.world_size) if all(self.coords(r)[k] == v for k, v in fixed.items())]

    def describe(self, rank: int) -> str:
        c = self.coords(rank)
        cp = f", cp={c['cp']}" if self.cp > 1 else ""
        return f"rank {rank} (tp={c['tp']}{cp}, dp={c['dp']}, pp={c['pp']})"


def _engines(*, policy_world: int, colocated: bool, tp: int, dp: int | None) -> tuple[int, int]:
    """(number of engines, first engine bundle): colocated engines share the policy's bundles (by default as many
    as fit), disaggregated ones come after them (by default one)."""
    if colocated:
        dp = policy_world // tp if dp is None else dp
        if dp < 1 or dp * tp > policy_world:
            raise ValueError(f"generation.dp*tp = {dp}*{tp} engine devices do not fit the {policy_world} devices "
                             "the colocated policy holds")
        return dp, 0
    dp = 1 if dp is None else dp
    if dp < 1:
        raise ValueError(f"generation.dp must be >= 1, got {dp}")
    return dp, policy_world


def generation_bundles(*, policy_world: int, colocated: bool, tp: int, dp: int | None) -> list[list[int]]:
    """Placement-group bundle indices of each rollout engine (`generation.dp` engines x `generation.tp` devices):
    engine i on bundles [first + i*tp, first + (i+1)*tp)."""
    n, first = _engines(policy_world=policy_world, colocated=colocated, tp=tp, dp=dp)
    return [list(range(first + i * tp, first + (i + 1) * tp)) for i in range(n)]


@dataclass(frozen=True)
class DeviceLayout:
    """Where a run's parts sit: the policy's ranks on bundles [0, policy.world_size), each engine on `engines[i]`."""
    devices: int  # cluster.num_nodes * cluster.devices_per_node
    colocated: bool
    policy: ParallelDims
    gen_tp: int
    gen_dp: int  # engines
    # groups whose ranks share the policy's bundles, one rank on each: a distillation teacher (config.distillation),
    # a reward model (config reward.model), PPO's critic (config critic); each takes its own turn when colocated
    side_groups: int = 0

    @property
    def engines(self) -> list[list[int]]:
        """Bundle indices of each engine."""
        return generation_bundles(policy_world=self.policy.world_size, colocated=self.colocated, tp=self.gen_tp,
                                  dp=self.gen_dp)

    @property
    def share(self) -> float:
        """The fraction of its bundle's device an engine worker asks Ray for: colocated, a policy rank and an engine
        worker take half each (they take turns on the device), a third each with a distillation teacher taking its
        turn too, and so on for each side group; disaggregated, each engine has its device alone."""
        if self.colocated:
            return round(1.0 / (2 + self.side_groups), 4)  # Ray counts fractions to 1e-4
        return 1.0

    @property
    def policy_share(self) -> float:
        """The fraction a policy rank (and a side group's rank, on the same bundles) asks for: the engines' when
        colocated, else the policy bundle split between the policy and its side groups."""
        return self.share if self.colocated else round(1.0 / (1 + self.side_groups), 4)

    @property
    def gen_devices(self) -> int:
        return self.gen_dp * self.gen_tp

    @property
    def bundles(self) -> int:
        """Placement-group bundles to reserve: colocated engines share the policy's, disaggregated ones add theirs."""
        return self.policy.world_size + (0 if self.colocated else self.gen_devices)

    def node_groups(self) -> dict[str, list[int]]:
        """Bundles that must sit on one node: each policy TP group (NVLink-bound all-reduces in every layer) and each
        engine (vLLM's tensor parallelism); PP stages and DP replicas may span nodes."""
        p, out = self.policy, {}
        for pp in range(p.pp):
            for dp in range(p.dp):
                for cp in range(p.cp):
                    if p.tp > 1:
                        where = f"cp={cp}, dp={dp}, pp={pp}" if p.cp > 1 else f"dp={dp}, pp={pp}"
                        out[f"policy TP group ({where})"] = p.ranks_where(dp=dp, pp=pp, cp=cp)
        for i, bundles in enumerate(self.engines):
            if len(bundles) > 1:
                out[f"engine {i} (generation.tp={self.gen_tp})"] = bundles
        return out


def device_layout(*, devices: int, tp: int, pp: int, dp: int | None, colocated: bool, gen_tp: int,
                  gen_dp: int | None, max_staleness: int = 0, ep: int = 1, side_groups: int = 0,
                  cp: int = 1, sp: int = 1) -> DeviceLayout:
    """The layout of `devices` devices (GPUs, or CPU slots on CPU machines), or ValueError naming the config keys.

    Colocated: the policy's ranks take the devices (default dp: devices / (tp*pp)) and the engines time-share them.
    Disaggregated (`cluster.colocated: false`): the engines' devices (generation.dp * generation.tp, default one
    engine) come out of the same count and the policy gets the rest, so a config that names its allocation's devices
    reserves exactly those. Async GRPO (`grpo.max_staleness >= 1`) overlaps generation with training, which only
    separate devices allow. Expert parallelism (policy.ep) divides the policy's data-parallel ranks, adding none."""
    for key, v in (("policy.tp", tp), ("policy.pp", pp), ("policy.ep", ep), ("policy.cp", cp), ("policy.sp", sp),
                   ("generation.tp", gen_tp), ("cluster devices", devices)):
        if v < 1:
            raise ValueError(f"{key} must be >= 1, got {v}")
    for key, v in (("policy.dp", dp), ("generation.dp", gen_dp)):
        if v is not None and v < 1:
            raise ValueError(f"{key} must be >= 1, got {v}")
    check_staleness(max_staleness, colocated)
    where = "cluster.num_nodes*devices_per_node"
    if colocated:
        room, whose = devices, f"the {devices} devices ({where})"
    else:
        gen = (1 if gen_dp is None else gen_dp) * gen_tp
        room = devices - gen
        whose = (f"the {room} of {devices} devices ({where}) left after the engines' generation.dp*tp = {gen} "
                 "(cluster.colocated=false: the engines get devices of their own)")
        if room < 1:
            raise ValueError(f"generation.dp*tp = {gen} engine devices leave no device for the policy out of "
                             f"{where} = {devices} (cluster.colocated=false); raise cluster.devices_per_node or "
                             "lower generation.dp")
    split = tp * pp * cp * sp
    named = "tp*pp" + ("*cp" if cp > 1 else "") + ("*sp" if sp > 1 else "")
    ranks = split * (dp or 1)
    if ranks > room:
        raise ValueError(f"policy.{named}*dp = {ranks} ranks do not fit cluster: {whose}")
    if dp is None and room % split:
        raise ValueError(f"policy.{named} = {split} does not divide {whose}; set policy.dp explicitly")
    policy = ParallelDims(tp=tp, pp=pp, dp=room // split if dp is None else dp, ep=ep, cp=cp * sp)
    n_engines, _ = _engines(policy_world=policy.world_size, colocated=colocated, tp=gen_tp, dp=gen_dp)
    return DeviceLayout(devices, colocated, policy, gen_tp, n_engines, side_groups)


def check_staleness(max_staleness: int, colocated: bool) -> None:
    """Async GRPO overlaps generation with training, which only separate devices allow."""
    if max_staleness > 0 and colocated:
        raise ValueError(f"grpo.max_staleness={max_staleness} needs cluster.colocated=false: colocated engines and "
                         "trainer take turns on the same devices, so generation cannot overlap training")


def layout_of(cfg) -> DeviceLayout:
    """`device_layout` of a `Config` (what `build()` places and the loader validates)."""
    c, p, g = cfg.cluster, cfg.policy, cfg.generation
    return device_layout(devices=c.num_nodes * c.devices_per_node, tp=p.tp, pp=p.pp, dp=p.dp, colocated=c.colocated,
                         gen_tp=g.tp, gen_dp=g.dp, max_staleness=cfg.grpo.max_staleness, ep=p.ep, cp=p.cp, sp=p.sp,
                         side_groups=(getattr(cfg, "distillation", None) is not None)
                         + (getattr(getattr(cfg, "reward", None), "model", None) is not None)
                         + (getattr(cfg, "algorithm", "grpo") == "ppo"))


def check_policy_split(*, tp: int, pp: int, heads: int, kv_heads: int, layers: int, ffn: int | None) -> None:
    """megatron-core's rules for the trainer: TP divides the attention heads, the KV heads (num_query_groups) and
    the FFN width (column-parallel linear layers split their output evenly); PP divides the layers (uniform split).
    ValueError naming the key otherwise."""
    for what, n in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads), ("intermediate_size", ffn)):
        if n and n % tp:
            raise ValueError(f"policy.tp={tp} does not divide {what}={n}")
    if layers and layers % pp:
        raise ValueError(f"policy.pp={pp} does not divide num_hidden_layers={layers}")


def check_engine_split(*, tp: int, heads: int, kv_heads: int) -> None:
    """vLLM's rules for an engine: TP divides the attention heads; KV heads are split when TP divides them and
    replicated when they divide TP, anything else is refused. ValueError naming the key otherwise."""
    if heads and heads % tp:
        raise ValueError(f"generation.tp={tp} does not divide num_attention_heads={heads}")
    if kv_heads and kv_heads % tp and tp % kv_heads:
        raise ValueError(f"generation.tp={tp} neither divides nor is a multiple of num_key_value_heads={kv_heads}")


def check_expert_split(*, ep: int, tp: int, num_experts: int | None, aux_loss_coef: float = 0.0) -> None:
    """Expert parallelism and MoE training vs the model (num_experts: None for a dense model): EP needs an MoE model
    whose expert count it divides; megatron-core trains MoE layers at TP > 1 only with sequence parallelism
    (`MoELayer.forward` raises otherwise), which megatron-rl does not enable (and megatron's local layer spec, the
    CPU one, cannot: its torch RMSNorm refuses sequence parallelism). ValueError naming the key otherwise."""
    if not num_experts:
        if ep > 1:
            raise ValueError(f"policy.ep={ep} needs a mixture-of-experts model; this one is dense (no num_experts / "
                             "num_local_experts)")
        if aux_loss_coef:
            raise ValueError(f"policy.moe_aux_loss_coef={aux_loss_coef} needs a mixture-of-experts model; this one "
                             "is dense")
        return
    if num_experts % ep:
        raise ValueError(f"policy.ep={ep} does not divide the expert count {num_experts}")
    if tp > 1:
        raise ValueError(f"policy.tp={tp} with a mixture-of-experts model: megatron-core trains MoE layers at TP > 1 "
                         "only with sequence parallelism, which megatron-rl does not enable; use policy.tp=1 with "
                         "policy.ep / policy.pp")
