"""Core attention for packed (THD, `cu_seqlens`) rows, including cascade attention for group-shared prefixes.

A packed row is [t, heads, head_dim] with b = 1: the concatenation of segments given by `PackedSeqParams`
(`cu_seqlens_*` real lengths, `cu_seqlens_*_padded` where the segments start). Every segment attends causally to
itself only. A `CascadeSeqParams` row additionally names, for each segment, a *prefix* segment whose keys it attends
in full (non-causal): a GRPO group's completions attend to the group's prompt, computed once in the same row
(`policy/packing.py`). Each completion's attention is then two standard attention calls (its prompt keys, full; its
own keys, causal) merged exactly by log-sum-exp:

    lse = logaddexp(lse_p, lse_o),  O = exp(lse_p - lse) O_p + exp(lse_o - lse) O_o

The backward is exact too: the standard attention backward of each part, given the *merged* output and lse,
produces that part's share of dQ and its exact dK, dV (dS = P * (dP - rowsum(dO * O)) with P = exp(S - lse) needs only
the final O and lse, as in ring attention). No [s, s] mask is ever built.

Where this runs: megatron's local spec (CPU, and GPU without transformer-engine) gets `VarlenDotProductAttention`
for every packed row. Under transformer-engine's spec, plain varlen rows go to TE's own fused THD attention and only
cascade rows come here (`with_varlen_core_attention`). Per-segment kernels: torch's fused flash kernel on CPU; on
CUDA torch's memory-efficient kernel (fp32 and bf16; flash on CUDA takes no fp32), which no CPU test reaches
(`bench/gpu_check.py` covers it on a lent GPU). Plain segments use `F.scaled_dot_product_attention`.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.dot_product_attention import DotProductAttention


@dataclass
class CascadeSeqParams(PackedSeqParams):
    """PackedSeqParams plus, per segment, the index of the segment it also attends in full (-1: none), and the
    segment bounds as host lists (no device sync per layer)."""

    prefix_of: list = None  # [n_segments] int
    starts: list = None  # [n_segments] first row index (padded layout)
    lengths: list = None  # [n_segments] real tokens


def segments_of(params: PackedSeqParams) -> tuple[list[int], list[int], list[int]]:
    """(starts, lengths, prefix_of) of a packed row, host-side."""
    if isinstance(params, CascadeSeqParams) and params.starts is not None:
        return params.starts, params.lengths, params.prefix_of
    real = params.cu_seqlens_q.tolist()
    padded = params.cu_seqlens_q_padded.tolist() if params.cu_seqlens_q_padded is not None else real
    lengths = [b - a for a, b in zip(real[:-1], real[1:])]
    return padded[:-1], lengths, [-1] * len(lengths)


# ------------------------------------------------------------------------------------- per-part kernels (o, lse)

def _part_forward(q, k, v, causal: bool, scale: float):
    """[1, h, sq, d] x [1, h, sk, d] -> (out [1, h, sq, d], lse [1, h, sq] fp32, rng) with a fused kernel."""
    if q.device.type == "cpu":
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)
        return o, lse, ()
    # CUDA only (no CPU test reaches it; bench/gpu_check.py's varlen_train checks it against an fp64 reference):
    # the memory-efficient kernel (fp32 and bf16), called the way torch's own SDPA calls it ([b, s, h, d] layout,
    # mask type 1 = causal from the top-left, equal to bottom-right here as the causal part is square)
    o, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
        *(x.transpose(1, 2) for x in (q, k, v)), None, None, None, None, None, 0.0, int(causal), True, scale=scale)
    return o.transpose(1, 2), lse[..., :q.shape[2]], (seed, offset)


def _part_backward(do, q, k, v, o, lse, causal: bool, scale: float, rng):
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, o, lse.contiguous(), 0.0, causal, scale=scale)
    pad = (-lse.shape[-1]) % 32  # the efficient kernel keeps lse padded to a multiple of 32 queries
    lse_p = F.pad(lse, (0, pad)) if pad else lse
    t = [x.transpose(1, 2) for x in (do, q, k, v, o)]
    dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
        t[0], t[1], t[2], t[3], None, t[4], None, None, q.shape[2], k.shape[2], lse_p.contiguous(), 0.0,
        rng[0], rng[1], int(causal), False, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


class _Cascade(torch.autograd.Function):
    """Queries attending to (k_p, v_p) in full and to (k_o, v_o) causally; merged by log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k_p, v_p, k_o, v_o, scale):
        o_p, lse_p, rng_p = _part_forward(q, k_p, v_p, False, scale)
        o_o, lse_o, rng_o = _part_forward(q, k_o, v_o, True, scale)
        acc = torch.promote_types(q.dtype, torch.float32)  # merge in fp32 at least (fp64 stays fp64)
        lse = torch.logaddexp(lse_p.to(acc), lse_o.to(acc))
        out = (torch.exp(lse_p - lse)[..., None] * o_p.to(acc)
               + torch.exp(lse_o - lse)[..., None] * o_o.to(acc)).to(q.dtype)
        ctx.save_for_backward(q, k_p, v_p, k_o, v_o, out, lse)
        ctx.scale, ctx.rng = scale, (rng_p, rng_o)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k_p, v_p, k_o, v_o, out, lse = ctx.saved_tensors
        do = do.contiguous()
        dq_p, dk_p, dv_p = _part_backward(do, q, k_p, v_p, out, lse, False, ctx.scale, ctx.rng[0])
        dq_o, dk_o, dv_o = _part_backward(do, q, k_o, v_o, out, lse, True, ctx.scale, ctx.rng[1])
        return dq_p + dq_o, dk_p, dv_p, dk_o, dv_o, None


