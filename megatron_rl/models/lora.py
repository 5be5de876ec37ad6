"""LoRA adapters on megatron-core's tensor-parallel linears (`policy.lora`, docs/lora.md).

Each adapted HF projection p (models/lora_targets.py) gets its own A_p [r, in] and B_p [out_p, r]; the linear's
output gains (alpha / r) * B_p A_p dropout(x) in p's rows. The base linear is untouched: a forward hook adds the
adapters' term to its output, so megatron's own forward, recompute, packing and pipeline code run as without LoRA,
and the parameter names of the base weights (which `models/mapping.py` and the checkpoints use) do not change.

Tensor parallelism (no sequence parallelism; the worker never turns it on):
- column-parallel base (linear_qkv, linear_fc1; output rows split): A replicated, B split like p's output rows.
  Every rank computes u = A x in full, so u passes `copy_to_tensor_model_parallel_region` (identity forward,
  all-reduce backward): each rank's B shard contributes only its part of du, and the sum makes A's gradient (and
  the gradient A sends to x) whole and the same on every rank. The base linear all-reduces its own input gradient.
- row-parallel base (linear_proj, linear_fc2; input columns split): A split like the input columns, B replicated.
  Each rank's A x_r is a partial sum, all-reduced (`reduce_from_tensor_model_parallel_region`) at width r instead of
  the output's width; then B applies on every rank. The gradient reaching u is the same on every rank, so B's is
  too, and A's shard gets exactly its columns' part.
The fused outputs interleave projections (mapping.py's qkv: per query group [q heads; k; v]; fc1: [gate_r; up_r]
per rank), so B_p's rows are laid into p's positions, zeros where a projection has no adapter.

Adapters are model parameters like the rest (DDP buckets, the distributed optimizer, mixed precision: their fp32
main copies); the base weights are frozen before DDP is built (requires_grad False), so megatron gives them neither
gradient buffers nor optimizer state. A and B are initialised as PEFT does (A kaiming-uniform, B zero), from one
seeded generator over the full HF-shaped A, so the start does not depend on the TP layout.
"""
from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Iterator

import torch

from megatron_rl.models.lora_targets import Target, hf_weight_name, peft_name, resolve_targets


class Adapters(torch.nn.Module):
    """The adapters of one megatron linear: `A[p]`, `B[p]` for each adapted projection p, local TP shards."""

    def __init__(self, kind: str, targets: list[Target], slot_sizes: list[int], groups: int, in_local: int,
                 rank: int, alpha: float, dropout: float, tp: int, dtype: torch.dtype, device):
        from megatron.core.tensor_parallel import set_tensor_model_parallel_attributes

        super().__init__()
        self.kind, self.targets, self.rank, self.scale = kind, targets, rank, alpha / rank
        self.slot_sizes, self.groups = slot_sizes, groups  # local output sizes of every slot of the fused output
        self.dropout = torch.nn.Dropout(dropout) if dropout > 0 else None
        self.enabled = True
        self.A, self.B = torch.nn.ParameterDict(), torch.nn.ParameterDict()
        out_full = sum(slot_sizes)
        for t in targets:
            out = slot_sizes[t.slot] if kind == "column" else out_full
            self.A[t.hf] = torch.nn.Parameter(torch.zeros(rank, in_local, dtype=dtype, device=device))
            self.B[t.hf] = torch.nn.Parameter(torch.zeros(out, rank, dtype=dtype, device=device))
            if tp > 1:  # tagged like the base: grad-norm and clipping count a split tensor once per shard
                split, dim = (self.B[t.hf], 0) if kind == "column" else (self.A[t.hf], 1)
                set_tensor_model_parallel_attributes(split, is_parallel=True, dim=dim, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel import (copy_to_tensor_model_parallel_region,
                                                   reduce_from_tensor_model_parallel_region)

        if self.dropout is not None:
            x = self.dropout(x)
        names = [t.hf for t in self.targets]
        # one GEMM for all of this linear's A (q, k and v share the input)
        u = torch.nn.functional.linear(x, torch.cat([self.A[n] for n in names]))
        if self.kind == "row":
            u = reduce_from_tensor_model_parallel_region(u)
            return torch.nn.functional.linear(u, self.B[names[0]]) * self.scale
        u = copy_to_tensor_model_parallel_region(u)
        parts: list[torch.Tensor | None] = [None] * len(self.slot_sizes)
        for t, u_p in zip(self.targets, u.split(self.rank, dim=-1)):
            parts[t.slot] = torch.nn.functional.linear(u_p, self.B[t.hf]) * self.scale
        lead = u.shape[:-1]
        g = self.groups
        # interleave per group (qkv: [q heads; k; v] per query group; fc1: one group, [gate; up])
        slots = [(p if p is not None else u.new_zeros(*lead, size)).reshape(*lead, g, size // g)
                 for p, size in zip(parts, self.slot_sizes)]
        return torch.cat(slots, dim=-1).reshape(*lead, sum(self.slot_sizes))


def _hook(module, args, output):
    ad = module.lora
    if not ad.enabled:
        return output
    x = args[0]
    if hasattr(module, "layer_norm_weight"):  # transformer-engine's fused norm+linear: the adapter sees the norm too
        x = _rms_norm(x, module.layer_norm_weight, module.config)
    out, bias = output
    return out + ad(x).to(out.dtype), bias


def _rms_norm(x, weight, config):
    """The RMSNorm a TE LayerNormLinear applies before its GEMM (the local spec has it as a separate module)."""
    w = weight + 1 if config.layernorm_zero_centered_gamma else weight
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + config.layernorm_epsilon)).to(x.dtype) * w


