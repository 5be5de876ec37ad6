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
CUDA torch's memory-efficient kernel (fp32 and bf16; flash on CUDA takes no fp32), whose numbers no CPU test sees
(`bench/gpu_check.py` checks them on a lent GPU; `tests/unit/test_varlen.py` checks, on `meta` tensors, the layout
this module hands it).
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
from megatron.core.transformer.enums import AttnMaskType


@dataclass
class CascadeSeqParams(PackedSeqParams):
    """PackedSeqParams plus, per segment, the index of the segment it also attends in full (-1: none), and the
    segment bounds as host lists (no device sync per layer)."""

    per_token_positions = True  # class attribute: RoPE from each token's position (policy/model_hooks.py)
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
    # CUDA (no CPU test computes it; bench/gpu_check.py's varlen_train checks it against an fp64 reference):
    # the memory-efficient kernel (fp32 and bf16), called the way torch's own SDPA calls it ([b, s, h, d] layout,
    # mask type 1 = causal from the top-left, equal to bottom-right here as the causal part is square)
    o, lse, seed, offset, _, _ = torch.ops.aten._efficient_attention_forward(
        *(x.transpose(1, 2) for x in (q, k, v)), None, None, None, None, None, 0.0, int(causal), True, scale=scale)
    return o.transpose(1, 2), lse[..., :q.shape[2]], (seed, offset)


def _part_backward(do, q, k, v, o, lse, causal: bool, scale: float, rng):
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            do, q, k, v, o, lse.contiguous(), 0.0, causal, scale=scale)
    # CUDA: the memory-efficient kernel's layout. q, k, v: any strides (they are passed), last dim dense. `o`: its
    # rows at m * h * d, always: for bf16/fp16 the kernel computes Delta = rowsum(dO * O) itself and hard-codes O's
    # row stride as h * d (only its batch and head strides are passed; fp32 computes Delta in torch, honouring
    # strides, so only bf16 went wrong). `do` dense too (torch would copy it per call otherwise). Both come as
    # slices of a [t, h * d] row (_PackedRow.backward), so no copy here. lse: fp32, padded as the forward returns it
    pad = (-lse.shape[-1]) % 32  # the efficient kernel keeps lse padded to a multiple of 32 queries
    lse_p = F.pad(lse, (0, pad)) if pad else lse
    t = [x.transpose(1, 2) for x in (do, q, k, v, o)]
    dq, dk, dv, _ = torch.ops.aten._efficient_attention_backward(
        t[0], t[1], t[2], t[3], None, t[4], None, None, q.shape[2], k.shape[2], lse_p.contiguous(), 0.0,
        rng[0], rng[1], int(causal), False, scale=scale)
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def _merge(o_p, lse_p, o_o, lse_o, dtype):
    """Two parts' outputs merged by log-sum-exp, in fp32 at least (fp64 stays fp64): (out in `dtype`, lse)."""
    acc = torch.promote_types(dtype, torch.float32)
    lse = torch.logaddexp(lse_p.to(acc), lse_o.to(acc))
    out = (torch.exp(lse_p - lse)[..., None] * o_p.to(acc) + torch.exp(lse_o - lse)[..., None] * o_o.to(acc))
    return out.to(dtype), lse


def _runs(segs):
    """Segments grouped into runs: consecutive, gap-free segments attending the same prefix (a GRPO group's
    completions), or a single segment. (prefix start, prefix length, [(start, length), ...])."""
    runs = []
    for s, n, ps, pn in segs:
        last = runs[-1] if runs else None
        if pn and last and last[:2] == (ps, pn) and sum(last[2][-1]) == s:
            last[2].append((s, n))
        else:
            runs.append((ps, pn, [(s, n)]))
    return runs


