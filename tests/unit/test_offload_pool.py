"""The offloader's host buffers are reused from one handover to the next for the FSDP2 worker's tensors (issue 54,
item 5): it passes `DTensor.to_local()` views, new objects at every call, which a pool keyed by `id()` never hit,
so pinned host memory was allocated at every handover. One-rank gloo, real `fully_shard` and AdamW state."""
from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megatron_rl.platform import Platform
from megatron_rl.policy.offload import DeviceStateOffloader


@pytest.fixture
def sharded_model(tmp_path):
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this test process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(3, 8)).square().sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    yield model, opt
    dist.destroy_process_group()


def _worker_lists(model, opt):
    """What `FSDP2PolicyWorker._weight_tensors` / `_train_state` pass: fresh `to_local()` views at each call."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731  (the worker's `_local`)
    weights = [local(p) for p in model.parameters()]
    state = [local(v) for st in opt.state.values() for v in st.values() if torch.is_tensor(v)]
    return weights + state


def test_second_handover_allocates_no_host_buffer(sharded_model):
    model, opt = sharded_model
    first, second = _worker_lists(model, opt), _worker_lists(model, opt)
    # the premise: new objects over the same storages (AdamW's step counters are plain tensors, the same each time)
    assert all(a is not b for a, b in zip(first[:4], second[:4]))
    del first, second
    snapshot = [t.clone() for t in _worker_lists(model, opt)]
    want_bytes = sum(t.untyped_storage().nbytes() for t in snapshot)

    allocations = []
    real = Platform.host_buffer

    def counting(self, nbytes):
        allocations.append(nbytes)
        return real(self, nbytes)

    offloader = DeviceStateOffloader()
    with mock.patch.object(Platform, "host_buffer", counting):
        per_cycle = []
        for _ in range(2):
            before = len(allocations)
            assert offloader.offload(_worker_lists(model, opt), []) == want_bytes
            assert all(t.untyped_storage().nbytes() == 0 for t in _worker_lists(model, opt))
            offloader.restore()
            per_cycle.append(len(allocations) - before)
    assert per_cycle == [len(snapshot), 0]
    assert offloader.host_bytes() == want_bytes  # the pool holds one buffer per storage, not one per handover
    for t, want in zip(_worker_lists(model, opt), snapshot):
        torch.testing.assert_close(t, want, rtol=0, atol=0)


def test_pool_frees_buffers_no_storage_uses_any_more():
    """Buffers left over when a tensor vanished are freed; a new size gets a new buffer."""
    a, b = torch.arange(6.0), torch.arange(10.0)
    offloader = DeviceStateOffloader()
    offloader.offload([a, b], [])
    offloader.restore()
    assert offloader.host_bytes() == (6 + 10) * 4
    c = torch.arange(3.0)
    offloader.offload([a[:], c], [])
    offloader.restore()
    assert offloader.host_bytes() == (6 + 3) * 4
    torch.testing.assert_close(a, torch.arange(6.0), rtol=0, atol=0)
    torch.testing.assert_close(c, torch.arange(3.0), rtol=0, atol=0)
