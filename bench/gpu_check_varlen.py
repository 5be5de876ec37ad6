"""gpu_check's `varlen_train` section: padded rows vs varlen (THD) packing vs varlen + cascade shared prefix on a
DeepScaleR-shaped batch (a few long, many short completions per group), on the train section's worker.

Per layout: tokens fed, step time (median of the timed steps after one warm-up), finite loss, and the largest logprob
difference to the padded layout on the same weights. Then the packed attention op itself on the device, on a cascade
row and on a plain varlen row (fp32 and bf16, forward and gradients), against plain per-segment softmax attention in
fp64, each error within OP_BOUNDS or the section fails: on CUDA that is the only place the memory-efficient-kernel
branch of `models/varlen_attention.py` computes numbers (a CPU test checks only the layout it hands the kernel).
Under transformer-engine plain varlen rows go to TE's fused THD attention; without TE (the lent machine's usual state)
both use the torch path.
"""
from __future__ import annotations

import math
import statistics

import torch

LAYOUTS = {"padded": (False, False), "varlen": (False, True), "varlen_cascade": (True, True)}


# Bound on every op error below: max |packed - reference| / max |reference|, per tensor (out, dq, dk, dv). The packed
# op takes the fp64 inputs rounded to `dtype` and stores its results in `dtype`; the reference computes in fp64 on the
# unrounded inputs. bf16 keeps 8 significant bits (unit roundoff u = 2^-9 ~ 2e-3): rounding the inputs and the result,
# and the kernel's bf16 copies of P and dS in the backward, give a few u relative to the largest value (4e-3 to 8e-3
# on CPU at GPU_SHAPES, and in a torch emulation of the CUDA kernel's bf16 roundings); 2e-2 (~10 u) leaves room for
# that and is far below what a wrong Delta, mask or prefix sum gives (1e-1 to 1 for Delta read from the wrong rows,
# in that emulation). fp32 (3xTF32 on sm80+, fp32 on CPU; 1e-6 on CPU): 1e-4 leaves the same kind of room.
OP_BOUNDS = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
LAYOUT_MEAN_BOUND = 0.05  # nats: mean |logprob(layout) - logprob(padded)| over every token, same weights (bf16)


def _segment_reference(q, k, v, starts, lengths, prefix_of, scale):
    """Plain softmax attention, one segment at a time: its queries attend all of its prefix's keys and its own keys
    causally; rows outside every segment are 0. Written out in the inputs' precision (fp64 here), no fused kernel."""
    t, hq, d = q.shape
    rep = hq // k.shape[1]
    out = q.new_zeros(t, hq, d)
    for s, n, p in zip(starts, lengths, prefix_of):
        ps, pn = (starts[p], lengths[p]) if p >= 0 else (0, 0)
        kk, vv = (torch.cat([x[ps:ps + pn], x[s:s + n]]).repeat_interleave(rep, 1) for x in (k, v))
        allow = torch.ones(n, pn + n, dtype=torch.bool, device=q.device).tril(diagonal=pn)  # prefix full, own causal
        scores = torch.einsum("qhd,khd->hqk", q[s:s + n], kk) * scale
        out[s:s + n] = torch.einsum("hqk,khd->qhd", torch.softmax(scores.masked_fill(~allow, -math.inf), -1), vv)
    return out.reshape(t, -1)


def packed_op_errors(device, dtype, lengths: list[int], prefix_of: list[int], heads=(8, 2), head_dim=64) -> dict:
    """The packed-row op (`varlen_attention`, each segment padded to 8) vs `_segment_reference` in fp64 on the same
    inputs: per tensor the max abs error, and (`rel`) its ratio to the largest reference value against OP_BOUNDS."""
    from megatron_rl.models.varlen_attention import CascadeSeqParams, varlen_attention

    starts, at = [], 0
    for n in lengths:
        starts.append(at)
        at += -(-n // 8) * 8
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(at, h, head_dim, generator=g, device=device, dtype=torch.float64)
               for h in (heads[0], heads[1], heads[1]))
    do = torch.randn(at, heads[0] * head_dim, generator=g, device=device, dtype=torch.float64)
    scale = 1 / math.sqrt(head_dim)
    params = CascadeSeqParams(qkv_format="thd", prefix_of=prefix_of, starts=starts, lengths=lengths)
    xs = [x.to(dtype).requires_grad_() for x in (q, k, v)]
    out = varlen_attention(*xs, params, scale)
    grads = torch.autograd.grad((out.double() * do).sum(), xs)
    rs = [x.clone().requires_grad_() for x in (q, k, v)]
    ref = _segment_reference(*rs, starts, lengths, prefix_of, scale)
    rgrads = torch.autograd.grad((ref * do).sum(), rs)
    err, rel = {}, {}
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *rgrads)):
        err[name] = float((a.double() - b).abs().max())
        rel[name] = err[name] / float(b.abs().max())
    return {**err, "rel": rel, "bound": OP_BOUNDS[dtype],
            "over_bound": sorted(name for name, r in rel.items() if not r <= OP_BOUNDS[dtype])}  # NaN counts as over


