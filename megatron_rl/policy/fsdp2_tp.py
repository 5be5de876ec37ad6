"""Tensor parallelism for the FSDP2 backend (`policy.tp` > 1 with `policy.backend: fsdp2`): DTensor's
`parallelize_module` on the HF model's own projections, Megatron's split, before `fully_shard` takes the other mesh
dimension (2-D: dp x tp).

- Attention: q/k/v column-parallel (each TP rank holds whole heads: transformers reshapes with -1 heads, so a rank's
  attention runs on its heads unchanged), o row-parallel (its output all-reduced). MLP: gate/up column-parallel,
  down row-parallel. DTensor's autograd gives the all-reduce of the input gradient of the column-parallel layers.
- Vocabulary: the embedding row-parallel (each rank holds a vocab slice; its lookups all-reduced) and the lm_head
  weight the same slice (Shard(0)); the scorer hands that local slice and its offset to the TP-aware logprob kernel,
  which all-reduces per-token statistics only and sums the hidden gradient over TP. Tied embeddings stay one
  parameter (re-tied after the embedding is distributed).
- What a split cannot express is refused by name: fused projections (Phi-3's qkv_proj), a q/k norm over all heads
  (OLMo-2's: each rank would normalise over its heads only), head or vocabulary counts not divisible by TP.

Gradient norms mix meshes (FSDP-only parameters live on the dp mesh, TP ones on dp x tp), which torch's
`get_total_norm` cannot stack: `grad_norm` sums squares locally and all-reduces once, dividing what is replicated
over TP by the TP size.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

ATTN = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}
MLP = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}


def check_tp(lm: nn.Module, layers: nn.ModuleList, tp: int) -> None:
    """Refuse a model this split would get wrong, naming what and where."""
    cfg, name = lm.config, type(lm).__name__
    counts = {"num_attention_heads": cfg.num_attention_heads,
              "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
              "intermediate_size": getattr(cfg, "intermediate_size", 0), "vocab_size": cfg.vocab_size}
    for key, n in counts.items():
        if n % tp:
            raise ValueError(f"policy.tp={tp}: {name}'s {key}={n} is not divisible by it (config.json)")
    if lm.get_output_embeddings().bias is not None:
        raise ValueError(f"policy.tp={tp}: {name}'s lm_head has a bias, which the vocab split does not shard: use "
                         "policy.tp=1")
    layer = layers[0]
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    missing = [f"self_attn.{k}" for k in ATTN if not isinstance(getattr(attn, k, None), nn.Linear)] + \
              [f"mlp.{k}" for k in MLP if not isinstance(getattr(mlp, k, None), nn.Linear)]
    if missing:
        raise ValueError(f"policy.tp={tp}: {name}'s decoder layer has no {', '.join(missing)} (fused or other "
                         "projections): run it with policy.tp=1 (data parallelism) on this backend")
    head_dim = attn.q_proj.out_features // cfg.num_attention_heads
    for norm in ("q_norm", "k_norm"):
        w = getattr(getattr(attn, norm, None), "weight", None)
        if w is not None and w.numel() != head_dim:
            raise ValueError(f"policy.tp={tp}: {name}'s self_attn.{norm} normalises across all heads "
                             f"({w.numel()} features); a TP rank holds only its heads: use policy.tp=1")


def parallelize(lm: nn.Module, layers: nn.ModuleList, tp_mesh) -> None:
    """Split `lm` over `tp_mesh` in place (before fully_shard)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    style = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = {f"self_attn.{k}": style[v]() for k, v in ATTN.items()} | {f"mlp.{k}": style[v]() for k, v in MLP.items()}
    for layer in layers:
        parallelize_module(layer, tp_mesh, plan)
    emb, head = lm.get_input_embeddings(), lm.get_output_embeddings()
    tied = head.weight is emb.weight
    # vocab-sharded lookup of every rank's whole ids (RowwiseParallel's default input would be a sequence shard),
    # Partial -> all-reduced output
    parallelize_module(emb, tp_mesh, RowwiseParallel(input_layouts=Replicate()))
    if tied:
        head.weight = emb.weight
    else:
        head.weight = nn.Parameter(distribute_tensor(head.weight.data, tp_mesh, [Shard(0)]))


def _replicated_over_tp(g) -> bool:
    from torch.distributed.tensor import Replicate

    if not hasattr(g, "placements"):
        return True
    names = g.device_mesh.mesh_dim_names or ()
    if "tp" not in names:
        return True
    return isinstance(g.placements[names.index("tp")], Replicate)


def grad_norm(grads: list[torch.Tensor], tp_size: int) -> float:
    """The global L2 norm of gradients spread over dp x tp (module doc)."""
    dev = grads[0].to_local().device if hasattr(grads[0], "to_local") else grads[0].device
    sums = torch.zeros(2, dtype=torch.float64, device=dev)  # [split over tp, replicated over tp]
    for g in grads:
        local = g.to_local() if hasattr(g, "to_local") else g
        sums[int(_replicated_over_tp(g))] += local.double().pow(2).sum()
    dist.all_reduce(sums)  # the world: every dp shard and tp slice once, the replicated part tp times
    return float((sums[0] + sums[1] / tp_size).sqrt())


def vocab_slice(weight) -> tuple[torch.Tensor, int]:
    """(this rank's lm_head rows, their first vocabulary id) of the Shard(0) DTensor weight (inside FSDP's forward:
    the dp dimension gathered, the tp one still split)."""
    local = weight.to_local()
    return local, weight.device_mesh.get_local_rank("tp") * local.shape[0]


class _CopyToTP(torch.autograd.Function):
    """Identity forward, gradient summed over the TP group backward (Megatron's "f"): the replicated hidden states
    before a vocab-split matmul whose per-rank gradients are partial sums."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


def copy_to_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _CopyToTP.apply(x, group)


class _ReduceFromTP(torch.autograd.Function):
    """Sum over the TP group forward, identity backward (Megatron's "g"): per-rank partial values whose total every
    rank then uses alike: a vocab-split quantity (top-k distillation's logits at given ids, policy/topk.py), or a
    LoRA A split by input columns (A_r x_r at width r, policy/fsdp2_lora.py)."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.clone()  # all_reduce is in place; the caller's tensor may be saved for its own backward
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def reduce_from_tp(x: torch.Tensor, group) -> torch.Tensor:
    return _ReduceFromTP.apply(x.contiguous(), group)
