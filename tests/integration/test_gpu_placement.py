"""GPU-shaped placement on a CPU machine: Ray with 8 logical GPUs (it schedules them like real ones and sets
CUDA_VISIBLE_DEVICES), and the placement code `build()` uses (`reserve`, `WorkerGroup`, `Placement.engine_placement`,
`DeviceLayout.share`), with probe actors in place of the Megatron and vLLM workers: the resource requests are the
real ones, only the workers stop before touching CUDA.

A TP engine's workers are started both ways vLLM 0.32's Ray executors start them from inside the engine's actor.
V1 (vllm/v1/executor/ray_executor.py, `_init_workers_ray`): `num_cpus=0, num_gpus=VLLM_RAY_PER_WORKER_GPUS`, bundle
`VLLM_RAY_BUNDLE_INDICES[rank]` of the actor's current placement group, CUDA_VISIBLE_DEVICES set by Ray. V2
(`ray_executor_v2.py: RayExecutorV2`, the default: VLLM_USE_RAY_V2_EXECUTOR_BACKEND=1): the same requests, but Ray
leaves CUDA_VISIBLE_DEVICES alone (RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES); each worker reports its physical
GPU (`get_accelerator_ids`), and worker i then runs on the sorted GPUs of its node at its local rank, which can be
another worker's bundle's GPU of the same engine. Every actor must be scheduled within a timeout and see exactly its
devices: a policy rank one GPU of its own; a colocated engine's workers the GPUs of the policy ranks on its bundles
(V1: each the one on its own bundle; V2: the same set, one worker each: the refit routes by device, not by bundle,
weights/routing.py); a disaggregated engine's workers GPUs no policy rank has.
"""
from __future__ import annotations

import os

import pytest

from megatron_rl.distributed.parallel_dims import device_layout
from megatron_rl.distributed.worker_group import RankWorker
from megatron_rl.platform import SLOT_ENV

DEVICES = 8
TIMEOUT_S = 90

# (colocated, generation.dp, generation.tp, policy tp, policy pp): scheduled for real below; every layout of 8
# devices is checked against the bundles in test_every_layout_fits_its_bundles. Three shapes, one per code path of
# the placement (engine per device; a multi-device engine sharing the policy's bundles; an engine on its own bundles):
# colocated gen TP=4 and disaggregated 7+1 take the same paths (their bundles are still checked below).
SCHEDULED = [
    (True, None, 1, 2, 2),   # the default: an engine per device; policy TP=2 x PP=2 x DP=2
    (True, None, 2, 1, 2),   # colocated TP=2 engines over a PP=2 policy
    (False, 1, 2, 2, 1),     # disaggregated: 6 policy devices, one TP=2 engine
]


