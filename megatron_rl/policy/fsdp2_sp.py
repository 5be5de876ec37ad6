"""Ulysses sequence parallelism on the FSDP2 backend (`policy.sp`): each row's tokens split over SP ranks.

DeepSpeed-Ulysses (Jacobs et al. 2023), as verl, OpenRLHF and TRL run it on Hugging Face models. A micro-batch's
rows are padded to a multiple of SP and cut into SP contiguous chunks, one per rank; the decoder runs on a rank's
chunk (embeddings, norms, MLPs, RoPE from its tokens' own positions, the lm_head and the kernels: all per token).
Attention needs every token, so around it an all-to-all turns the chunk's q, k, v [b, heads, t/SP, d] into all of
the row's tokens for 1/SP of the heads [b, heads/SP, t, d]; the model's own attention (sdpa, or eager for a soft-
capped model) runs them with the row's whole mask (`batching.attention_mask`'s block mask as `hf_masks` prepares it:
cascade prefixes and packed units as at SP = 1), and a second all-to-all brings the output back to the chunk's
tokens with every head. gloo runs `all_to_all_single` on CPU, NCCL on GPU: one code path.

Each rank scores its own response positions; `context_parallel.gather_responses` assembles the row's on every SP
rank, so the loss and metrics are those of SP = 1, and each rank's backward reaches the weights through its own
tokens only. FSDP shards over DP x SP (the mesh's "dp" dimension holds both, SP fastest): its gradient sum over
those ranks is the whole gradient. The micro-batch plan is the data-parallel replica's, the same on its SP ranks.

Heads: each rank takes heads/SP of the query heads and kv_heads/SP of the key/value heads (per TP rank: heads/TP),
which keeps every query head with its grouped key/value head; with fewer KV heads than SP ranks each KV head is
replicated onto the ranks whose query heads use it (its gradient summed back), as verl does; counts SP neither
divides nor is a multiple of are refused by name.
"""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_rl.policy import batching, packing

IMPL = "megatron_rl_ulysses"  # the name registered with transformers' AttentionInterface


@dataclass(frozen=True)
class SPCoords:
    size: int
    rank: int
    group: object  # None at SP = 1
    dp_size: int  # data-parallel replicas (FSDP's ranks / SP)
    dp_rank: int


