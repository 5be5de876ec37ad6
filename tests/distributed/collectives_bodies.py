"""Rank bodies for test_collectives.py: a training step at DP=2 under a checker that plays NCCL on a GPU platform.

On GPU every megatron group is NCCL, which rejects tensors that are not on the rank's CUDA device; on the CPU test
machine gloo takes anything, so a wrongly placed tensor only fails on the first GPU run. `NcclChecker` makes the
mistake visible here:
- `torch.distributed.get_backend` answers "nccl" to megatron_rl/kernels code;
- `Platform.collective_device("nccl")` answers a pretend CUDA device (PRETEND), and a torch function mode creates a
  tensor asked for on PRETEND on the CPU, tagged with it, so the placement decision stays observable;
- the tensor collectives record, for every call made from megatron_rl/kernels code (the first frame outside
  torch.distributed and this module), whether its tensors are on PRETEND; the real gloo collective still runs.
megatron-core's own collectives are not checked: it places its tensors itself.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist

PRETEND = torch.device("cuda", 5)  # "the rank's current CUDA device" in the pretend GPU run
_WATCHED = ("megatron_rl.", "kernels.")
_TENSOR_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
                       "broadcast", "reduce", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
                       "isend", "irecv")


def _caller():
    """(module name, "file:line function") of the first frame outside torch.distributed and this module."""
    f = sys._getframe(2)
    while f is not None and (f.f_globals.get("__name__", "").startswith("torch.distributed")
                             or f.f_globals.get("__name__") == __name__):
        f = f.f_back
    if f is None:
        return "", "?"
    return f.f_globals.get("__name__", ""), f"{f.f_code.co_filename}:{f.f_lineno} {f.f_code.co_name}"


def _tensors(args, kwargs):
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (t for t in a if isinstance(t, torch.Tensor))


def _is_pretend(d) -> bool:
    return isinstance(d, (str, torch.device)) and torch.device(d) == PRETEND


class _PlaceOnPretend(torch.overrides.TorchFunctionMode):
    """A tensor created on, or moved to, PRETEND lands on the CPU and carries `_pretend_device`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        hit = _is_pretend(kwargs.get("device"))
        if hit:
            kwargs["device"] = "cpu"
        if func is torch.Tensor.to and len(args) > 1 and _is_pretend(args[1]):
            hit, args = True, (args[0], "cpu") + tuple(args[2:])
        out = func(*args, **kwargs)
        if hit and isinstance(out, torch.Tensor):
            out._pretend_device = PRETEND
        return out


class NcclChecker:
    """Context manager; `accepted` and `rejected` list the checked calls as 'op file:line function'."""

    def __init__(self):
        self.accepted: list[str] = []
        self.rejected: list[str] = []
        self._saved: dict = {}

    def _wrap(self, name, real):
        def checked(*args, **kwargs):
            module, where = _caller()
            if module.startswith(_WATCHED):
                bad = [str(getattr(t, "_pretend_device", t.device)) for t in _tensors(args, kwargs)
                       if getattr(t, "_pretend_device", t.device) != PRETEND]
                (self.rejected if bad else self.accepted).append(f"{name} {where}" + (f" on {bad}" if bad else ""))
            return real(*args, **kwargs)

        return checked

    def __enter__(self):
        from megatron_rl.platform import Platform, install_megatron_cpu_compat

        # the compat mode first, so that this checker's mode sits above it and sees PRETEND requests first
        install_megatron_cpu_compat()
        real_backend, real_device = dist.get_backend, Platform.collective_device

        def get_backend(group=None):
            return "nccl" if _caller()[0].startswith(_WATCHED) else real_backend(group)

        def collective_device(plat, backend, cuda_index=None):
            return PRETEND if backend == "nccl" else real_device(plat, backend, cuda_index)

        self._saved = {(dist, "get_backend"): real_backend, (Platform, "collective_device"): real_device}
        for name in _TENSOR_COLLECTIVES:
            self._saved[(dist, name)] = getattr(dist, name)
            setattr(dist, name, self._wrap(name, getattr(dist, name)))
        dist.get_backend = get_backend
        Platform.collective_device = collective_device
        self._mode = _PlaceOnPretend()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc):
        self._mode.__exit__(*exc)
        for (owner, name), real in self._saved.items():
            setattr(owner, name, real)
        return False


def train_step_under_nccl_checker(rank: int, world_size: int, model_dir: str):
    """Set-up + one train step at DP=2, a direct helper call, and a deliberately raw reduction, all checked."""
    import json

    from megatron_rl.distributed.collectives import all_reduce_scalars
    from megatron_rl.policy.megatron_worker import MegatronPolicyWorker
    from tests.distributed.policy_bodies import _cfg, make_batch, pg_loss

    vocab = json.load(open(f"{model_dir}/config.json"))["vocab_size"]
    out = {}
    with NcclChecker() as chk:
        w = MegatronPolicyWorker(rank, world_size, policy_cfg=_cfg(model_dir))
        w.setup()
        res = w.train(make_batch(vocab), pg_loss)
        out["train"] = {"accepted": list(chk.accepted), "rejected": list(chk.rejected),
                        "metrics": res and res["metrics"], "dp": w.dp_size}
        n = len(chk.accepted)
        out["helper_dict"] = all_reduce_scalars({"rank": float(rank), "one": 1.0})
        out["helper_list"] = all_reduce_scalars([float(rank) + 1], op="max")
        out["helper_checked"] = chk.accepted[n:], list(chk.rejected)
        # the mistake this test exists for, made from a frame that looks like megatron_rl code: must be rejected
        before = len(chk.rejected)
        wrong = compile("dist.all_reduce(torch.tensor([1.0], dtype=torch.float64))",
                        "megatron_rl/_wrong_reduction.py", "exec")
        exec(wrong, {"__name__": "megatron_rl._wrong_reduction", "dist": dist, "torch": torch})
        out["wrong_rejected"] = chk.rejected[before:]
    return out