def _where() -> dict:
    import ray

    return {"gpus": [str(g) for g in ray.get_gpu_ids()], "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "slot": os.environ.get(SLOT_ENV)}


class PolicyProbe(RankWorker):
    def where(self) -> dict:
        return _where()


class EngineWorkerProbe:
    def where(self) -> dict:
        return _where()


class EngineProbe:
    """Stands in for `GeneratorActor`: the same constructor contract (the placement's environment applied first)."""

    def __init__(self, env: dict):
        os.environ.update({k: str(v) for k, v in env.items()})

    def where(self) -> dict:
        return _where()

    def start_workers(self, tp: int) -> list[dict]:
        """What vLLM's Ray executor does in this process for a TP engine (module docstring), as it reads its env."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if tp == 1:  # vLLM runs its one worker in this process
            return [self.where()]
        pg = ray.util.get_current_placement_group()
        assert pg is not None, "a TP engine's actor must run inside the placement group (vLLM's workers join it)"
        per_worker = float(os.environ.get("VLLM_RAY_PER_WORKER_GPUS", "1.0"))
        bundles = [int(b) for b in os.environ["VLLM_RAY_BUNDLE_INDICES"].split(",")]
        assert len(bundles) == tp and len(set(bundles)) == tp, bundles
        workers = [ray.remote(num_cpus=0, num_gpus=per_worker, scheduling_strategy=PlacementGroupSchedulingStrategy(
            placement_group=pg, placement_group_bundle_index=b, placement_group_capture_child_tasks=True))(
            EngineWorkerProbe).remote() for b in bundles]
        try:
            return ray.get([w.where.remote() for w in workers], timeout=TIMEOUT_S)
        finally:
            for w in workers:
                ray.kill(w)

    def start_workers_v2(self, tp: int) -> list[str]:
        """RayExecutorV2's placement (module docstring): the GPU each worker rank runs on, in rank order."""
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        pg = ray.util.get_current_placement_group()
        per_worker = float(os.environ.get("VLLM_RAY_PER_WORKER_GPUS", "1.0"))
        bundles = [int(b) for b in os.environ["VLLM_RAY_BUNDLE_INDICES"].split(",")]
        noset = {"env_vars": {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}}
        workers = [ray.remote(num_cpus=0, num_gpus=per_worker, runtime_env=noset,
                              scheduling_strategy=PlacementGroupSchedulingStrategy(
                                  placement_group=pg, placement_group_bundle_index=b))(EngineWorkerProbe).remote()
                   for b in bundles]
        try:
            found = ray.get([w.where.remote() for w in workers], timeout=TIMEOUT_S)
        finally:
            for w in workers:
                ray.kill(w)
        assert all(len(f["gpus"]) == 1 for f in found), found
        node_gpus = sorted((f["gpus"][0] for f in found), key=int)  # one node here
        return [node_gpus[local_rank] for local_rank in range(len(found))]


@pytest.fixture(scope="module")
def gpu_ray():
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    if ray.is_initialized():
        ray.shutdown()
    from megatron_rl.distributed import worker_fork

    # its actors forked from the suite's preloaded server, as init_ray's clusters' are (tests/worker_fork_server.py)
    env = {"py_executable": worker_fork.py_executable()} if worker_fork.enabled() else None
    ray.init(address="local", num_cpus=2, num_gpus=DEVICES, object_store_memory=256 << 20, include_dashboard=False,
             configure_logging=False, log_to_driver=False, runtime_env=env)
    yield
    ray.shutdown()


def _layout(colocated, gen_dp, gen_tp, tp, pp):
    return device_layout(devices=DEVICES, tp=tp, pp=pp, dp=None, colocated=colocated, gen_tp=gen_tp, gen_dp=gen_dp)


@pytest.mark.parametrize("colocated,gen_dp,gen_tp,tp,pp", SCHEDULED)
def test_every_actor_is_scheduled_on_its_devices(gpu_ray, colocated, gen_dp, gen_tp, tp, pp):
    import ray

    from megatron_rl.distributed.cluster import reserve
    from megatron_rl.distributed.worker_group import WorkerGroup

    layout = _layout(colocated, gen_dp, gen_tp, tp, pp)
    placement = reserve(layout.bundles, timeout_s=TIMEOUT_S)
    assert placement.device_key == "GPU"
    group, engines = None, []
    try:
        group = WorkerGroup(PolicyProbe, placement, name="policy", world_size=layout.policy.world_size,
                            share=layout.share, master_addr="127.0.0.1")
        policy = group.call("where", timeout=TIMEOUT_S)
        for bundles in layout.engines:
            options, env = placement.engine_placement(bundles, layout.share)
            engines.append(ray.remote(EngineProbe).options(**options).remote(env))
        hosts = ray.get([e.where.remote() for e in engines], timeout=TIMEOUT_S)
        workers = ray.get([e.start_workers.remote(layout.gen_tp) for e in engines], timeout=TIMEOUT_S)
        workers_v2 = (ray.get([e.start_workers_v2.remote(layout.gen_tp) for e in engines], timeout=TIMEOUT_S)
                      if layout.gen_tp > 1 else None)
    finally:
        for e in engines:
            ray.kill(e)
        if group is not None:
            group.shutdown()
        ray.util.remove_placement_group(placement.pg)

    # every policy rank: one GPU of its own, visible as its only device
    for rank, w in enumerate(policy):
        assert len(w["gpus"]) == 1 and w["visible"] == w["gpus"][0] and w["slot"] == str(rank), (rank, w)
    policy_gpus = [w["gpus"][0] for w in policy]
    assert len(set(policy_gpus)) == layout.policy.world_size
    used = []
    for i, (bundles, host, ws) in enumerate(zip(layout.engines, hosts, workers)):
        assert host["slot"] == str(bundles[0])
        if layout.gen_tp > 1:
            assert host["gpus"] == [], (i, host)  # vLLM's workers hold the GPUs, not the engine's actor
        assert len(ws) == layout.gen_tp
        for b, w in zip(bundles, ws):
            assert len(w["gpus"]) == 1, (i, b, w)
            if colocated:  # the engine worker shares the GPU of the policy rank on its bundle
                assert w["gpus"] == [policy_gpus[b]], (i, b, w, policy_gpus)
            else:
                assert w["gpus"][0] not in policy_gpus, (i, b, w, policy_gpus)
            used.append(w["gpus"][0])
    assert len(set(used)) == len(used) == layout.gen_devices  # no GPU holds two engine workers
    if workers_v2 is not None:  # V2: each engine's workers on the GPUs of its bundles, one each, maybe permuted
        for i, (bundles, ws, gpus) in enumerate(zip(layout.engines, workers, workers_v2)):
            assert sorted(gpus, key=int) == sorted((w["gpus"][0] for w in ws), key=int), (i, gpus, ws)
            if colocated:
                assert set(gpus) == {policy_gpus[b] for b in bundles}, (i, bundles, gpus, policy_gpus)


def _all_layouts():
    """Every device layout of 8 devices the planner can propose (it searches these splits and vLLM TP sizes)."""
    out = [(True, None, t) for t in (1, 2, 4, 8)]
    for gen in range(1, DEVICES):
        out += [(False, gen // t, t) for t in (1, 2, 4, 8) if gen % t == 0]
    return out


@pytest.mark.parametrize("colocated,gen_dp,gen_tp", _all_layouts())
def test_every_layout_fits_its_bundles(colocated, gen_dp, gen_tp):
    """Without Ray: the real option dicts of every actor, summed per bundle, fit a `{"GPU": 1}` bundle, and no actor
    asks for a CPU a GPU bundle does not have (Ray adds CPU: 1 to any actor that does not say num_cpus)."""
    from megatron_rl.distributed.cluster import Placement

    layout = _layout(colocated, gen_dp, gen_tp, 1, 1)
    placement = Placement(pg=None, num_bundles=layout.bundles, device_key="GPU")
    placement.strategy = lambda b: b  # the bundle index stands for the scheduling strategy here
    demand = [0.0] * layout.bundles
    requests = [placement.actor_options(r, layout.share) for r in range(layout.policy.world_size)]
    for bundles in layout.engines:
        options, env = placement.engine_placement(bundles, layout.share)
        requests.append(options)
        if len(bundles) > 1:  # vLLM's workers, as its Ray executor asks for them
            per = float(env["VLLM_RAY_PER_WORKER_GPUS"])
            requests += [{"num_gpus": per, "num_cpus": 0, "scheduling_strategy": int(b)}
                         for b in env["VLLM_RAY_BUNDLE_INDICES"].split(",")]
    for req in requests:
        assert req.get("num_cpus") == 0, req
        demand[req["scheduling_strategy"]] += req["num_gpus"]
    assert all(d <= 1.0 for d in demand), demand
    assert sum(demand) == pytest.approx(layout.policy.world_size * layout.share + layout.gen_devices * layout.share)
