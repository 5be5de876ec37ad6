"""LoRA on the FSDP2 backend (`policy.lora` with `policy.backend: fsdp2`, docs/lora.md): adapters on transformers'
own nn.Linear modules, whatever the architecture (Phi-3's fused `qkv_proj` takes one adapter, as PEFT gives it).

Each adapted linear gets a child module `lora` with A [r, in] and B [out, r]; hooks add (alpha / r) * B A dropout(x)
to the linear's output, so the HF forward, transformers' recompute and the packing masks run as without LoRA, and the
base parameters keep their names (the export, the checkpoints and the KL reference's swap read them). The base is
frozen (requires_grad False) before `fully_shard`: FSDP still gathers it for the forward, but gives it no gradient,
and the optimizer holds the adapters only. A and B start as PEFT's do (A kaiming-uniform, B zero), drawn at full
shape from one generator per (seed, layer, module), so every DP/TP layout starts from the same adapters.

Tensor parallelism (policy/fsdp2_tp.py splits the projections first; the adapters are added after it, since DTensor's
`parallelize_module` would shard every parameter of a child module as it shards the weight):
- column-parallel base (Shard(0) weight: q/k/v, gate/up): A replicated over TP, B split by rows like the weight.
  u = A x runs in full on every rank and passes `copy_to_tp` (identity forward, gradient summed over TP backward),
  so A's gradient, and the gradient A sends to x, is whole on every rank.
- row-parallel base (Shard(1) weight: o, down): A split by columns like the weight's input, B replicated. The
  partial u = A_r x_r is summed over TP (`reduce_from_tp`) at width r, then B applies on every rank.
The hooks read the linear's input as the layer received it (a pre-hook placed before DTensor's own input hook): a
plain local tensor, whole (column) or this rank's columns (row). The adapters are DTensors on the TP mesh (Replicate
or Shard like above) so that FSDP shards them over dp x tp as the base, and the gradient norm counts each once;
inside the forward they are used as local tensors.
"""
from __future__ import annotations

import math
import zlib
from contextlib import contextmanager

import torch
from torch import nn

from megatron_rl.models.hf_layers import is_moe, linear_paths
from megatron_rl.models.lora_targets import peft_hf_name, select_hf_linears

ADAPTER_KEY = ".lora."  # in every adapter parameter's name: `<module path>.lora.A`


class HFAdapter(nn.Module):
    def __init__(self, path: str, in_features: int, out_features: int, rank: int, alpha: float, dropout: float):
        super().__init__()
        self.path = path  # the adapted module under the HF model: model.layers.0.self_attn.q_proj
        self.rank, self.scale = rank, alpha / rank
        self.A = nn.Parameter(torch.zeros(rank, in_features))
        self.B = nn.Parameter(torch.zeros(out_features, rank))
        self.dropout = nn.Dropout(dropout) if dropout > 0 else None
        self.kind: str | None = None  # "column" / "row" under TP (module doc), None without it
        self.tp_group = None
        self.enabled = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron_rl.policy.fsdp2_tp import copy_to_tp, reduce_from_tp

        a, b = (p.to_local() if hasattr(p, "to_local") else p for p in (self.A, self.B))
        if self.dropout is not None:
            x = self.dropout(x)
        u = nn.functional.linear(x, a)
        if self.kind == "column":
            u = copy_to_tp(u, self.tp_group)
        elif self.kind == "row":
            u = reduce_from_tp(u, self.tp_group)
        return nn.functional.linear(u, b) * self.scale


def _keep_input(module, args):
    module.lora.__dict__["_x"] = args[0]  # the input before DTensor's hook (module doc); a plain attribute


def _add_adapter(module, args, output):
    ad = module.lora
    x = ad.__dict__.pop("_x")
    if not ad.enabled:
        return output
    return output + ad(x).to(output.dtype)


def install(lm: nn.Module, layers: nn.ModuleList, lora_cfg, seed: int, tp_mesh=None) -> list[HFAdapter]:
    """Adapters on the `policy.lora.target_modules` linears of every decoder layer (after TP, before fully_shard);
    everything else frozen. Returns them in module order (the same on every rank)."""
    paths = select_hf_linears(lora_cfg.target_modules, linear_paths(layers), is_moe(lm.config))
    names = {id(m): n for n, m in lm.named_modules()}
    out = []
    lm.requires_grad_(False)
    for layer in layers:
        for path in paths:
            try:
                linear = layer.get_submodule(path)
            except AttributeError:  # a path of other layers (dense and MoE layers mixed)
                continue
            ad = HFAdapter(names[id(linear)], linear.in_features, linear.out_features, lora_cfg.rank,
                           lora_cfg.alpha, lora_cfg.dropout)
            _initial(ad, seed)
            ad.to(next(iter(linear.parameters())).device)
            if tp_mesh is not None:
                _split(ad, linear, tp_mesh)
            linear.lora = ad
            linear.register_forward_pre_hook(_keep_input, prepend=True)
            linear.register_forward_hook(_add_adapter)
            out.append(ad)
    return out


