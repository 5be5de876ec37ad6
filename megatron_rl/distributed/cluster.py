"""Start or join Ray, and reserve devices with placement groups.

Local runs start a private single-node Ray with no dashboard and token auth on (a random token per driver process);
cluster runs (`cluster.ray_address`, set by `launch/slurm_grpo.sh`) join the head started with `ray start`. Ray's own
gRPC servers (GCS, raylet, every worker) listen on all interfaces whatever node address is asked for, and Ray
registers the machine's address even when given loopback: the token, not the address, keeps other hosts out.
Single-node policy groups connect over 127.0.0.1 (gloo pairs bind loopback), but torch's TCPStore rendezvous server
listens on all interfaces too (torch's behaviour, MASTER_ADDR notwithstanding). README: "What happens when things fail".

One bundle per device: a GPU each on GPU machines, a CPU slot each on CPU machines. In colocated mode the policy rank
and the generator share a bundle (fractional resources); in disaggregated mode each gets its own bundles.

Several nodes: the layout (`parallel_dims`) gives each TP group and each engine consecutive slots, assuming that they
share a node; Ray's PACK strategy packs onto few nodes but promises no order of bundles over nodes and splits a group
where a node has an odd number free. So the slots are the bundles in node order (`node_order`, from the placement
group table), and `check_same_node` refuses a group that still spans nodes, before any actor starts.
"""
from __future__ import annotations

import logging
import os
import secrets
from dataclasses import dataclass
from pathlib import Path

from megatron_rl.config.schema import ClusterConfig
from megatron_rl.platform import SLOT_ENV, get_platform


def _local_auth() -> None:
    """Token auth for a private local cluster: its ports are reachable from the network (see the module docstring),
    and without auth anything that reaches them can run code as this user. Ray 2.60 turns token auth on for a new
    local cluster when RAY_AUTH_MODE is unset, but would then write a token to ~/.ray/auth_token, which concurrent
    first runs race on. Instead, give it a random token made once per process, through the environment (inherited by
    the Ray processes this driver starts; never printed, never written to disk). An explicit RAY_AUTH_MODE (e.g.
    `disabled` on a trusted, firewalled machine) and a token of the user's own (env or ~/.ray/auth_token) win.
    Ray's notice that it did so ("Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE=disabled
    to opt out"), printed on every run, is dropped: it is the expected state here, not news (docs/reliability.md)."""
    logging.getLogger("ray._private.authentication.authentication_token_setup").addFilter(_drop_auth_notice)
    if os.environ.get("RAY_AUTH_MODE") or os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return
    if (Path.home() / ".ray" / "auth_token").is_file():
        return
    os.environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)


def _drop_auth_notice(record: logging.LogRecord) -> bool:
    # the notice that token auth is on, not the warning that it is off (RAY_AUTH_MODE=disabled), which stays
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


# Imported opportunistically by libraries the workers load, though no worker logs to them (trackers run in the
# driver): megatron-core's inference context imports wandb whenever it is installed (the `[wandb]` extra), which
# costs ~0.5 s per worker and creates wandb's media/artifact temp dirs, left behind in /tmp by every actor Ray kills
# (the soak test counts them as leaks).
_WORKER_BLOCKED_IMPORTS = ("wandb",)


def worker_process_setup() -> None:
    """Ray's worker_process_setup_hook: runs in every worker process before it imports the actor's code. A None
    entry in sys.modules makes `import wandb` raise ImportError, which those libraries treat as "not installed"."""
    import sys

    for name in _WORKER_BLOCKED_IMPORTS:
        sys.modules.setdefault(name, None)


def init_ray(cfg: ClusterConfig, *, num_cpus: int | None = None, log_to_driver: bool = True) -> None:
    import ray

    if ray.is_initialized():
        return
    from megatron_rl.platform import get_platform

    runtime_env = {"env_vars": get_platform().worker_env(),
                   "worker_process_setup_hook": "megatron_rl.distributed.cluster.worker_process_setup"}
    # Clusters that join an address keep whatever the operator configured (see README, "Ray authentication tokens").
    if cfg.ray_address is None:
        _local_auth()
        from megatron_rl.distributed import worker_fork

        if worker_fork.enabled():  # a development aid (the test suite): workers forked from a preloaded server
            runtime_env["py_executable"] = worker_fork.py_executable()
        # "local": always a private cluster. Without an address Ray joins the newest `ray start` cluster recorded in
        # /tmp/ray/ray_current_cluster (another user's job, or a concurrent test's 2-node cluster) instead.
        ray.init(
            address="local",
            num_cpus=num_cpus or os.cpu_count(),
            object_store_memory=cfg.object_store_memory_mb * 2**20,
            include_dashboard=False,
            _node_ip_address=cfg.bind_host,
            log_to_driver=log_to_driver,
            configure_logging=False,
            runtime_env=runtime_env,
            # Ray starts an idle worker per CPU for the first driver, to run tasks at once. This project runs no
            # tasks, only actors, and the idle workers sat unused to the end of a run (ray::IDLE in the process
            # table): two Python start-ups per run on 2 cores for nothing. A one-step tiny `megatron-rl train` used 34.4 s of CPU without them, 37.3 s with them (2-core
            # Intel Xeon with AMX, 2026-12-07; tests/integration/test_ray_cluster.py checks none is started).
            _system_config={"enable_worker_prestart": False, "prestart_worker_first_driver": False},
        )
    else:
        ray.init(address=cfg.ray_address, log_to_driver=log_to_driver, runtime_env=runtime_env)


def shutdown_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