def op_checks(device, prefix: int, completions: list[int]) -> dict:
    """The op on a cascade row (a prefix and its completions) and on a plain varlen row (the same lengths, each
    segment causal on its own), fp32 and bf16: the only check of the numbers the CUDA kernel branch of
    `models/varlen_attention.py` computes (its CPU test, on `meta` tensors, checks the layout it hands the kernel)."""
    lengths = [prefix] + completions
    rows = {"cascade_op": [-1] + [0] * len(completions), "varlen_op": [-1] * len(lengths)}
    return {row: {str(dt).replace("torch.", ""): packed_op_errors(device, dt, lengths, prefix_of)
                  for dt in (torch.float32, torch.bfloat16)} for row, prefix_of in rows.items()}


def over_bounds(checks: dict) -> list[str]:
    """`op_checks`' errors over their bounds, one line each."""
    return [f"{row} {dt} {name}: {r['rel'][name]:.3g} > {r['bound']:g}"
            for row in ("cascade_op", "varlen_op") for dt, r in checks[row].items() for name in r["over_bound"]]


def varlen_train(check) -> dict:
    from bench.shared_prefix_bench import grpo_batch
    from megatron_rl.platform import get_platform

    w, sh = check._need_worker(), check.shapes
    if not w.shared_prefix:
        raise RuntimeError("the worker's shared-prefix hooks are not installed (sliding window or fused RoPE)")
    batch = grpo_batch(w.spec.vocab_size, sh["groups"], sh["completions"], sh["group_prompt"], sh["short"],
                       sh["long"])
    saved = (w.shared_prefix, w.varlen, w.narrow_logits)
    out = {"layer_spec": w.gpt.megatron_rl_layer_spec, "sequences": len(batch),
           "sequence_tokens": sum(len(i) - 1 for i in batch.input_ids), "layouts": {}}
    plat = get_platform()
    train_batch, check.batch = check.batch, batch  # check._step trains on check.batch
    try:
        lps = {}
        for name, (shared, varlen) in LAYOUTS.items():
            w.shared_prefix, w.varlen, w.narrow_logits = shared, varlen, True
            lps[name] = w.logprobs(batch)
            fed = sum(mb.tokens.numel() for mb in w._micro_batches(batch))
            out["layouts"][name] = {"tokens_fed": fed}
        for name, (shared, varlen) in LAYOUTS.items():
            w.shared_prefix, w.varlen = shared, varlen
            res = out["layouts"][name]
            res["max_logprob_diff_vs_padded"] = max(float((lps[name][i] - lps["padded"][i]).abs().max())
                                                    for i in range(len(batch)))
            diffs = torch.cat([(lps[name][i] - lps["padded"][i]).abs().float() for i in range(len(batch))])
            res["mean_logprob_diff_vs_padded"] = float(diffs.mean())
            losses, times = zip(*[check._step() for _ in range(1 + sh["steps"])])
            res.update(first_step_s=times[0], step_s=list(times[1:]), loss=list(losses),
                       tokens_per_s=out["sequence_tokens"] / statistics.median(times[1:]))
        pad = out["layouts"]["padded"]
        for name in ("varlen", "varlen_cascade"):
            r = out["layouts"][name]
            r["speedup_vs_padded"] = statistics.median(pad["step_s"]) / statistics.median(r["step_s"])
        if plat.is_gpu:
            out["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 2**30
    finally:
        w.shared_prefix, w.varlen, w.narrow_logits = saved
        check.batch = train_batch
    out.update(op_checks(plat.device(), **sh["cascade_op"]))
    over = over_bounds(out)
    # the same weights in another row layout: bf16 rounding moves single tokens (0.43 at most measured on CPU,
    # SmolLM2-135M, bf16), a wrong mask, position or prefix moves them all; the mean is what is bounded
    over += [f"{n}: mean logprob diff vs padded {r['mean_logprob_diff_vs_padded']:.3g} > {LAYOUT_MEAN_BOUND}"
             for n, r in out["layouts"].items() if r["mean_logprob_diff_vs_padded"] > LAYOUT_MEAN_BOUND]
    if over:  # failed as gpu_check records a failure, keeping this section's numbers beside it
        out["error"] = "over its bound (op: relative to the largest value vs fp64; layouts: mean nats): " + \
            "; ".join(over)
    return out