def _with_adapter_sharding(linear, kind: str) -> None:
    """The base's `sharded_state_dict` marks tensors it does not know as replicated; declare the adapters' TP split
    (column: B by rows, row: A by columns) so that checkpoints save and load them per shard."""
    from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

    axes = {"weight": 0, "bias": 0} if kind == "column" else {"weight": 1}
    split, dim = ("B", 0) if kind == "column" else ("A", 1)
    axes.update({f"lora.{split}.{t.hf}": dim for t in linear.lora.targets})

    def sharded_state_dict(prefix="", sharded_offsets=(), metadata=None):
        state = linear.state_dict(prefix="", keep_vars=True)
        return make_sharded_tensors_for_checkpoint(state, prefix, axes, sharded_offsets, tp_group=linear.tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))

    linear.sharded_state_dict = sharded_state_dict


def install_lora(gpt, lora_cfg, hf_config: dict, seed: int) -> list[tuple[int, Adapters]]:
    """Add adapters to this rank's model, freeze everything else, initialise A and B. Returns (global layer index,
    adapters) for every adapted linear, in a fixed order (the same on every rank of a stage)."""
    from megatron.core import parallel_state as ps

    targets = resolve_targets(lora_cfg.target_modules, hf_config)  # ValueError naming policy.lora.target_modules
    cfg = gpt.config
    if cfg.sequence_parallel:
        raise ValueError("policy.lora: adapters are not wired for sequence parallelism (off in megatron-rl)")
    spec = gpt.megatron_rl_spec
    tp = ps.get_tensor_model_parallel_world_size()
    by_module: dict[str, list[Target]] = {}
    for t in targets:
        by_module.setdefault(t.module, []).append(t)
    ng = spec.num_kv_heads // tp
    dtype = next(gpt.parameters()).dtype
    out = []
    for layer in gpt.decoder.layers:
        for path, ts in by_module.items():
            linear = layer.get_submodule(path)
            w = linear.weight
            kind = ts[0].kind
            if path.endswith("linear_qkv"):
                d = spec.head_dim
                sizes, groups = [ng * spec.queries_per_group * d, ng * d, ng * d], ng
            elif path.endswith("linear_fc1"):
                sizes, groups = [w.shape[0] // 2] * 2, 1
            else:
                sizes, groups = [w.shape[0]], 1
            linear.lora = Adapters(kind, ts, sizes, groups, w.shape[1], lora_cfg.rank, lora_cfg.alpha,
                                   lora_cfg.dropout, tp, dtype, w.device)
            linear.register_forward_hook(_hook)
            _with_adapter_sharding(linear, kind)
            out.append((layer.layer_number - 1, linear.lora))
    for name, p in gpt.named_parameters():
        p.requires_grad_(".lora." in name)
    if cfg.recompute_granularity is not None and getattr(gpt, "embedding", None) is not None:
        # megatron's recompute checkpoints each layer's input; with the embedding frozen that input needs no grad,
        # so the checkpointed layers would run backward-less and the adapters in them get no gradient. (Later
        # pipeline stages receive their input with requires_grad set.)
        gpt.embedding.register_forward_hook(lambda _m, _a, out: out.requires_grad_(True))
    load_adapter_state(out, initial_adapter_state(out, spec, seed))
    return out


def initial_adapter_state(adapters, spec, seed: int) -> dict[str, torch.Tensor]:
    """PEFT's default start in PEFT's names: A ~ U(-1/sqrt(in), 1/sqrt(in)) (kaiming-uniform with a = sqrt(5)), B = 0;
    one generator per (seed, layer, projection), drawn at full HF shape, so every TP layout starts the same."""
    state = {}
    for i, ad in adapters:
        for k, t in enumerate(ad.targets):
            a_in, b_out = full_shapes(ad, t, spec)
            g = torch.Generator().manual_seed(seed * 1_000_003 + i * 101 + k + 1)
            bound = 1.0 / math.sqrt(a_in)
            state[peft_name(i, t, "A")] = (torch.rand(ad.rank, a_in, generator=g) * 2 - 1) * bound
            state[peft_name(i, t, "B")] = torch.zeros(b_out, ad.rank)
    return state


def full_shapes(ad: Adapters, t: Target, spec) -> tuple[int, int]:
    """(A's input width, B's output height) of projection t at full (HF) size."""
    h, d = spec.hidden_size, spec.head_dim
    out = {"q_proj": spec.num_heads * d, "k_proj": spec.num_kv_heads * d, "v_proj": spec.num_kv_heads * d,
           "o_proj": h, "gate_proj": spec.ffn_hidden_size, "up_proj": spec.ffn_hidden_size, "down_proj": h}[t.hf]
    a_in = {"o_proj": spec.num_heads * d, "down_proj": spec.ffn_hidden_size}.get(t.hf, h)
    return a_in, out


def _tp():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()


@torch.no_grad()
def load_adapter_state(adapters, state: dict[str, torch.Tensor]) -> None:
    """Full HF-shaped A/B in PEFT's names → this rank's shards (column: B by rows; row: A by columns)."""
    r, tp = _tp()
    for i, ad in adapters:
        for t in ad.targets:
            a, b = state[peft_name(i, t, "A")], state[peft_name(i, t, "B")]
            if ad.kind == "column":
                b = b.chunk(tp, dim=0)[r]
            else:
                a = a.chunk(tp, dim=1)[r]
            ad.A[t.hf].copy_(a)
            ad.B[t.hf].copy_(b)


@torch.no_grad()
def adapter_state(adapters, grads: bool = False, on_host: bool = True) -> dict[str, torch.Tensor]:
    """This stage's adapters (or their gradients: DDP's main_grad) at full HF shape in PEFT's names, on the CPU
    (`on_host=False`: copies on the adapters' own device, for the merge). Collective over the TP group: every rank
    of the stage calls it and gets the whole tensors."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    _, tp = _tp()
    group = ps.get_tensor_model_parallel_group() if tp > 1 else None

    def value(p):
        if not grads:
            return p
        g = getattr(p, "main_grad", None)
        return g if g is not None else p.grad

    def gather(t, dim):
        if tp == 1:
            return t.detach().clone()
        parts = [torch.empty_like(t) for _ in range(tp)]
        dist.all_gather(parts, t.detach().contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    out = {}
    for i, ad in adapters:
        for t in ad.targets:
            a, b = value(ad.A[t.hf]), value(ad.B[t.hf])
            if ad.kind == "column":
                a, b = a.detach().clone(), gather(b, 0)
            else:
                a, b = gather(a, 1), b.detach().clone()
            out[peft_name(i, t, "A")], out[peft_name(i, t, "B")] = (a.cpu(), b.cpu()) if on_host else (a, b)
    return out


def merged_hf_tensors(adapters, items: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF export with every adapted weight merged: W + (alpha / r) B A, computed in fp32 and cast to W's dtype
    (the refit and the merged export stream these). Gathers the (small) adapters first, then follows `items`, so
    the TP collectives of both run in the same order on every rank. The adapters stay on their device (see
    `merged`)."""
    state = adapter_state(adapters, on_host=False)
    yield from merged(items, {hf_weight_name(i, t): (state[peft_name(i, t, "A")], state[peft_name(i, t, "B")],
                                                     ad.scale) for i, ad in adapters for t in ad.targets})


def merged(items: Iterator[tuple[str, torch.Tensor]], merge: dict[str, tuple]) -> Iterator[tuple[str, torch.Tensor]]:
    """`items` ((name, W, ...) tuples) with each weight named in `merge` ({name: (A, B, scale)}) replaced by
    W + scale B A, computed in fp32 and cast to W's dtype (both backends' merged export and refit).

    The product is computed where W is: the adapters (r x (in + out) values) move to W's device, never W-sized
    data to the host. Merging on the host cost every exporting rank, at every refit, a CPU matmul per adapted
    weight and a host-to-device copy of each fp32 product (for 7B all-linear at rank 64: ~0.8 TFLOP, ~26 GB)."""
    for name, w, *rest in items:
        if name in merge:
            a, b, scale = merge[name]
            a, b = a.to(w.device, torch.float32), b.to(w.device, torch.float32)
            # a copy even when W is fp32 already: the in-place add must not reach the model's own weight
            w = w.to(torch.float32, copy=True).addmm_(b, a, alpha=scale).to(w.dtype)
        yield name, w, *rest


@contextmanager
def adapters_disabled(adapters):
    """The base model: every adapter's term left out (the KL reference, with no second copy of the weights)."""
    saved = [ad.enabled for _, ad in adapters]
    for _, ad in adapters:
        ad.enabled = False
    try:
        yield
    finally:
        for (_, ad), on in zip(adapters, saved):
            ad.enabled = on
