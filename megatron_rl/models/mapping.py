"""The one HF ⇄ megatron-core weight mapping, used by import, export, refit and the planner.

`mapping_table(spec)` lists every weight once: megatron name(s), HF name(s), and a *kind* that fixes both directions
of the transform and the tensor-parallel split:

| kind       | megatron layout                                                     | TP split           |
|------------|---------------------------------------------------------------------|--------------------|
| replicated | same as HF (RMSNorm weights)                                        | full copy per rank |
| column     | same as HF                                                          | rows (dim 0)       |
| row        | same as HF (linear_proj, linear_fc2)                                | columns (dim 1)    |
| vocab      | HF rows padded with zeros to `padded_vocab_for(tp)`                 | rows (dim 0)       |
| qkv        | per query group g: [q heads of g; k_g; v_g] stacked → [ng*(q/g+2)*d] | rows of the fused  |
| fc1        | [gate; up] *per rank*: rank r holds [gate_r; up_r]                  | each half by rows  |

The qkv layout is what `SelfAttention.get_query_key_value_tensors` in megatron-core reads back: it views the
projection as [ng, (np/ng + 2) * hn] and splits each group into its queries, key and value. Column-parallel layers
split the *fused* output rows contiguously, which is exactly "whole groups per rank" when ng is a multiple of tp.
The SwiGLU fc1 output is chunked in two halves *locally* (megatron's glu: act(x[:half]) * x[half:]), so each rank
must hold its own gate slice followed by its own up slice.

Layer-norm names differ by layer spec: the local spec has `input_layernorm` / `pre_mlp_layernorm` modules, the
transformer-engine spec fuses them into `linear_qkv.layer_norm_weight` / `linear_fc1.layer_norm_weight`.

Pipeline stages own layers [offset, offset + n_local); megatron names are local (`decoder.layers.{j}`), HF names use
the global index. With a live model the global index comes from each layer's `layer_number`, so uneven splits work.

MoE layers (Qwen3-MoE, Mixtral): the router (`mlp.router.weight`, replicated) and, per expert, an fc1 (gate ‖ up,
kind fc1) and fc2 (kind row) under `mlp.experts.local_experts.{j}` (megatron's SequentialMLP), split over TP like a
dense MLP. Expert parallelism gives EP rank r the global experts [r*n, (r+1)*n), n = experts / ep, as local j = e - r*n;
the HF side always names the global expert, with the on-disk per-expert keys (`HF_MOE_NAMES`). Qwen3's q/k norms are
one [head_dim] weight each (`self_attention.{q,k}_layernorm`), replicated.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Mapping, Sequence

import torch

from megatron_rl.models.provider import ModelSpec

LAYER = "decoder.layers.{i}."
HF_LAYER = "model.layers.{i}."


@dataclass(frozen=True)
class Entry:
    mcore: str  # megatron name under the local spec ("{i}" = local layer index, "{j}" = local expert index)
    hf: tuple[str, ...]  # HF name(s) ("{i}" = global layer index); several for fused tensors
    kind: str  # replicated | column | row | vocab | qkv | fc1
    scope: str  # "layer", "first" (embedding stage) or "last" (output stage)
    te_mcore: str | None = None  # name under the transformer-engine spec when it differs
    expert: int | None = None  # global expert index of an expert weight (sharded over EP, and over expert-TP)

    def mcore_name(self, layer_spec: str, i: int | None = None, j: int | None = None) -> str:
        name = self.te_mcore if (layer_spec == "te" and self.te_mcore) else self.mcore
        return name.format(i=i, j=j) if i is not None else name

    def hf_names(self, i: int | None = None) -> list[str]:
        return [n.format(i=i) for n in self.hf] if i is not None else list(self.hf)


# HF names of an MoE block, per architecture: the router and each expert's gate / up / down projections as saved on
# disk (transformers 5 fuses the experts in memory but saves and loads these per-expert tensors; vLLM reads them too)
HF_MOE_NAMES = {
    "qwen3_moe": ("mlp.gate.weight", "mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": ("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.", ("w1", "w3", "w2")),
}


def _mlp_entries(spec: ModelSpec) -> list[Entry]:
    m = "mlp."
    if spec.moe is None:
        return [
            Entry(LAYER + "mlp.linear_fc1.weight",
                  (HF_LAYER + m + "gate_proj.weight", HF_LAYER + m + "up_proj.weight"), "fc1", "layer"),
            Entry(LAYER + "mlp.linear_fc2.weight", (HF_LAYER + m + "down_proj.weight",), "row", "layer"),
        ]
    router, expert, (gate, up, down) = HF_MOE_NAMES[spec.model_type]
    # the router is replicated over TP (megatron's TopKRouter holds the full [experts, hidden] weight)
    out = [Entry(LAYER + "mlp.router.weight", (HF_LAYER + router,), "replicated", "layer")]
    local = LAYER + "mlp.experts.local_experts.{j}."
    for e in range(spec.moe.num_experts):
        x = HF_LAYER + expert.replace("{e}", str(e))
        out += [Entry(local + "linear_fc1.weight", (x + gate + ".weight", x + up + ".weight"), "fc1", "layer",
                      expert=e),
                Entry(local + "linear_fc2.weight", (x + down + ".weight",), "row", "layer", expert=e)]
    return out


def mapping_table(spec: ModelSpec) -> list[Entry]:
    a = "self_attn."
    table = [Entry("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab", "first")]
    table += [
        Entry(LAYER + "input_layernorm.weight", (HF_LAYER + "input_layernorm.weight",), "replicated", "layer",
              te_mcore=LAYER + "self_attention.linear_qkv.layer_norm_weight"),
        Entry(LAYER + "self_attention.linear_qkv.weight",
              tuple(HF_LAYER + a + p + "_proj.weight" for p in "qkv"), "qkv", "layer"),
    ]
    if spec.qkv_bias:
        table.append(Entry(LAYER + "self_attention.linear_qkv.bias",
                           tuple(HF_LAYER + a + p + "_proj.bias" for p in "qkv"), "qkv", "layer"))
    if spec.qk_norm:  # one [head_dim] weight shared by all heads, so replicated over TP
        table += [Entry(LAYER + f"self_attention.{p}_layernorm.weight", (HF_LAYER + a + f"{p}_norm.weight",),
                        "replicated", "layer") for p in "qk"]
    table += [
        Entry(LAYER + "self_attention.linear_proj.weight", (HF_LAYER + a + "o_proj.weight",), "row", "layer"),
        # the TE spec fuses this norm into a dense fc1; an MoE layer keeps it separate under both specs
        Entry(LAYER + "pre_mlp_layernorm.weight", (HF_LAYER + "post_attention_layernorm.weight",), "replicated",
              "layer", te_mcore=None if spec.moe else LAYER + "mlp.linear_fc1.layer_norm_weight"),
        *_mlp_entries(spec),
        Entry("decoder.final_layernorm.weight", ("model.norm.weight",), "replicated", "last"),
    ]
    if not spec.tied_embeddings:
        table.append(Entry("output_layer.weight", ("lm_head.weight",), "vocab", "last"))
    return table


def expected_hf_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Every HF tensor name the model needs, with its shape (conversion pre-flight, planner sizes)."""
    h, d, f = spec.hidden_size, spec.head_dim, spec.ffn_hidden_size
    q, kv = spec.num_heads * d, spec.num_kv_heads * d
    per = {
        "input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,),
        "self_attn.q_proj.weight": (q, h), "self_attn.k_proj.weight": (kv, h), "self_attn.v_proj.weight": (kv, h),
        "self_attn.o_proj.weight": (h, q),
    }
    if spec.moe is None:
        per.update({"mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h), "mlp.down_proj.weight": (h, f)})
    else:
        router, expert, (gate, up, down) = HF_MOE_NAMES[spec.model_type]
        fe = spec.moe.ffn_hidden_size
        per[router] = (spec.moe.num_experts, h)
        for e in range(spec.moe.num_experts):
            x = expert.replace("{e}", str(e))
            per.update({f"{x}{gate}.weight": (fe, h), f"{x}{up}.weight": (fe, h), f"{x}{down}.weight": (h, fe)})
    if spec.qkv_bias:
        per.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    if spec.qk_norm:
        per.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    out = {"model.embed_tokens.weight": (spec.vocab_size, h), "model.norm.weight": (h,)}
    for i in range(spec.num_layers):
        out.update({f"model.layers.{i}.{k}": s for k, s in per.items()})
    if not spec.tied_embeddings:
        out["lm_head.weight"] = (spec.vocab_size, h)
    return out


def layer_range(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Global layer indices owned by a pipeline stage under an even split (what build_model produces)."""
    if num_layers % pp_size:
        raise ValueError(f"{num_layers} layers cannot be split evenly over pp={pp_size}")
    n = num_layers // pp_size
    return range(pp_rank * n, (pp_rank + 1) * n)


# ----------------------------------------------------------------------------------------------------------------
# per-kind transforms (full HF tensors ⇄ one TP rank's megatron tensor)
# ----------------------------------------------------------------------------------------------------------------

def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, spec: ModelSpec) -> torch.Tensor:
    ng, d = spec.num_kv_heads, spec.head_dim
    rest = q.shape[1:]  # (hidden,) for weights, () for biases
    q = q.reshape(ng, spec.queries_per_group * d, *rest)
    k = k.reshape(ng, d, *rest)
    v = v.reshape(ng, d, *rest)
    return torch.cat([q, k, v], dim=1).reshape(ng * (spec.queries_per_group + 2) * d, *rest)


def _split_qkv(fused: torch.Tensor, spec: ModelSpec) -> list[torch.Tensor]:
    ng, d, qpg = spec.num_kv_heads, spec.head_dim, spec.queries_per_group
    rest = fused.shape[1:]
    g = fused.reshape(ng, (qpg + 2) * d, *rest)
    q, k, v = torch.split(g, [qpg * d, d, d], dim=1)
    return [q.reshape(ng * qpg * d, *rest), k.reshape(ng * d, *rest), v.reshape(ng * d, *rest)]


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t
    pad = t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))
    return torch.cat([t, pad], dim=0)


def to_megatron(entry: Entry, hf: Sequence[torch.Tensor], spec: ModelSpec, tp_rank: int, tp: int) -> torch.Tensor:
    """Full HF tensor(s) of one entry → this TP rank's megatron tensor."""
    kind = entry.kind
    if kind == "replicated":
        return hf[0].clone()
    if kind == "column":
        return hf[0].chunk(tp, dim=0)[tp_rank].clone()
    if kind == "row":
        return hf[0].chunk(tp, dim=1)[tp_rank].clone()
    if kind == "vocab":
        return _pad_rows(hf[0], spec.padded_vocab_for(tp)).chunk(tp, dim=0)[tp_rank].clone()
    if kind == "qkv":
        return _fuse_qkv(*hf, spec).chunk(tp, dim=0)[tp_rank].clone()
    if kind == "fc1":
        gate, up = hf
        return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
    raise ValueError(f"unknown mapping kind {kind!r}")


def to_hf(entry: Entry, shards: Sequence[torch.Tensor], spec: ModelSpec) -> list[torch.Tensor]:
    """All TP ranks' megatron tensors of one entry (in TP-rank order) → the full HF tensor(s)."""
    kind = entry.kind
    if kind == "replicated":
        return [shards[0]]
    if kind == "column":
        return [torch.cat(list(shards), dim=0)]
    if kind == "row":
        return [torch.cat(list(shards), dim=1)]
    if kind == "vocab":
        return [torch.cat(list(shards), dim=0)[: spec.vocab_size]]
    if kind == "qkv":
        return _split_qkv(torch.cat(list(shards), dim=0), spec)
    if kind == "fc1":
        halves = [s.chunk(2, dim=0) for s in shards]
        return [torch.cat([h[0] for h in halves], dim=0), torch.cat([h[1] for h in halves], dim=0)]
    raise ValueError(f"unknown mapping kind {kind!r}")


def _stage_entries(spec: ModelSpec, first: bool, last: bool):
    """(entry, local index, global index) for what a stage owns, in HF order; layer entries need a layer list."""
    table = mapping_table(spec)
    return ([e for e in table if e.scope == "first" and first], [e for e in table if e.scope == "layer"],
            [e for e in table if e.scope == "last" and last])


def expert_owner(spec: ModelSpec, expert: int, ep_size: int) -> tuple[int, int]:
    """(EP rank, local index) of a global expert: megatron gives EP rank r experts [r*n, (r+1)*n), n = experts/ep."""
    n = spec.moe.num_experts // ep_size
    return expert // n, expert % n


def _layer_items(layer_entries, spec: ModelSpec, layer_spec: str, j: int, i: int, ep_rank: int, ep_size: int):
    """(entry, megatron name, HF names) of local layer j (global i), restricted to the experts EP rank owns."""
    items = []
    for e in layer_entries:
        if e.expert is None:
            items.append((e, e.mcore_name(layer_spec, j), e.hf_names(i)))
            continue
        owner, local = expert_owner(spec, e.expert, ep_size)
        if owner == ep_rank:
            items.append((e, e.mcore_name(layer_spec, j, local), e.hf_names(i)))
    return items


def _stage_items(spec: ModelSpec, pp_rank: int, pp_size: int, layer_spec: str, ep_rank: int = 0, ep_size: int = 1):
    """Everything rank (pp_rank, ep_rank) of an evenly split model holds, as (entry, megatron name, HF names)."""
    pre, layer_entries, post = _stage_entries(spec, pp_rank == 0, pp_rank == pp_size - 1)
    items = [(e, e.mcore_name(layer_spec), e.hf_names()) for e in pre]
    for j, i in enumerate(layer_range(spec.num_layers, pp_size, pp_rank)):
        items += _layer_items(layer_entries, spec, layer_spec, j, i, ep_rank, ep_size)
    return items + [(e, e.mcore_name(layer_spec), e.hf_names()) for e in post]


# ----------------------------------------------------------------------------------------------------------------
# import: HF → one rank's megatron state
# ----------------------------------------------------------------------------------------------------------------

def hf_to_megatron_shard(hf_state: Mapping[str, torch.Tensor], spec: ModelSpec, tp_rank: int, tp_size: int,
                         pp_rank: int, pp_size: int, *, ep_rank: int = 0, ep_size: int = 1,
                         layer_spec: str = "local", dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF state (any mapping, e.g. a lazy HFCheckpoint) → the megatron state dict of rank (tp, pp, ep).

    Tied models: the last stage's output_layer.weight is the (padded) embedding, as megatron keeps a copy there when
    the embedding lives on another stage. Experts shard over TP like a dense MLP (expert-TP = TP).
    """
    out: dict[str, torch.Tensor] = {}

    def put(entry: Entry, name: str, hf_names: list[str]):
        t = to_megatron(entry, [hf_state[n] for n in hf_names], spec, tp_rank, tp_size)
        out[name] = t.to(dtype) if dtype is not None else t

    for e, name, hf_names in _stage_items(spec, pp_rank, pp_size, layer_spec, ep_rank, ep_size):
        put(e, name, hf_names)
    if pp_rank == pp_size - 1 and spec.tied_embeddings and pp_rank != 0:
        tied = Entry("output_layer.weight", ("model.embed_tokens.weight",), "vocab", "last")
        put(tied, tied.mcore, tied.hf_names())
    return out


def megatron_shards_to_hf(shards: Sequence[Sequence[Mapping[str, torch.Tensor]]], spec: ModelSpec, *,
                          layer_spec: str = "local", ep_size: int = 1) -> dict[str, torch.Tensor]:
    """Merge per-rank megatron state dicts (single process) into one HF state dict. `shards[pp_rank]` lists the
    stage's ranks in megatron order, TP fastest: index ep_rank * tp + tp_rank."""
    pp_size = len(shards)
    out: dict[str, torch.Tensor] = {}
    for pp_rank, stage in enumerate(shards):
        tp = len(stage) // ep_size
        for ep_rank in range(ep_size):
            group = stage[ep_rank * tp:(ep_rank + 1) * tp]
            for e, name, hf_names in _stage_items(spec, pp_rank, pp_size, layer_spec, ep_rank, ep_size):
                if ep_rank and e.expert is None:
                    continue  # replicated over EP: taken from EP rank 0
                missing = [r for r, sd in enumerate(group) if name not in sd]
                if missing:
                    raise KeyError(f"megatron tensor {name!r} missing from pp={pp_rank} ep={ep_rank} tp={missing}")
                for hf_name, t in zip(hf_names, to_hf(e, [sd[name] for sd in group], spec)):
                    out[hf_name] = t
    return out


# ----------------------------------------------------------------------------------------------------------------
# live models inside a distributed job: load, and stream out HF-named full tensors (refit, export)
# ----------------------------------------------------------------------------------------------------------------

def unwrap_model(model):
    """Strip DDP / Float16Module style wrappers (`.module`) down to the GPTModel."""
    while not hasattr(model, "decoder") and hasattr(model, "module"):
        model = model.module
    return model


def detect_layer_spec(model) -> str:
    names = {n for n, _ in unwrap_model(model).named_parameters()}
    return "te" if any(n.endswith("linear_qkv.layer_norm_weight") for n in names) else "local"


def _model_entries(model, spec: ModelSpec, layer_spec: str, ep_rank: int = 0, ep_size: int = 1):
    """(entry, megatron param name, HF names) for every weight this rank's model holds, in HF order."""
    gpt = unwrap_model(model)
    pre, layer_entries, post = _stage_entries(spec, gpt.pre_process, gpt.post_process)
    items = [(e, e.mcore_name(layer_spec), e.hf_names()) for e in pre]
    for j, layer in enumerate(gpt.decoder.layers):
        i = layer.layer_number - 1  # layer_number is global and 1-based
        items += _layer_items(layer_entries, spec, layer_spec, j, i, ep_rank, ep_size)
    items += [(e, e.mcore_name(layer_spec), e.hf_names()) for e in post]
    return items


def _ep_coords(spec: ModelSpec) -> tuple[int, int]:
    """(EP rank, EP size) of this process for an MoE model; (0, 1) for dense models or without parallel state."""
    from megatron.core import parallel_state as ps

    if spec.moe is None or not ps.model_parallel_is_initialized():
        return 0, 1
    return ps.get_expert_model_parallel_rank(), ps.get_expert_model_parallel_world_size()


def load_hf_into_model(model, hf_state: Mapping[str, torch.Tensor], spec: ModelSpec | None = None,
                       tp_rank: int | None = None, tp_size: int | None = None) -> None:
    """Copy HF weights into this rank's (TP/PP-sharded) model in place; shape errors name both tensors."""
    from megatron.core import parallel_state as ps

    gpt = unwrap_model(model)
    spec = spec or gpt.megatron_rl_spec
    tp_rank = ps.get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    tp_size = ps.get_tensor_model_parallel_world_size() if tp_size is None else tp_size
    layer_spec = detect_layer_spec(gpt)
    params = dict(gpt.named_parameters())
    items = _model_entries(gpt, spec, layer_spec, *_ep_coords(spec))
    if gpt.post_process and spec.tied_embeddings and not gpt.pre_process:
        items.append((Entry("output_layer.weight", ("model.embed_tokens.weight",), "vocab", "last"),
                      "output_layer.weight", ["model.embed_tokens.weight"]))
    with torch.no_grad():
        for e, name, hf_names in items:
            if name not in params:
                raise KeyError(f"model has no parameter {name!r} (layer spec {layer_spec})")
            t = to_megatron(e, [hf_state[n] for n in hf_names], spec, tp_rank, tp_size)
            p = params[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ValueError(f"HF {hf_names} → megatron {name!r}: shape {list(t.shape)} does not fit the "
                                 f"parameter {list(p.shape)} (tp={tp_size})")
            p.copy_(t)


def iter_hf_tensors(model, spec: ModelSpec | None = None, *, tp_group=None,
                    dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full tensor) for every weight this rank's pipeline stage owns, in HF order (MoE: a layer's
    experts in EP-gather order, each once).

    Collective over the tensor-parallel group, and for MoE experts over the expert-TP and expert-parallel groups:
    every rank of the stage must iterate in lock-step (they all get the same full tensors, all experts included, so
    any one of them can export the stage). Tied models yield `model.embed_tokens.weight` from the first stage only.
    Tensors are fresh (gathered or cloned), so the caller may keep or cast them.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    gpt = unwrap_model(model)
    spec = spec or gpt.megatron_rl_spec
    parallel = dist.is_initialized() and ps.model_parallel_is_initialized()
    if tp_group is None and parallel:
        tp_group = ps.get_tensor_model_parallel_group()
    ep_rank, ep = _ep_coords(spec)
    # experts shard over the expert-TP group (megatron's expert_tensor_parallel_size, = TP here) and the EP group
    etp_group = ps.get_expert_tensor_parallel_group() if spec.moe is not None and parallel else tp_group
    ep_group = ps.get_expert_model_parallel_group() if ep > 1 else None
    by_expert = {(e.mcore, e.expert): e for e in mapping_table(spec) if e.expert is not None}
    params = dict(gpt.named_parameters())
    for e, name, hf_names in _model_entries(gpt, spec, detect_layer_spec(gpt), ep_rank, ep):
        group = etp_group if e.expert is not None else tp_group
        size = dist.get_world_size(group) if group is not None else 1
        local = params[name].detach()
        if e.kind == "replicated":
            shards = [local.clone()]  # to_hf returns it as is: never hand out the live parameter
        elif size == 1:
            shards = [local]  # to_hf concatenates, which copies
        else:
            local = local.contiguous()
            shards = [torch.empty_like(local) for _ in range(size)]
            dist.all_gather(shards, local, group=group)  # parameter shards: on the model's (the group's) device
        full = to_hf(e, shards, spec)
        if e.expert is None or ep == 1:
            owned = [(hf_names, full)]
        else:  # every EP rank holds its own experts at this local index: gather them all (the same on every rank)
            layer_i = int(name.split(".")[2])
            i = gpt.decoder.layers[layer_i].layer_number - 1
            _, j = expert_owner(spec, e.expert, ep)
            owned = []
            for k, t in enumerate(full):
                parts = [torch.empty_like(t) for _ in range(ep)]
                dist.all_gather(parts, t.contiguous(), group=ep_group)  # model tensors: the group's device
                for r, part in enumerate(parts):
                    other = by_expert[(e.mcore, r * (spec.moe.num_experts // ep) + j)]
                    owned.append(([other.hf_names(i)[k]], [part]))
        for names, tensors in owned:
            for hf_name, t in zip(names, tensors):
                yield hf_name, (t.to(dtype) if dtype is not None else t)
