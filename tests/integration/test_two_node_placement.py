"""Two nodes (issue 54, item 9): the layout gives each policy TP group and each TP engine consecutive slots, assuming
they share a node; the PACK placement group's bundles are now put in node order and checked against the placement
group table before any actor starts. Ray's `cluster_utils.Cluster`: 2 nodes x 4 logical GPUs (Ray schedules them
as real ones on a CPU machine), probe actors placed as `build()` places the workers (WorkerGroup, engine_placement,
vLLM's Ray executor's per-bundle workers, as in test_gpu_placement.py), each reporting the node it runs on, compared
with Ray's own placement group table."""
from __future__ import annotations

import os

import pytest

from megatron_rl.distributed.parallel_dims import device_layout
from megatron_rl.distributed.worker_group import RankWorker

NODES, GPUS = 2, 4
TIMEOUT_S = 90


def _node() -> str:
    import ray

    return ray.get_runtime_context().get_node_id()


class PolicyNodeProbe(RankWorker):
    def node(self) -> str:
        return _node()


class EngineNodeProbe:
    def __init__(self, env: dict):
        os.environ.update({k: str(v) for k, v in env.items()})

    def worker_nodes(self, tp: int) -> list[str]:
        """vLLM's Ray executor's workers, one per VLLM_RAY_BUNDLE_INDICES entry of this actor's group."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = ray.util.get_current_placement_group()
        bundles = [int(b) for b in os.environ["VLLM_RAY_BUNDLE_INDICES"].split(",")]
        per = float(os.environ["VLLM_RAY_PER_WORKER_GPUS"])
        probe = ray.remote(num_cpus=0, num_gpus=per)(lambda: _node())
        return ray.get([probe.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=b)).remote() for b in bundles], timeout=TIMEOUT_S)


@pytest.fixture(scope="module")
def two_nodes():
    import ray
    from ray.cluster_utils import Cluster

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "num_gpus": GPUS})
    cluster.add_node(num_cpus=2, num_gpus=GPUS)
    ray.init(address=cluster.address, log_to_driver=False, configure_logging=False)
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def _table_nodes(placement) -> list[str]:
    """Each layout slot's node by Ray's placement group table, through the bundle the slot's actors are sent to."""
    import ray

    table = ray.util.placement_group_table(placement.pg)["bundles_to_node_id"]
    return [table[placement.strategy(s).placement_group_bundle_index] for s in range(placement.num_bundles)]


def test_every_tp_group_and_engine_runs_on_one_node(two_nodes):
    """Disaggregated: policy TP=2 x DP=3 on six slots, one generation.tp=2 engine on the last two."""
    import ray

    from megatron_rl.distributed.cluster import reserve
    from megatron_rl.distributed.worker_group import WorkerGroup

    layout = device_layout(devices=NODES * GPUS, tp=2, pp=1, dp=None, colocated=False, gen_tp=2, gen_dp=1)
    assert layout.policy.dp == 3 and layout.engines == [[6, 7]]
    placement = reserve(layout.bundles, timeout_s=TIMEOUT_S)
    group = engine = None
    try:
        placement.check_same_node(layout.node_groups())
        slots = _table_nodes(placement)
        group = WorkerGroup(PolicyNodeProbe, placement, name="policy", world_size=layout.policy.world_size,
                            share=layout.policy_share, master_addr=None)
        ranks = group.call("node", timeout=TIMEOUT_S)
        options, env = placement.engine_placement(layout.engines[0], layout.share)
        engine = ray.remote(EngineNodeProbe).options(**options).remote(env)
        engine_workers = ray.get(engine.worker_nodes.remote(layout.gen_tp), timeout=TIMEOUT_S)
    finally:
        if engine is not None:
            ray.kill(engine)
        if group is not None:
            group.shutdown()
        ray.util.remove_placement_group(placement.pg)
    assert len(set(slots)) == NODES  # the layout does span both nodes
    assert ranks == slots[:6]  # every rank runs where the table puts its slot's bundle
    for name, members in layout.node_groups().items():
        assert len({slots[s] for s in members}) == 1, (name, members, slots)
    for dp in range(3):
        tp_group = layout.policy.ranks_where(dp=dp, pp=0)
        assert len({ranks[r] for r in tp_group}) == 1, (dp, ranks)
    assert engine_workers == [slots[6], slots[7]] and len(set(engine_workers)) == 1


def test_a_tp_group_the_pack_split_over_nodes_is_refused(two_nodes):
    """One GPU taken on each node leaves 3 + 3: PACK puts six bundles three per node, so the TP=2 group of slots
    2 and 3 would span the nodes; the placement refuses it, naming the group."""
    import ray

    from megatron_rl.distributed.cluster import reserve

    holders = [ray.remote(num_gpus=1, num_cpus=0)(PolicyNodeProbe).options(
        scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
        .remote(0, 1) for n in ray.nodes() if n["Alive"]]
    try:
        assert len(set(ray.get([h.node.remote() for h in holders], timeout=TIMEOUT_S))) == NODES
        layout = device_layout(devices=6, tp=2, pp=1, dp=None, colocated=True, gen_tp=1, gen_dp=None)
        placement = reserve(layout.bundles, timeout_s=TIMEOUT_S)
        try:
            slots = _table_nodes(placement)
            assert sorted(slots.count(n) for n in set(slots)) == [3, 3]  # the premise: three free per node
            with pytest.raises(RuntimeError, match=r"policy TP group \(dp=1, pp=0\): slots \[2, 3\]"):
                placement.check_same_node(layout.node_groups())
        finally:
            ray.util.remove_placement_group(placement.pg)
    finally:
        for h in holders:
            ray.kill(h)


def test_slots_follow_the_nodes_whatever_order_ray_numbers_the_bundles():
    """Without Ray: bundles numbered alternately over two nodes still give each TP pair one node, and the actors and
    vLLM's workers are sent to the bundles of those slots."""
    from megatron_rl.distributed.cluster import Placement, node_order

    nodes = ["a", "b", "a", "b", "a", "b", "a", "b"]
    p = Placement(pg=None, num_bundles=8, device_key="GPU", order=node_order(nodes), bundle_nodes=nodes)
    assert p.slot_nodes() == ["a"] * 4 + ["b"] * 4
    layout = device_layout(devices=8, tp=2, pp=1, dp=None, colocated=False, gen_tp=2, gen_dp=1)
    p.check_same_node(layout.node_groups())  # every pair on one node: no error
    _, env = p.engine_placement(layout.engines[0], 1.0)
    assert [nodes[int(b)] for b in env["VLLM_RAY_BUNDLE_INDICES"].split(",")] == ["b", "b"]
    raw = Placement(pg=None, num_bundles=8, device_key="GPU", order=None, bundle_nodes=nodes)
    with pytest.raises(RuntimeError, match="engine 0"):
        raw.check_same_node(layout.node_groups())
