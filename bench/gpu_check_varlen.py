"""gpu_check's `varlen_train` section: padded rows vs varlen (THD) packing vs varlen + cascade shared prefix on a
DeepScaleR-shaped batch (a few long, many short completions per group), on the train section's worker.

Per layout: tokens fed, step time (median of the timed steps after one warm-up), finite loss, and the largest logprob
difference to the padded layout on the same weights. Then the cascade attention op itself on the device (fp32 and
bf16, forward and gradients) against an explicit-mask softmax attention in fp64: on CUDA that is the only place the
memory-efficient-kernel branch of `models/varlen_attention.py` runs (no CPU test reaches it). Under transformer-engine
plain varlen rows go to TE's fused THD attention; without TE (the lent machine's usual state) both use the torch path.
"""
from __future__ import annotations

import math
import statistics

import torch

LAYOUTS = {"padded": (False, False), "varlen": (False, True), "varlen_cascade": (True, True)}


def _masked_reference(q, k, v, starts, lengths, prefix_of, scale):
    t = q.shape[0]
    seg = torch.full((t,), -1, device=q.device)
    for i, (s, n) in enumerate(zip(starts, lengths)):
        seg[s:s + n] = i
    pre = torch.tensor(prefix_of + [-2], device=q.device)[seg.clamp(min=0)]
    pre = torch.where(seg >= 0, pre, torch.full_like(pre, -2))
    same_or_prefix = (seg[:, None] == seg[None, :]) | (pre[:, None] == seg[None, :])
    allow = (seg[:, None] >= 0) & (seg[None, :] >= 0) & same_or_prefix
    allow &= torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    s = torch.einsum("qhd,khd->hqk", q, kk) * scale
    p = torch.softmax(s.masked_fill(~allow, -1e30), -1) * allow.any(-1)[:, None]
    return torch.einsum("hqk,khd->qhd", p, vv).reshape(t, -1)


def cascade_op_errors(device, dtype, prefix: int, completions: list[int], heads=(8, 2), head_dim=64) -> dict:
    """Max abs errors of the cascade op (one group: a prefix and its completions, padded to 8) vs fp64 masked."""
    from megatron_rl.models.varlen_attention import CascadeSeqParams, varlen_attention

    starts, lengths, at = [], [], 0
    for n in [prefix] + completions:
        starts.append(at)
        lengths.append(n)
        at += -(-n // 8) * 8
    prefix_of = [-1] + [0] * len(completions)
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
    ref = _masked_reference(*rs, starts, lengths, prefix_of, scale)
    rgrads = torch.autograd.grad((ref * do).sum(), rs)
    err = {"out": float((out.double() - ref).abs().max())}
    for name, a, b in zip(("dq", "dk", "dv"), grads, rgrads):
        err[name] = float((a.double() - b).abs().max())
    return err


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
    dev = plat.device()
    out["cascade_op"] = {str(dt).replace("torch.", ""): cascade_op_errors(dev, dt, **sh["cascade_op"])
                         for dt in (torch.float32, torch.bfloat16)}
    return out
