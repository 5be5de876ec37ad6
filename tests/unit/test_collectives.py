"""Collectives land on the device their process group's backend needs.

- the device choice per backend (NCCL: this rank's CUDA device, gloo: CPU) is the platform's;
- a static scan of megatron_rl/ and kernels/: every torch.distributed collective goes through
  megatron_rl/distributed/collectives.py or is in ALLOWED below with the reason it is already device-correct.
The dynamic check (a DP=2 train step under a pretend-NCCL checker) is tests/distributed/test_collectives.py.
"""
from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_rl.distributed.collectives import all_reduce_scalars
from megatron_rl.platform import get_platform

REPO = Path(__file__).resolve().parents[2]
ROOTS = ("megatron_rl", "kernels")
HELPER = "megatron_rl/distributed/collectives.py"
COLLECTIVES = frozenset({
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
    "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base", "all_to_all",
    "all_to_all_single", "broadcast", "reduce", "gather", "scatter", "send", "recv", "isend", "irecv",
    "batch_isend_irecv", "barrier", "monitored_barrier", "all_gather_object", "gather_object", "broadcast_object_list",
    "scatter_object_list", "send_object_list", "recv_object_list",
})
_MODEL_DEVICE = "its tensors come from the model (parameters, logits, grads): already on the device the group needs"
_OBJECT = "object collective: torch serialises to the device the backend needs (NCCL: the current CUDA device, set " \
          "by the worker at set-up)"
# (file, enclosing function, collective) -> why the raw call is device-correct as it stands
ALLOWED = {
    ("kernels/api.py", "_reduce_stats", "all_reduce"): _MODEL_DEVICE + " (row stats of this rank's logit shard)",
    ("kernels/api.py", "_LinearLogprobFn.backward", "all_reduce"): _MODEL_DEVICE + " (dL/dhidden)",
    ("kernels/reference.py", "_GatherVocab.forward", "all_gather"): _MODEL_DEVICE + " (logit shards; test reference)",
    ("megatron_rl/models/mapping.py", "iter_hf_tensors", "all_gather"): _MODEL_DEVICE + " (TP parameter shards)",
    ("megatron_rl/models/lora.py", "adapter_state.gather", "all_gather"):
        _MODEL_DEVICE + " (TP shards of the LoRA adapters, gathered from the parameters themselves)",
    ("megatron_rl/policy/weights_out.py", "WeightsOut.adapter_update", "gather_object"): _OBJECT,
    ("megatron_rl/models/checkpoint.py", "_bcast", "broadcast_object_list"): _OBJECT,
    ("megatron_rl/models/checkpoint.py", "_gather", "all_gather_object"): _OBJECT,
    ("megatron_rl/models/checkpoint.py", "save_checkpoint", "barrier"): "no tensor of ours: torch places the barrier's",
    ("megatron_rl/policy/fsdp2_checkpoint.py", "save_fsdp2_checkpoint", "barrier"):
        "no tensor of ours: torch places the barrier's",
    ("megatron_rl/weights/convert.py", "_launch", "all_gather_object"): _OBJECT + "; the group is gloo here",
    ("megatron_rl/weights/convert.py", "_barrier", "barrier"): "no tensor of ours; the conversion group is gloo",
    ("megatron_rl/weights/convert.py", "megatron_to_hf", "broadcast_object_list"): _OBJECT + "; the group is gloo here",
    ("megatron_rl/policy/weights_out.py", "WeightsOut._all_stage_buckets", "broadcast"):
        "the bucket's flat buffer is made on the worker's device (self.device), the one megatron's pipeline group "
        "(NCCL on GPU, gloo on CPU) moves",
    ("megatron_rl/policy/weights_out.py", "WeightsOut._all_stage_buckets", "broadcast_object_list"): _OBJECT,
    ("megatron_rl/policy/topk.py", "vocab_topk", "all_reduce"):
        _MODEL_DEVICE + " (the teacher's logit statistics over its TP vocabulary shards)",
    ("megatron_rl/policy/topk.py", "vocab_topk", "all_gather"): _MODEL_DEVICE + " (each TP shard's top-k)",
    ("megatron_rl/policy/fsdp2_tp.py", "grad_norm", "all_reduce"):
        "the sums tensor is made on the gradients' device (the rank's GPU under NCCL, CPU under gloo)",
    ("megatron_rl/policy/fsdp2_tp.py", "_CopyToTP.backward", "all_reduce"):
        _MODEL_DEVICE + " (dL/dhidden of the FSDP2 model's vocab-split logits)",
    ("megatron_rl/policy/fsdp2_tp.py", "_ReduceFromTP.forward", "all_reduce"):
        _MODEL_DEVICE + " (an FSDP2 student's top-k distillation logits at the teacher's ids, or a row-parallel LoRA "
                        "adapter's A x: each TP rank's partial)",
    ("megatron_rl/policy/fsdp2_load.py", "load_shards", "broadcast"):
        "each full tensor is made on the worker's device (`device`, the rank's GPU under NCCL) before the broadcast",
    ("megatron_rl/policy/fsdp2_load.py", "load_shards", "broadcast_object_list"): _OBJECT,
    ("megatron_rl/models/cp_attention.py", "_all_gather", "all_gather"):
        _MODEL_DEVICE + " (a context-parallel rank's keys and values, from its attention layer)",
    ("megatron_rl/models/cp_attention.py", "_sum_to_owner", "all_reduce"):
        _MODEL_DEVICE + " (the whole row's key/value gradient, gloo)",
    ("megatron_rl/models/cp_attention.py", "_sum_to_owner", "reduce_scatter_tensor"):
        _MODEL_DEVICE + " (the whole row's key/value gradient, NCCL)",
    ("megatron_rl/policy/context_parallel.py", "_GatherResponses.forward", "all_gather"):
        _MODEL_DEVICE + " (a CP rank's token logprobs or entropies, made from its hidden states)",
    ("megatron_rl/policy/context_parallel.py", "init_cp", "all_gather_object"): _OBJECT,
    ("megatron_rl/policy/fsdp2_sp.py", "_exchange", "all_to_all_single"):
        _MODEL_DEVICE + " (an SP rank's q, k, v or attention output, or their gradients)",
    ("megatron_rl/testing/ray_workers.py", "AllReduceWorker.all_reduce", "all_reduce"):
        "test worker whose group is gloo (init_dist): a CPU tensor is what gloo needs",
}


