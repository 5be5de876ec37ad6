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
    mcore: str  # megatron name under the local spec ("{i}" = local layer index)
    hf: tuple[str, ...]  # HF name(s) ("{i}" = global layer index); several for fused tensors
    kind: str  # replicated | column | row | vocab | qkv | fc1
    scope: str  # "layer", "first" (embedding stage) or "last" (output stage)
    te_mcore: str | None = None  # name under the transformer-engine spec when it differs

    def mcore_name(self, layer_spec: str, i: int | None = None) -> str:
        name = self.te_mcore if (layer_spec == "te" and self.te_mcore) else self.mcore
        return name.format(i=i) if i is not None else name

    def hf_names(self, i: int | None = None) -> list[str]:
        return [n.format(i=i) for n in self.hf] if i is not None else list(self.hf)


def mapping_table(spec: ModelSpec) -> list[Entry]:
    a, m = "self_attn.", "mlp."
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
    table += [
        Entry(LAYER + "self_attention.linear_proj.weight", (HF_LAYER + a + "o_proj.weight",), "row", "layer"),
        Entry(LAYER + "pre_mlp_layernorm.weight", (HF_LAYER + "post_attention_layernorm.weight",), "replicated",
              "layer", te_mcore=LAYER + "mlp.linear_fc1.layer_norm_weight"),
        Entry(LAYER + "mlp.linear_fc1.weight", (HF_LAYER + m + "gate_proj.weight", HF_LAYER + m + "up_proj.weight"),
              "fc1", "layer"),
        Entry(LAYER + "mlp.linear_fc2.weight", (HF_LAYER + m + "down_proj.weight",), "row", "layer"),
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
        "self_attn.o_proj.weight": (h, q), "mlp.gate_proj.weight": (f, h), "mlp.up_proj.weight": (f, h),
        "mlp.down_proj.weight": (h, f),
    }
    if spec.qkv_bias:
        per.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
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


# ----------------------------------------------------------------------------------------------------------------
# import: HF → one rank's megatron state
# ----------------------------------------------------------------------------------------------------------------

def hf_to_megatron_shard(hf_state: Mapping[str, torch.Tensor], spec: ModelSpec, tp_rank: int, tp_size: int,
                         pp_rank: int, pp_size: int, *, layer_spec: str = "local",
                         dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """HF state (any mapping, e.g. a lazy HFCheckpoint) → the megatron state dict of rank (tp_rank, pp_rank).

    Tied models: the last stage's output_layer.weight is the (padded) embedding, as megatron keeps a copy there when
    the embedding lives on another stage.
    """
    first, last = pp_rank == 0, pp_rank == pp_size - 1
    pre, layer_entries, post = _stage_entries(spec, first, last)
    out: dict[str, torch.Tensor] = {}

    def put(entry: Entry, name: str, hf_names: list[str]):
        t = to_megatron(entry, [hf_state[n] for n in hf_names], spec, tp_rank, tp_size)
        out[name] = t.to(dtype) if dtype is not None else t

    for e in pre:
        put(e, e.mcore_name(layer_spec), e.hf_names())
    for j, i in enumerate(layer_range(spec.num_layers, pp_size, pp_rank)):
        for e in layer_entries:
            put(e, e.mcore_name(layer_spec, j), e.hf_names(i))
    for e in post:
        put(e, e.mcore_name(layer_spec), e.hf_names())
    if last and spec.tied_embeddings and not first:
        tied = Entry("output_layer.weight", ("model.embed_tokens.weight",), "vocab", "last")
        put(tied, tied.mcore, tied.hf_names())
    return out


def megatron_shards_to_hf(shards: Sequence[Sequence[Mapping[str, torch.Tensor]]], spec: ModelSpec, *,
                          layer_spec: str = "local") -> dict[str, torch.Tensor]:
    """Merge per-rank megatron state dicts `shards[pp_rank][tp_rank]` (single process) into one HF state dict."""
    pp_size = len(shards)
    out: dict[str, torch.Tensor] = {}
    for pp_rank, stage in enumerate(shards):
        pre, layer_entries, post = _stage_entries(spec, pp_rank == 0, pp_rank == pp_size - 1)
        for e, name, hf_names in (
            [(e, e.mcore_name(layer_spec), e.hf_names()) for e in pre]
            + [(e, e.mcore_name(layer_spec, j), e.hf_names(i))
               for j, i in enumerate(layer_range(spec.num_layers, pp_size, pp_rank)) for e in layer_entries]
            + [(e, e.mcore_name(layer_spec), e.hf_names()) for e in post]
        ):
            missing = [r for r, sd in enumerate(stage) if name not in sd]
            if missing:
                raise KeyError(f"megatron tensor {name!r} missing from pp={pp_rank} tp={missing}")
            for hf_name, t in zip(hf_names, to_hf(e, [sd[name] for sd in stage], spec)):
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


def _model_entries(model, spec: ModelSpec, layer_spec: str):
    """(entry, megatron param name, HF names) for every weight this rank's model holds, in HF order."""
    gpt = unwrap_model(model)
    pre, layer_entries, post = _stage_entries(spec, gpt.pre_process, gpt.post_process)
    items = [(e, e.mcore_name(layer_spec), e.hf_names()) for e in pre]
    for j, layer in enumerate(gpt.decoder.layers):
        i = layer.layer_number - 1  # layer_number is global and 1-based
        items += [(e, e.mcore_name(layer_spec, j), e.hf_names(i)) for e in layer_entries]
    items += [(e, e.mcore_name(layer_spec), e.hf_names()) for e in post]
    return items


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
    items = _model_entries(gpt, spec, layer_spec)
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
    """Yield (HF name, full tensor) for every weight this rank's pipeline stage owns, in HF order.

    Collective over the tensor-parallel group: every TP rank of the stage must iterate in lock-step (they all get the
    same full tensors). Tied models yield `model.embed_tokens.weight` from the first stage only. Tensors are fresh
    (gathered or cloned), so the caller may keep or cast them.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    gpt = unwrap_model(model)
    spec = spec or gpt.megatron_rl_spec
    if tp_group is None and dist.is_initialized() and ps.model_parallel_is_initialized():
        tp_group = ps.get_tensor_model_parallel_group()
    tp = dist.get_world_size(tp_group) if tp_group is not None else 1
    params = dict(gpt.named_parameters())
    for e, name, hf_names in _model_entries(gpt, spec, detect_layer_spec(gpt)):
        local = params[name].detach()
        if e.kind == "replicated":
            shards = [local.clone()]  # to_hf returns it as is: never hand out the live parameter
        elif tp == 1:
            shards = [local]  # to_hf concatenates, which copies
        else:
            local = local.contiguous()
            shards = [torch.empty_like(local) for _ in range(tp)]
            dist.all_gather(shards, local, group=tp_group)  # parameter shards: on the model's (the group's) device
        for hf_name, t in zip(hf_names, to_hf(e, shards, spec)):
            yield hf_name, (t.to(dtype) if dtype is not None else t)
