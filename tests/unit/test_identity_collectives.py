"""megatron's gradient reduce-scatter and parameter all-gather over one rank on the same buffer are skipped (no
copies), and every other call still reaches gloo (`megatron_rl/policy/identity_collectives.py`)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from megatron_rl.policy import identity_collectives


@pytest.fixture
def one_rank_gloo(tmp_path):
    if dist.is_initialized():
        pytest.fail("a process group is already initialised in this test process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    from megatron.core.distributed import param_and_grad_buffer as pgb

    saved = pgb.dist_reduce_scatter_func, pgb.dist_all_gather_func
    identity_collectives.install()
    wrapped = pgb.dist_reduce_scatter_func, pgb.dist_all_gather_func
    identity_collectives.install()
    assert (pgb.dist_reduce_scatter_func, pgb.dist_all_gather_func) == wrapped  # idempotent: wraps once
    yield pgb
    pgb.dist_reduce_scatter_func, pgb.dist_all_gather_func = saved
    dist.destroy_process_group()


def _copies(fn) -> int:
    with profile(activities=[ProfilerActivity.CPU]) as p:
        fn()
    return sum(e.count for e in p.key_averages() if e.key in ("aten::copy_", "aten::clone"))


def test_one_rank_in_place_collectives_are_skipped_and_others_still_run(one_rank_gloo):
    pgb = one_rank_gloo
    grad = torch.randn(1 << 16)
    param = torch.randn(1 << 16).bfloat16()
    want_g, want_p = grad.clone(), param.clone()
    # megatron at DP=1: the rank's shard is the whole buffer (a view of the same memory)
    assert _copies(lambda: pgb.dist_reduce_scatter_func(grad[:], grad, op=dist.ReduceOp.SUM, group=None)) == 0
    assert _copies(lambda: pgb.dist_all_gather_func(param, param[:], group=None)) == 0
    assert torch.equal(grad, want_g) and torch.equal(param, want_p)
    # separate buffers: gloo runs (over one rank the output receives the input)
    out = torch.zeros_like(grad)
    assert _copies(lambda: pgb.dist_reduce_scatter_func(out, grad, op=dist.ReduceOp.SUM, group=None)) > 0
    assert torch.equal(out, grad)
    gathered = torch.zeros_like(param)
    pgb.dist_all_gather_func(gathered, param, group=None)
    assert torch.equal(gathered, param)
    # the unwrapped gloo reduce-scatter on the shared buffer does copy: what the wrapper saves
    assert _copies(lambda: dist.reduce_scatter_tensor(grad[:], grad, group=None)) > 0