# ---------------------------------------------------------------------------------------------- device per backend

def _plat(device_type: str):
    return dataclasses.replace(get_platform(), device_type=device_type,
                               dist_backend="nccl" if device_type == "cuda" else "gloo")


def test_device_choice_per_backend():
    gpu, cpu = _plat("cuda"), _plat("cpu")
    assert gpu.collective_device("nccl", cuda_index=3) == torch.device("cuda", 3)
    assert gpu.collective_device("gloo", cuda_index=3) == torch.device("cpu")
    assert cpu.collective_device("gloo") == torch.device("cpu")
    # a per-device backend serves both devices: this platform's then
    assert gpu.collective_device("cpu:gloo,cuda:nccl", cuda_index=1) == torch.device("cuda", 1)
    assert cpu.collective_device("cpu:gloo,cuda:nccl") == torch.device("cpu")
    with pytest.raises(ValueError, match="mpi"):
        cpu.collective_device("mpi")


def test_nccl_device_defaults_to_the_current_cuda_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 6)
    assert _plat("cuda").collective_device("nccl") == torch.device("cuda", 6)


def test_helper_without_a_process_group_keeps_the_shape():
    assert all_reduce_scalars({"b": 2, "a": 1.5}) == {"b": 2.0, "a": 1.5}
    assert all_reduce_scalars((1, 2)) == [1.0, 2.0]
    with pytest.raises(ValueError, match="op must be"):
        all_reduce_scalars([1.0], op="avg")


# --------------------------------------------------------------------------------------------------- static scan