def node_order(bundle_nodes: list[str]) -> list[int]:
    """Bundle indices grouped by node (nodes in order of their first bundle, bundles in index order within a node):
    slot i of the layout is bundle `node_order(...)[i]`, so consecutive slots share a node wherever the node sizes
    allow."""
    first = {}
    for i, n in enumerate(bundle_nodes):
        first.setdefault(n, i)
    return sorted(range(len(bundle_nodes)), key=lambda i: (first[bundle_nodes[i]], i))


@dataclass
class Placement:
    """A placement group and how actors share its bundles. Callers name layout slots; `order` maps them to the
    group's bundles (node order, module doc)."""
    pg: object  # ray.util.placement_group.PlacementGroup
    num_bundles: int
    device_key: str  # "GPU" or "CPU"
    order: list[int] | None = None  # slot -> bundle index; None: the identity
    bundle_nodes: list[str] | None = None  # node id of each bundle (index = bundle index)

    def bundle(self, slot: int) -> int:
        return slot if self.order is None else self.order[slot]

    def slot_nodes(self) -> list[str] | None:
        return None if self.bundle_nodes is None else [self.bundle_nodes[self.bundle(s)] for s in range(self.num_bundles)]

    def check_same_node(self, groups: dict[str, list[int]]) -> None:
        """RuntimeError naming every group of slots (`DeviceLayout.node_groups`) placed on more than one node."""
        nodes = self.slot_nodes()
        if nodes is None:
            return
        bad = []
        for name, slots in groups.items():
            where = {s: nodes[s][:8] for s in slots if s < len(nodes)}
            if len(set(where.values())) > 1:
                bad.append(f"{name}: slots {slots} on nodes {where}")
        if bad:
            raise RuntimeError("the placement group split device groups that must share a node (Ray packed the "
                               "bundles over nodes with free devices in other counts; free whole nodes, or choose "
                               "policy.tp / generation.tp dividing cluster.devices_per_node): " + "; ".join(bad))

    def strategy(self, bundle_index: int):
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                placement_group_bundle_index=self.bundle(bundle_index),
                                                placement_group_capture_child_tasks=True)

    def actor_resources(self, share: float) -> dict:
        """Ray options for an actor taking `share` of one bundle's device (1.0 alone, 0.5 when colocated).

        GPU bundles hold only a GPU, so a GPU actor must say `num_cpus=0`: Ray adds `CPU: 1` to any actor that names
        a resource but no CPU count (ray/actor.py, DEFAULT_ACTOR_CREATION_CPU_SPECIFIED), and that request fits no
        bundle ("cannot fit into any bundles"). Host threads of GPU workers are not what is being reserved."""
        if self.device_key == "GPU":
            return {"num_gpus": share, "num_cpus": 0}
        return {"num_cpus": share}

    def actor_options(self, bundle_index: int, share: float) -> dict:
        """Resources and scheduling strategy of an actor on `bundle_index` (policy ranks, TP=1 engines)."""
        return dict(self.actor_resources(share), scheduling_strategy=self.strategy(bundle_index))

    def engine_placement(self, bundles: list[int], share: float) -> tuple[dict, dict]:
        """(Ray options, environment) of a rollout engine over `bundles` (generation.tp of them).

        One device: the engine's actor takes its share of that bundle and vLLM runs its one worker in that process.
        Several (generation.tp > 1, GPU): the actor holds no GPU of its own, and vLLM's Ray executor, which it picks
        inside a placement group, starts one worker actor per TP rank (vllm/v1/executor/ray_executor.py,
        `_init_workers_ray`: `num_cpus=0, num_gpus=VLLM_RAY_PER_WORKER_GPUS` on bundle `VLLM_RAY_BUNDLE_INDICES[r]`
        of the current placement group). Without those two variables every engine would take the first tp GPU
        bundles of the whole group and no share would be left for the trainer; an actor holding one GPU would make
        vLLM refuse ("World size (2) is larger than the number of available GPUs (1)")."""
        env = {SLOT_ENV: str(bundles[0])}
        if len(bundles) == 1:
            return self.actor_options(bundles[0], share), env
        if self.device_key != "GPU":
            raise ValueError(f"generation.tp={len(bundles)}: engines span several devices only on GPUs (the CPU "
                             "engine runs in-process with tp=1)")
        # vLLM's executor places its workers by the placement group's own bundle indices
        env.update(VLLM_RAY_BUNDLE_INDICES=",".join(str(self.bundle(b)) for b in bundles),
                   VLLM_RAY_PER_WORKER_GPUS=str(share))
        return dict(num_gpus=0, num_cpus=0, scheduling_strategy=self.strategy(bundles[0])), env


def reserve(num_bundles: int, *, timeout_s: float = 120.0, name: str = "megatron-rl") -> Placement:
    """One bundle per device, packed onto as few nodes as possible; fails with the missing resources named."""
    import ray
    from ray.util.placement_group import placement_group

    # Ask the cluster, not this process: a driver on a CPU-only login/head node still reserves GPUs on GPU workers.
    key = "GPU" if ray.cluster_resources().get("GPU", 0) > 0 or get_platform().is_gpu else "CPU"
    bundles = [{key: 1} for _ in range(num_bundles)]
    pg = placement_group(bundles, strategy="PACK", name=name)
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        available = ray.available_resources()
        ray.util.remove_placement_group(pg)
        raise RuntimeError(f"could not reserve {num_bundles} x {key} within {timeout_s:.0f}s "
                           f"(cluster has {available.get(key, 0)} {key} free)")
    table = ray.util.placement_group_table(pg)["bundles_to_node_id"]
    nodes = [table[i] for i in range(num_bundles)]
    return Placement(pg=pg, num_bundles=num_bundles, device_key=key, order=node_order(nodes), bundle_nodes=nodes)