def init_sp(sp: int, mesh) -> SPCoords:
    """This rank's SP group and data-parallel coordinates on the worker's (dp x sp, tp) mesh; every rank calls it
    (group creation is collective)."""
    fsdp = mesh.get_group("dp")
    size, rank = dist.get_world_size(fsdp), dist.get_rank(fsdp)
    if sp == 1:
        return SPCoords(1, 0, None, size, rank)
    if size % sp:
        raise ValueError(f"policy.sp={sp} does not divide the {size} ranks left after policy.tp")
    group = None
    ranks = mesh.mesh.reshape(size, -1)  # [dp x sp, tp] global ranks
    for col in ranks.T.tolist():  # each TP index, blocks of SP consecutive ranks; every rank creates every group
        for i in range(0, size, sp):
            g = dist.new_group(col[i:i + sp])
            if dist.get_rank() in col[i:i + sp]:
                group = g
    return SPCoords(sp, rank % sp, group, size // sp, rank // sp)


def check_heads(config, tp: int, sp: int) -> None:
    """ValueError naming policy.sp where the heads do not split (module doc): SP must divide a TP rank's query heads,
    and divide its key/value heads or be a multiple of them (then each KV head is replicated on the SP ranks whose
    query heads use it, as verl does)."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    if heads % (tp * sp):
        raise ValueError(f"policy.sp={sp}: num_attention_heads={heads} is not divisible by policy.tp*sp={tp * sp} "
                         "(each SP rank attends 1/(tp*sp) of the heads)")
    local = kv // tp if kv % tp == 0 else kv
    if local % sp and sp % local:
        raise ValueError(f"policy.sp={sp}: num_key_value_heads={kv} per TP rank ({local}) neither divides nor is a "
                         f"multiple of policy.sp={sp}")


# --------------------------------------------------------------------------------------- the all-to-alls

class _AllToAll(torch.autograd.Function):
    """[sp, ...] -> [sp, ...]: chunk j to rank j, slot j from rank j. Its backward is the same exchange."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _exchange(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group), None


def _exchange(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()  # all_to_all_single cuts dim 0 of dense memory (empty_like would copy a view's strides)
    out = torch.empty_like(x)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[b, h, t/sp, d] of this rank's tokens -> [b, h/sp, t, d] of this rank's heads."""
    sp = dist.get_world_size(group)
    b, h, tl, d = x.shape
    got = _AllToAll.apply(x.reshape(b, sp, h // sp, tl, d).transpose(0, 1), group)  # [sp: token chunk, b, h/sp, tl, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // sp, sp * tl, d)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """[b, t, h/sp, d] (attention's output layout) -> [b, t/sp, h, d] of this rank's tokens."""
    sp = dist.get_world_size(group)
    b, t, hl, d = x.shape
    got = _AllToAll.apply(x.reshape(b, sp, t // sp, hl, d).transpose(0, 1), group)  # [sp: head chunk, b, tl, hl, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, t // sp, sp * hl, d)


def install(lm, layers, group, base: str, tp: int) -> None:
    """Make `lm`'s attention Ulysses attention around its `base` implementation ("sdpa" or "eager"), or ValueError
    naming policy.sp where its heads do not split."""
    check_heads(lm.config, tp, dist.get_world_size(group))
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def ulysses(module, query, key, value, attention_mask, **kwargs):
        inner = ALL_ATTENTION_FUNCTIONS[module.megatron_rl_sp_base] if module.megatron_rl_sp_base != "eager" \
            else _eager_of(module)
        g = module.megatron_rl_sp_group
        sp = dist.get_world_size(g)
        if key.shape[1] % sp:  # fewer KV heads than SP ranks: each rank gets a copy of its query heads' KV head
            key, value = (x.repeat_interleave(sp // key.shape[1], dim=1) for x in (key, value))
        q, k, v = (seq_to_heads(x, g) for x in (query, key, value))
        if q.shape[1] != k.shape[1] * module.num_key_value_groups:  # replicated above: one KV head per query head
            k, v = (x.repeat_interleave(q.shape[1] // x.shape[1], dim=1) for x in (k, v))
            module = _Grouped(module, 1)
        out, _ = inner(module, q, k, v, attention_mask, **kwargs)
        return heads_to_seq(out, g), None

    AttentionInterface.register(IMPL, ulysses)
    for layer in layers:
        layer.self_attn.megatron_rl_sp_group = group
        layer.self_attn.megatron_rl_sp_base = base
    lm.config._attn_implementation = IMPL


class _Grouped:
    """An attention module as the inner attention reads it, with another query-heads-per-KV-head count."""

    def __init__(self, module, groups: int):
        self._module, self.num_key_value_groups = module, groups

    def __getattr__(self, name):
        return getattr(self._module, name)


def _eager_of(module):
    """The model's own eager attention (a soft-capped model's cap lives there), from its modelling module."""
    import sys

    return sys.modules[type(module).__module__].eager_attention_forward


# ------------------------------------------------------------------------------------- a micro-batch's chunk

@dataclass
class Chunk:
    tokens: torch.Tensor  # [b, t/sp] this rank's
    positions: torch.Tensor
    targets: torch.Tensor
    resp: torch.Tensor  # [b, t/sp] bool: its positions that predict a response token
    mask: object  # the whole rows' attention mask for the decoder (hf_masks.hf_attention_mask)
    view: batching.MicroBatchRows  # the micro-batch's responses as one row, in `flat` order, with the share (cp)
    routing: torch.Tensor | None  # [b, t/sp, MoE layers, k] the engine's experts for its tokens (routing replay)


def chunk(mb: batching.MicroBatchRows, sp: SPCoords, kinds, dtype) -> Chunk:
    """This rank's chunk of `mb` (rows padded to a multiple of SP: pad tokens attend themselves, nothing attends
    them, they predict nothing)."""
    from megatron_rl.models.hf_masks import hf_attention_mask
    from megatron_rl.policy.context_parallel import RowShare

    b, s = mb.tokens.shape
    n = packing.padded(s, sp.size)
    pad = n - s
    tokens, targets = F.pad(mb.tokens, (0, pad)), F.pad(mb.targets, (0, pad), value=-1)
    resp = F.pad(mb.resp_mask, (0, pad), value=False)
    last = mb.position_ids[:, -1:]
    positions = torch.cat([mb.position_ids, last + torch.arange(1, pad + 1)], dim=1)
    blocked = torch.ones(b, 1, n, n, dtype=torch.bool)
    blocked[:, :, :s, :s] = mb.attention_mask if mb.attention_mask is not None else \
        ~torch.ones(s, s, dtype=torch.bool).tril()
    blocked[:, :, torch.arange(s, n), torch.arange(s, n)] = False
    mask = hf_attention_mask(blocked, positions, kinds, dtype)
    tl = n // sp.size
    index = (torch.cumsum(resp.reshape(-1).long(), 0) - 1).reshape(b, n)  # place in the `flat` order
    resp_at = [index[:, r * tl:(r + 1) * tl][resp[:, r * tl:(r + 1) * tl]] for r in range(sp.size)]
    share = RowShare(cols=None, order=None, parts=(), resp_local=None, resp_at=resp_at, rank=sp.rank, group=sp.group)
    total = int(resp.sum())
    starts = list(itertools.accumulate([0] + mb.resp_lens[:-1])) if mb.resp_lens else []
    view = dataclasses.replace(mb, targets=mb.targets[mb.resp_mask][None], resp_mask=torch.ones(1, total, dtype=bool),
                               spans=[(0, c) for c in starts], one_row=True, cp=share)
    mine = slice(sp.rank * tl, (sp.rank + 1) * tl)
    routing = None
    if mb.routing is not None:
        routing = mb.routing.new_full((b, n, *mb.routing.shape[2:]), -1)
        routing[:, :s] = mb.routing
        routing = routing[:, mine]
    return Chunk(tokens[:, mine], positions[:, mine], targets[:, mine], resp[:, mine], mask, view, routing)


def score(worker, mb: batching.MicroBatchRows, temperature):
    """`FSDP2PolicyWorker._score` at SP > 1: (logprobs, entropy) of the micro-batch's responses, gathered over the SP
    group, and the view they are in."""
    from megatron_rl.policy.context_parallel import gather_responses

    dev = worker.device
    c = chunk(mb, worker.sp, worker.mask_kinds, worker.dtype)
    if worker._replay is not None:
        worker._replay.set(c.routing)
    mask = {k: v.to(dev) for k, v in c.mask.items()} if isinstance(c.mask, dict) else c.mask.to(dev)
    lp, ent = worker.model(c.tokens.to(dev), c.positions.to(dev), 0, c.targets.to(dev), temperature, mask, None)
    resp = c.resp.to(dev)
    return gather_responses(lp[resp][None], c.view.cp), gather_responses(ent[resp][None], c.view.cp), c.view, {}