def _initial_a(path: str, shape, seed: int) -> torch.Tensor:
    """PEFT's default start of A: U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform with a = sqrt(5)); B starts at zero."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(path.encode()))
    return (torch.rand(tuple(shape), generator=g) * 2 - 1) * (1.0 / math.sqrt(shape[1]))


@torch.no_grad()
def _initial(ad: HFAdapter, seed: int) -> None:
    ad.A.copy_(_initial_a(ad.path, ad.A.shape, seed))  # on a meta model, again after fully_shard (initial_values)


def initial_values(adapters: list[HFAdapter], seed: int) -> dict[str, torch.Tensor]:
    """{HF-relative name: full initial tensor} of every adapter, for `fsdp2_load.load_shards` (the same on every
    rank, so every DP/TP layout starts from the same adapters)."""
    out = {}
    for ad in adapters:
        out[f"{ad.path}.lora.A"] = _initial_a(ad.path, ad.A.shape, seed)
        out[f"{ad.path}.lora.B"] = torch.zeros(tuple(ad.B.shape))
    return out


def _split(ad: HFAdapter, linear: nn.Linear, tp_mesh) -> None:
    """The adapters' TP layout from the base weight's placement (module doc)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    placement = getattr(linear.weight, "placements", (Replicate(),))[0]
    if isinstance(placement, Shard):
        ad.kind = "column" if placement.dim == 0 else "row"
        ad.tp_group = tp_mesh.get_group()
    a_place = Shard(1) if ad.kind == "row" else Replicate()
    b_place = Shard(0) if ad.kind == "column" else Replicate()
    ad.A = nn.Parameter(distribute_tensor(ad.A.data, tp_mesh, [a_place]))
    ad.B = nn.Parameter(distribute_tensor(ad.B.data, tp_mesh, [b_place]))


def _peft(param_name: str, prefix: str) -> str:
    """`lm.model.layers.0.self_attn.q_proj.lora.A` -> PEFT's saved name of it."""
    path, matrix = param_name[len(prefix):].rsplit(ADAPTER_KEY, 1)
    return peft_hf_name(path, matrix)


@torch.no_grad()
def adapter_state(model: nn.Module, prefix: str, grads: bool = False, on_host: bool = True) -> dict[str, torch.Tensor]:
    """Every adapter (or its gradient) at full shape in PEFT's names, in fp32 on the CPU (`on_host=False`: on the
    adapters' device, for the merge, `lora.merged`), on every rank (collective over all ranks: each tensor is
    gathered over dp x tp)."""
    out = {}
    for name, p in model.named_parameters():
        if ADAPTER_KEY in name:
            t = p.grad if grads else p
            full = t.full_tensor() if hasattr(t, "full_tensor") else t
            # a copy: a gather over one shard (a replicated adapter) is the parameter itself, which the next step
            # changes in place
            out[_peft(name, prefix)] = full.detach().to("cpu" if on_host else full.device, torch.float32, copy=True)
    return out


def load_adapter_state(model: nn.Module, prefix: str, state: dict[str, torch.Tensor]) -> None:
    """Full PEFT-named adapters (PEFT's own, another run's) into the sharded model; collective. Every adapter of the
    model must be in `state`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    names = [n for n, _ in model.named_parameters() if ADAPTER_KEY in n]
    missing = [_peft(n, prefix) for n in names if _peft(n, prefix) not in state]
    if missing:
        raise KeyError(f"no adapter tensor for {', '.join(missing[:3])}{' ...' if len(missing) > 3 else ''}")
    full = {n: state[_peft(n, prefix)] for n in names}
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))


def merges(adapters: list[HFAdapter], state: dict[str, torch.Tensor]) -> dict[str, tuple]:
    """{HF weight name: (A, B, scale)} of every adapted weight, from `adapter_state`'s tensors."""
    return {f"{ad.path}.weight": (state[peft_hf_name(ad.path, "A")], state[peft_hf_name(ad.path, "B")], ad.scale)
            for ad in adapters}


def target_names(adapters: list[HFAdapter]) -> list[str]:
    """adapter_config.json's target_modules: the adapted modules' own names (PEFT matches them by suffix)."""
    return sorted({ad.path.rsplit(".", 1)[-1] for ad in adapters})


@contextmanager
def disabled(adapters: list[HFAdapter]):
    """The base model (the KL reference): every adapter's term left out, no copy of the weights."""
    saved = [ad.enabled for ad in adapters]
    for ad in adapters:
        ad.enabled = False
    try:
        yield
    finally:
        for ad, on in zip(adapters, saved):
            ad.enabled = on