# ------------------------------------------------------------------------------------------ the packed row

def varlen_attention(query, key, value, params: PackedSeqParams, scale: float) -> torch.Tensor:
    """query [t, hq, d], key/value [t, hk, d] (hq a multiple of hk) -> [t, hq * d]; padding rows give 0."""
    t, hq, d = query.shape
    if key.shape[1] != hq:  # grouped-query attention: share each key/value head with its query group
        key = key.repeat_interleave(hq // key.shape[1], dim=1)
        value = value.repeat_interleave(hq // value.shape[1], dim=1)
    q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))  # [1, h, t, d]
    starts, lengths, prefix_of = segments_of(params)
    pieces, at = [], 0
    for s, n, p in zip(starts, lengths, prefix_of):
        if s > at:
            pieces.append(query.new_zeros(1, hq, s - at, d))
        qs, ks, vs = (x[:, :, s:s + n] for x in (q, k, v))
        if p < 0:
            pieces.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale))
        else:
            ps, pn = starts[p], lengths[p]
            if pn == 0:
                pieces.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale))
            else:
                pieces.append(_Cascade.apply(qs.contiguous(), k[:, :, ps:ps + pn].contiguous(),
                                             v[:, :, ps:ps + pn].contiguous(), ks.contiguous(), vs.contiguous(),
                                             scale))
        at = s + n
    if t > at:
        pieces.append(query.new_zeros(1, hq, t - at, d))
    out = torch.cat(pieces, dim=2)[0].transpose(0, 1)  # [t, h, d]
    return out.reshape(t, hq * d)


class VarlenMixin:
    """Core attention that runs packed rows itself (all of them, or only cascade rows when the base class has its
    own THD kernels) and leaves every other call to the base class."""

    own_thd = True  # False for transformer-engine, whose fused attention takes plain THD rows natively

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if packed_seq_params is not None and (self.own_thd or isinstance(packed_seq_params, CascadeSeqParams)):
            if attention_bias is not None:
                raise NotImplementedError("attention bias with packed rows")
            scale = getattr(self, "softmax_scale", None) or 1.0 / math.sqrt(query.shape[-1])
            return varlen_attention(query, key, value, packed_seq_params, scale)
        return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                               attention_bias=attention_bias, packed_seq_params=packed_seq_params, **kwargs)


class VarlenDotProductAttention(VarlenMixin, DotProductAttention):
    """megatron's local core attention (which rejects packed rows outright) taking every packed row."""


@functools.lru_cache(maxsize=None)
def _varlen_class(base: type) -> type:
    """The packed-row subclass of a core-attention class (one per base, so every build shares it)."""
    if issubclass(base, VarlenMixin):
        return base
    if base is DotProductAttention:
        return VarlenDotProductAttention
    # transformer-engine's (GPU only): it runs plain THD rows itself, so only cascade rows come here
    own = issubclass(base, DotProductAttention)
    return type(f"Varlen{base.__name__}", (VarlenMixin, base), {"own_thd": own})


def with_varlen_core_attention(layer_spec):
    """A copy of a GPT layer spec (or block spec with `layer_specs`) whose core attention takes packed rows."""
    if hasattr(layer_spec, "layer_specs"):
        return dataclasses.replace(layer_spec,
                                   layer_specs=[with_varlen_core_attention(s) for s in layer_spec.layer_specs])
    attn = layer_spec.submodules.self_attention
    core = attn.submodules.core_attention
    if isinstance(core, type):
        new_core = _varlen_class(core)
    else:  # a ModuleSpec wrapping the class
        new_core = dataclasses.replace(core, module=_varlen_class(core.module))
    new_attn = dataclasses.replace(attn, submodules=dataclasses.replace(attn.submodules, core_attention=new_core))
    return dataclasses.replace(layer_spec,
                               submodules=dataclasses.replace(layer_spec.submodules, self_attention=new_attn))