class _PackedRow(torch.autograd.Function):
    """A whole packed row [t, h, d] in one autograd node. Per segment: causal attention to itself, and for a
    cascade segment also full attention to its prefix, merged by log-sum-exp. The prefix part of a group's
    completions is ONE kernel call over all their queries (attention to the prefix is full, so each query's result
    is its own), whose backward also sums the prefix's key/value gradient over the group. One node, not one per
    segment: autograd's backward of each segment's slice of q, k, v would materialise a zero tensor of the whole
    row and add it into the row's gradient, O(segments x t) work per layer. Segments are strided views of the row
    (no per-segment copies); outputs and gradients are concatenated once."""

    @staticmethod
    def forward(ctx, query, key, value, segs, scale):
        t, h, d = query.shape
        q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))  # [1, h, t, d] views
        runs = _runs(segs)
        pieces, saved, at = [], [], 0
        for ps, pn, members in runs:
            s0, end = members[0][0], sum(members[-1])
            if s0 > at:  # padding rows give 0
                pieces.append(query.new_zeros(1, h, s0 - at, d))
            own = [_part_forward(*(x[:, :, s:s + n] for x in (q, k, v)), True, scale) for s, n in members]
            o = torch.cat([x[0] for x in own], dim=2) if len(own) > 1 else own[0][0]
            lse = torch.cat([x[1] for x in own], dim=2) if len(own) > 1 else own[0][1]
            rng_p = ()
            if pn:
                o_p, lse_p, rng_p = _part_forward(q[:, :, s0:end], k[:, :, ps:ps + pn], v[:, :, ps:ps + pn], False,
                                                  scale)
                o, lse = _merge(o_p, lse_p, o, lse, query.dtype)
            pieces.append(o)
            saved.append((lse, [x[2] for x in own], rng_p))
            at = end
        if t > at:
            pieces.append(query.new_zeros(1, h, t - at, d))
        out = torch.cat(pieces, dim=2) if len(pieces) > 1 else pieces[0]  # [1, h, t, d]
        # the row as [t, h * d] (a copy where `out` is the concatenation, as reshape made before), saved in that
        # layout: its segments' slices are then the dense [1, s, h, d] rows the CUDA backward needs (_part_backward)
        rows = out[0].transpose(0, 1).contiguous().view(t, h * d)
        ctx.save_for_backward(query, key, value, rows)
        ctx.runs, ctx.scale, ctx.saved = runs, scale, saved
        return rows

    @staticmethod
    def backward(ctx, dout):
        query, key, value, rows = ctx.saved_tensors
        t, h, d = query.shape
        q, k, v = (x.transpose(0, 1)[None] for x in (query, key, value))
        out, do = (x.view(t, h, d).transpose(0, 1)[None] for x in (rows, dout.contiguous()))  # dense rows of h * d
        acc = torch.promote_types(query.dtype, torch.float32)
        dq, dk, dv = [], [], []  # per segment (and padding gap), in row order
        piece_at, to_prefix = {}, []  # segment start -> its index in dk/dv; (prefix start, dk, dv) to add there
        at = 0
        for (ps, pn, members), (lse, rngs, rng_p) in zip(ctx.runs, ctx.saved):
            s0, end = members[0][0], sum(members[-1])
            if s0 > at:
                for g in (dq, dk, dv):
                    g.append(query.new_zeros(1, h, s0 - at, d))
            g_q = []
            for (s, n), rng in zip(members, rngs):
                a, b, c = _part_backward(*(x[:, :, s:s + n] for x in (do, q, k, v, out)), lse[:, :, s - s0:s - s0 + n],
                                         True, ctx.scale, rng)
                piece_at[s] = len(dk)
                g_q.append(a)
                dk.append(b)
                dv.append(c)
            g_q = torch.cat(g_q, dim=2) if len(g_q) > 1 else g_q[0]
            if pn:
                g_qp, g_kp, g_vp = _part_backward(do[:, :, s0:end], q[:, :, s0:end], k[:, :, ps:ps + pn],
                                                  v[:, :, ps:ps + pn], out[:, :, s0:end], lse, False, ctx.scale,
                                                  rng_p)
                g_q = g_q + g_qp
                to_prefix.append((ps, g_kp, g_vp))
            dq.append(g_q)
            at = end
        if t > at:
            for g in (dq, dk, dv):
                g.append(query.new_zeros(1, h, t - at, d))
        for ps, g_kp, g_vp in to_prefix:  # a prefix's own gradient plus its group's, summed in fp32 at least
            i = piece_at[ps]
            dk[i] = dk[i].to(acc) + g_kp
            dv[i] = dv[i].to(acc) + g_vp
        return (*(torch.cat([p.to(x.dtype) for p in g], dim=2)[0].transpose(0, 1)
                  for g, x in ((dq, query), (dk, key), (dv, value))), None, None)


# ------------------------------------------------------------------------------------------ the packed row

