"""Start-up order of a colocated distillation run (issue 54, item 2): `build()` with its groups replaced by
recorders, no Ray. Each group records the others' lifecycle state at the moment it sets up: the teacher must find
the trainer offloaded (an 8B student's training state plus a 32B teacher do not fit one 80 GB device together), and
every engine must find both offloaded (vLLM sizes its KV cache from the free memory)."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from unittest import mock

import pytest

from megatron_rl import build as build_module
from megatron_rl.config import load_config
from megatron_rl.lifecycle import AWAKE, OFFLOADED, RESIDENT

REPO = Path(__file__).resolve().parents[2]


class _Group:
    """A policy or teacher group as the handover sees it: set up (weights resident) when constructed."""

    def __init__(self, name, log):
        self.name, self.log, self._state = name, log, RESIDENT

    def offload(self):
        self.log.append(("offload", self.name))
        self._state = OFFLOADED

    def onload(self):
        self._state = RESIDENT

    def state(self):
        return self._state

    def device_ids(self):
        return ["slot-0"]


@pytest.fixture
def recorded(tmp_path):
    cfg = load_config(REPO / "configs" / "distill_cpu.yaml", [f"output.dir={tmp_path}"], check_model=False)
    assert cfg.cluster.colocated and cfg.distillation is not None
    (tmp_path / "config.json").write_text("{}")  # the model folder build reads (a dense model: no routing record)
    log: list[tuple] = []
    groups: dict[str, _Group] = {}

    def states():
        return {n: g.state() for n, g in groups.items()}

    def start_cluster(*_a, **_k):
        placement = SimpleNamespace(engine_placement=lambda bundles, share: ({}, {}))
        return placement, tmp_path

    def start_ranks(*_a, **_k):
        log.append(("setup", "policy", states()))
        groups["policy"] = _Group("policy", log)
        return groups["policy"]

    def start_teacher(*_a, **_k):
        log.append(("setup", "teacher", states()))
        groups["teacher"] = _Group("teacher", log)
        return groups["teacher"]

    class _Actor:  # the engine's process: started before the ranks, importing vLLM only (deferred)
        def options(self, **_k):
            return self

        def remote(self, *_a, deferred=False, **_k):
            log.append(("process", "engine", deferred))
            return object()

    class _Pool:
        state = AWAKE

        def __init__(self, engines):
            self.engines = [SimpleNamespace(name=f"generator-{i}") for i in range(len(engines))]

        def start_engines(self):  # where each engine takes device memory
            log.append(("setup", "engine", states()))
            return [0] * len(self.engines)

        def device_ids(self):
            return [["slot-0"]] * len(self.engines)

    import ray

    import megatron_rl.generation.actor as actor_module
    import megatron_rl.generation.pool as pool_module
    import megatron_rl.rewards.reward_fn as reward_module

    with mock.patch.object(build_module, "preflight", lambda cfg: None), \
            mock.patch.object(build_module, "resolve_model_dir", lambda m: tmp_path), \
            mock.patch.object(build_module, "build_data", lambda cfg, tok: (None, None, [])), \
            mock.patch.object(build_module, "start_cluster", start_cluster), \
            mock.patch.object(build_module, "start_ranks", start_ranks), \
            mock.patch.object(build_module, "start_teacher", start_teacher), \
            mock.patch.object(reward_module, "RewardFn", lambda *a: None), \
            mock.patch.object(ray, "remote", lambda cls: _Actor()), \
            mock.patch.object(actor_module, "RemoteGenerator", lambda actor, name, log: name), \
            mock.patch.object(pool_module, "GeneratorPool", _Pool):
        build_module.build(cfg, tmp_path)
    return log


def test_teacher_sets_up_after_the_trainer_left_the_device(recorded):
    setups = {what: seen for kind, what, *rest in recorded if kind == "setup" for seen in rest}
    assert setups["policy"] == {}
    assert setups["teacher"] == {"policy": OFFLOADED}  # never resident together
    assert setups["engine"] == {"policy": OFFLOADED, "teacher": OFFLOADED}
    # the engines' processes start first (deferred: importing vLLM while the ranks set up, no device memory) and
    # build their engines last
    order = [(kind, what) for kind, what, *_ in recorded]
    assert order.index(("process", "engine")) < order.index(("setup", "policy")) < order.index(("setup", "engine"))
    assert all(rest == [True] for kind, what, *rest in recorded if kind == "process")


def test_a_disaggregated_teacher_stays_resident_through_its_turn():
    """Without colocation the teacher keeps its own devices: its turn moves no group (each records any move), and a
    turn asked of a run without a teacher is refused. (Through a real disaggregated distillation run:
    test_distill.py::test_cli_distillation_run[async], opt-in.)"""
    from megatron_rl.algorithms.handover import Handover

    from megatron_rl.lifecycle import LifecycleError

    log = []  # offloads; any other move fails too (a _Group has no sleep or wake_up)
    policy, engine, teacher = _Group("policy", log), _Group("engine", log), _Group("teacher", log)
    Handover(policy, engine, colocated=False, bucket_bytes=1 << 20, sleep_level=1, teacher=teacher).to_teacher()
    assert log == [] and teacher.state() == RESIDENT
    with pytest.raises(LifecycleError, match=r"to_teacher\(\) without a distillation teacher"):
        Handover(policy, engine, colocated=False, bucket_bytes=1 << 20, sleep_level=1).to_teacher()
