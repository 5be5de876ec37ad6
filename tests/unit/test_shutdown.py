"""`Components.shutdown` (build.py) at the end of every run and every test fixture: a part whose shutdown raises
(a worker group whose actors already died, an engine Ray killed) must not keep the parts after it alive, nor stop
the reward workers, the environments and Ray from being shut down."""
from __future__ import annotations

from unittest import mock

from megatron_rl.build import Components


class _Part:
    def __init__(self, name, log, fails=False):
        self.name, self.log, self.fails = name, log, fails

    def shutdown(self):
        self.log.append(self.name)
        if self.fails:
            raise RuntimeError(f"{self.name} is gone")

    close = shutdown


def test_a_failing_part_does_not_stop_the_others():
    log = []
    parts = {n: _Part(n, log, fails=n in ("generator", "reward_fn")) for n in
             ("generator", "policy", "teacher", "reward_model", "critic", "reward_fn", "env_pool")}
    c = Components(tokenizer=None, train_stream=None, val_items=[], placement=None, model_dir=None, handover=None,
                   **parts)
    with mock.patch("megatron_rl.distributed.cluster.shutdown_ray") as ray_down, \
            mock.patch("megatron_rl.weights.shared_memory.remove_orphaned_files") as orphans:
        c.shutdown()
    # the engines first (their /dev/shm broadcaster must go before Ray), then every group, then the host-side pools
    assert log == ["generator", "policy", "teacher", "reward_model", "critic", "reward_fn", "env_pool"]
    ray_down.assert_called_once_with()
    orphans.assert_called_once_with()