def _aliases(tree: ast.AST) -> tuple[set[str], set[str], dict[str, str]]:
    """(names bound to torch.distributed, names bound to torch, names bound to a collective function)."""
    mods, torches, direct = set(), {"torch"}, {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "torch" and a.asname:
                    torches.add(a.asname)
                elif a.name.startswith("torch.distributed") and a.asname:
                    mods.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                if node.module == "torch" and a.name == "distributed":
                    mods.add(a.asname or a.name)
                elif node.module.startswith("torch.distributed") and a.name in COLLECTIVES:
                    direct[a.asname or a.name] = a.name
    # `def _dist(): return dist if ... else None` then `d = _dist(); d.barrier()`
    returners = {f.name for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)
                 and any(isinstance(r, ast.Return) and r.value is not None
                         and any(isinstance(n, ast.Name) and n.id in mods for n in ast.walk(r.value))
                         for r in ast.walk(f))}
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id in returners):
            mods.update(t.id for t in node.targets if isinstance(t, ast.Name))
    return mods, torches, direct


def find_collective_calls(source: str, filename: str = "<src>") -> list[tuple[int, str, str]]:
    """(line, enclosing function's qualified name, collective) for every torch.distributed collective called."""
    tree = ast.parse(source, filename)
    mods, torches, direct = _aliases(tree)
    found = []

    def name_of(func) -> str | None:
        if isinstance(func, ast.Name):
            return direct.get(func.id)
        if not isinstance(func, ast.Attribute) or func.attr not in COLLECTIVES:
            return None
        v = func.value
        if isinstance(v, ast.Name) and v.id in mods:
            return func.attr
        if (isinstance(v, ast.Attribute) and v.attr in ("distributed", "distributed_c10d")
                and isinstance(v.value, (ast.Name, ast.Attribute))):
            root = v.value
            while isinstance(root, ast.Attribute):
                root = root.value
            return func.attr if isinstance(root, ast.Name) and root.id in torches else None
        return None

    def visit(node, stack):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, stack + [child.name])
                continue
            if isinstance(child, ast.Call) and (name := name_of(child.func)):
                found.append((child.lineno, ".".join(stack) or "<module>", name))
            visit(child, stack)

    visit(tree, [])
    return found


def _scan_repo() -> dict[tuple[str, str, str], list[int]]:
    calls: dict[tuple[str, str, str], list[int]] = {}
    for root in ROOTS:
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            for line, qual, name in find_collective_calls(path.read_text(), rel):
                calls.setdefault((rel, qual, name), []).append(line)
    return calls


def test_scanner_finds_every_spelling():
    src = '''
import torch
import torch.distributed as dist
from torch import distributed as tdist
from torch.distributed import all_gather_object as ago, get_rank

def _dist():
    return dist if dist.is_initialized() else None

class W:
    def f(self, t):
        dist.all_reduce(t)
        tdist.broadcast(t, src=0)
        torch.distributed.barrier()
        ago([None], 1)
        d = _dist()
        d.send(t, 1)

def g(t, comm, sender):
    dist.get_rank(); get_rank(); comm.broadcast(t, src=0); sender.send(t); torch.gather(t, 0, t)
'''
    assert find_collective_calls(src) == [(12, "W.f", "all_reduce"), (13, "W.f", "broadcast"), (14, "W.f", "barrier"),
                                          (15, "W.f", "all_gather_object"), (17, "W.f", "send")]


def test_no_raw_collective_outside_the_helper():
    calls = _scan_repo()
    assert any(k[0] == HELPER for k in calls), "the scan no longer sees the helper's own all_reduce"
    bad = [f"{rel}:{line} in {qual}(): torch.distributed.{name}" for (rel, qual, name), lines in sorted(calls.items())
           if rel != HELPER and (rel, qual, name) not in ALLOWED for line in lines]
    assert not bad, ("raw torch.distributed collectives outside megatron_rl/distributed/collectives.py (NCCL rejects "
                     "tensors off the rank's GPU): use all_reduce_scalars, or add the call to ALLOWED in "
                     "tests/unit/test_collectives.py with the reason it is device-correct:\n  " + "\n  ".join(bad))


def test_allowlist_has_no_stale_entries():
    calls = _scan_repo()
    assert not [k for k in ALLOWED if k not in calls], "ALLOWED names calls that no longer exist"