def varlen_attention(query, key, value, params: PackedSeqParams, scale: float) -> torch.Tensor:
    """query [t, hq, d], key/value [t, hk, d] (hq a multiple of hk) -> [t, hq * d]; padding rows give 0."""
    hq = query.shape[1]
    if key.shape[1] != hq:  # grouped-query attention: share each key/value head with its query group
        key = key.repeat_interleave(hq // key.shape[1], dim=1)
        value = value.repeat_interleave(hq // value.shape[1], dim=1)
    starts, lengths, prefix_of = segments_of(params)
    # (start, length, prefix start, prefix length); prefix length 0: plain causal segment
    segs = tuple((s, n, starts[p] if p >= 0 else 0, lengths[p] if p >= 0 else 0)
                 for s, n, p in zip(starts, lengths, prefix_of) if n > 0)
    return _PackedRow.apply(query, key, value, segs, scale)


_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal, AttnMaskType.causal_bottom_right)  # equal for sq == sk
DENSE_SDPA = True  # bench/shared_prefix_bench.py flips it to time megatron's own unfused path against it


def dense_attention(query, key, value, attention_mask, causal: bool, scale: float) -> torch.Tensor:
    """Unpacked rows through torch's fused attention: query [s, b, hq, d], key/value [s, b, hk, d], megatron's bool
    `attention_mask` (True = masked, broadcastable to [b, 1, s, s]) or None -> [s, b, hq * d].

    megatron's local path forms the [b, h, s, s] scores, casts them to fp32, masks, softmaxes, casts the
    probabilities back (bf16) and keeps them for the backward in every layer; torch's kernel (flash on CPU, fp32
    accumulation in bf16 too) never forms them. Measured (2026-12-02, 2-core Intel Xeon with AMX, bf16 train step
    of SmolLM2-135M, 8 groups x 8 completions with shared-prefix block masks): at the demo's rows (prompt 137,
    completions ~20) the same step time (8.1 vs 8.2 s, medians of 6 alternating runs); at the tool demo's rows
    (prompt 330, completions ~70) 13.4 GB peak RSS and 28-29 s per step, where megatron's path was killed for
    memory above 23 GB. A query row that may attend nothing (a padding row of a block mask) attends to itself
    instead of giving NaN: megatron's -10000 fill spreads it uniformly; both are padding that no real token attends
    and no loss reads."""
    s, b, hq, d = query.shape
    if key.shape[2] != hq:  # grouped-query attention: each key/value head serves its query group
        key = key.repeat_interleave(hq // key.shape[2], dim=2)
        value = value.repeat_interleave(hq // value.shape[2], dim=2)
    q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, h, s, d]
    mask = None
    if attention_mask is not None:
        mask = ~attention_mask.bool()
        mask = mask | torch.eye(s, key.shape[0], dtype=torch.bool, device=mask.device)
        causal = False
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale)
    return out.permute(2, 0, 1, 3).reshape(s, b, hq * d)


class VarlenMixin:
    """Core attention that runs packed rows itself (all of them, or only cascade rows when the base class has its
    own THD kernels) and leaves every other call to the base class, except that megatron's local core attention
    hands its unpacked rows to torch's fused kernel (`dense_attention`) where that computes the same thing: no
    attention bias, dropout, sliding window or softmax offset (those stay on megatron's path)."""

    own_thd = True  # False for transformer-engine, whose fused attention takes plain THD rows natively

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None, **kwargs):
        if getattr(packed_seq_params, "order", None) is not None:  # a context-parallel row (policy.cp)
            from megatron_rl.models.cp_attention import cp_attention

            if attention_bias is not None:
                raise NotImplementedError("attention bias with context parallelism")
            scale = getattr(self, "softmax_scale", None) or 1.0 / math.sqrt(query.shape[-1])
            return cp_attention(query, key, value, packed_seq_params, scale)
        if packed_seq_params is not None and (self.own_thd or isinstance(packed_seq_params, CascadeSeqParams)):
            if attention_bias is not None:
                raise NotImplementedError("attention bias with packed rows")
            scale = getattr(self, "softmax_scale", None) or 1.0 / math.sqrt(query.shape[-1])
            return varlen_attention(query, key, value, packed_seq_params, scale)
        if packed_seq_params is None and query.shape[0] == key.shape[0] and self._dense_ok(attention_bias):
            mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
            return dense_attention(query, key, value, attention_mask, mask_type in _CAUSAL, self.softmax_scale)
        return super().forward(query, key, value, attention_mask, attn_mask_type=attn_mask_type,
                               attention_bias=attention_bias, packed_seq_params=packed_seq_params, **kwargs)

    def _dense_ok(self, attention_bias) -> bool:
        if not (DENSE_SDPA and self.own_thd and isinstance(self, DotProductAttention)) or attention_bias is not None:
            return False
        dropout = self.attention_dropout.p if self.training else 0.0
        return (dropout == 0.0 and getattr(self, "softmax_offset", None) is None
                and getattr(self.scale_mask_softmax, "window_size", None) is None)


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
