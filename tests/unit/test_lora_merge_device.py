"""The merged LoRA refit computes W + scale B A on W's device (issue 54, item 6): the adapters travel to the weight,
never a W-sized product from the host. The weights and adapters live on `meta`, which has no data: any matmul that
ran on the CPU instead shows in the recorded ops (and a host copy of a meta tensor fails outright)."""
from __future__ import annotations

from unittest import mock

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_rl.models import lora
from megatron_rl.models.lora_targets import TARGETS, hf_weight_name

OUT, IN, RANK = 48, 32, 4


class _OpDevices(TorchDispatchMode):
    """Every aten op run, with the devices of its tensor outputs."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple[str, set[str], int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        tensors = [t for t in outs if isinstance(t, torch.Tensor)]
        self.ops.append((func.overloadpacket.__name__, {t.device.type for t in tensors},
                         max((t.numel() for t in tensors), default=0)))
        return out


def _adapters(device):
    """One row-parallel linear (o_proj) of layer 0 with its adapter, at TP = 1."""
    ad = lora.Adapters("row", [TARGETS["o_proj"]], [OUT], 1, IN, RANK, alpha=8.0, dropout=0.0, tp=1,
                       dtype=torch.bfloat16, device=device)
    return [(0, ad)]


def test_megatron_merge_runs_on_the_weights_device():
    adapters = _adapters("meta")
    w = torch.empty(OUT, IN, dtype=torch.bfloat16, device="meta")
    name = hf_weight_name(0, TARGETS["o_proj"])
    with mock.patch.object(lora, "_tp", lambda: (0, 1)), _OpDevices() as rec:
        (out_name, out), = list(lora.merged_hf_tensors(adapters, iter([(name, w)])))
    assert out_name == name and out.device.type == "meta" and out.dtype == torch.bfloat16
    matmuls = [op for op in rec.ops if op[0] in ("mm", "addmm", "addmm_", "matmul", "bmm")]
    assert matmuls and all(devices == {"meta"} for _, devices, _ in matmuls), matmuls
    on_host = [op for op in rec.ops if "cpu" in op[1]]
    assert not on_host, on_host  # nothing, not even the adapters, went through host memory


def test_host_adapters_move_to_the_weight_not_the_product_to_the_device():
    """Adapters handed over on the host (a caller's `adapter_state` default): only they travel, r x (in + out)
    values, and the matmul still runs where W is."""
    w = torch.empty(OUT, IN, dtype=torch.bfloat16, device="meta")
    a, b = torch.randn(RANK, IN), torch.randn(OUT, RANK)
    with _OpDevices() as rec:
        (_, out), = list(lora.merged(iter([("w", w)]), {"w": (a, b, 2.0)}))
    assert out.device.type == "meta"
    matmuls = [op for op in rec.ops if op[0] in ("mm", "addmm", "addmm_", "matmul", "bmm")]
    assert matmuls and all(devices == {"meta"} for _, devices, _ in matmuls), matmuls
    host_sized = [op for op in rec.ops if "cpu" in op[1] and op[2] > RANK * max(IN, OUT)]
    assert not host_sized, host_sized  # no W-sized tensor was made on the host


def test_fsdp2_adapter_state_for_the_merge_stays_on_device():
    from megatron_rl.policy import fsdp2_lora

    params = torch.nn.ParameterDict({"A": torch.nn.Parameter(torch.empty(RANK, IN, device="meta")),
                                     "B": torch.nn.Parameter(torch.empty(OUT, RANK, device="meta"))})
    holder = torch.nn.Module()
    holder.lora = params
    root = torch.nn.Module()
    root.q_proj = holder
    state = fsdp2_lora.adapter_state(root, "", on_host=False)
    assert state and all(t.device.type == "meta" and t.dtype == torch.float32 for t in state.values())


def test_merge_matches_an_independent_fp64_reference():
    """On CPU weights, the same function against W + scale B A in fp64, for a bf16 and an fp32 weight; an fp32
    weight must come back as a new tensor (the model's own is untouched)."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(RANK, IN, generator=g), torch.randn(OUT, RANK, generator=g)
    for dtype in (torch.bfloat16, torch.float32):
        w = torch.randn(OUT, IN, generator=g).to(dtype)
        before = w.clone()
        (_, got), = list(lora.merged(iter([("w", w)]), {"w": (a.to(dtype), b.to(dtype), 0.5)}))
        want = (w.double() + 0.5 * b.to(dtype).double() @ a.to(dtype).double()).to(dtype)
        tol = dict(rtol=1e-6, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(got, want, **tol)
        assert torch.equal(w, before) and got.dtype == dtype
