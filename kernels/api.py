"""Public entry points: autograd Functions, implementation dispatch and the tensor-parallel reductions.

Shared scheme (both implementations, see triton_logprobs.py / chunked.py):
  1. each rank scans its vocab shard once and produces per-row statistics of z = logits / temperature:
     m (max), s = sum exp(z - m), w = sum exp(z - m)(z - m), zt = target logit if the target is in the shard;
  2. with a TP group, only those O(tokens) numbers are all-reduced: a MAX for m, then s and w are re-centred on the
     global max M and SUM-reduced together with zt (two collectives per call);
  3. logprob = zt - M - log S and entropy = log S - W / S are finished in torch;
  4. backward needs no communication: with the global (M, log S, W / S) saved, each rank recomputes softmax over
     its own shard and writes its slice of the gradient.

Gradients, with z = logits / T, p = softmax(z), E[z] = sum_j p_j z_j:
  d logprob / d z_i = onehot_i - p_i
  d H / d z_i: H = lse(z) - E[z]; d lse / d z_i = p_i and d E[z] / d z_i = p_i + sum_j z_j p_j (delta_ij - p_i)
              = p_i + p_i z_i - p_i E[z], so d H / d z_i = -p_i (z_i - E[z]);
and each is divided by T for the logits. (Checked against autograd through the naive reference in the tests.)

Ignore index: rows whose target is negative (e.g. -100) get logprob 0 and no gradient from the logprob. Their
entropy is still computed (masking entropy is the caller's loss mask's job). Targets must otherwise lie in
[0, full vocab): a target past the vocab is not found on any rank and silently reads as logit 0.
Rows whose logits are all -inf have no defined softmax; the result there is not specified.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from kernels import chunked, linear

IMPL_ENV = "MEGATRON_RL_LOGPROB_IMPL"
_IMPLS = ("triton", "torch")
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def triton_usable(device: torch.device) -> bool:
    """Triton runs on CUDA tensors, or on CPU tensors only under the interpreter (TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    if device.type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def choose_impl(t: torch.Tensor, impl: str | None = None) -> str:
    """``impl`` argument > $MEGATRON_RL_LOGPROB_IMPL > "triton" for CUDA tensors when triton imports, else "torch"."""
    impl = impl or os.environ.get(IMPL_ENV) or None
    if impl is None:
        return "triton" if t.is_cuda and triton_usable(t.device) else "torch"
    if impl not in _IMPLS:
        raise ValueError(f"unknown logprob impl {impl!r}; expected one of {_IMPLS}")
    if impl == "triton" and not triton_usable(t.device):
        raise RuntimeError("impl='triton' needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported")
    return impl


def _backend(impl: str):
    if impl == "triton":
        from kernels import triton_logprobs  # imported lazily: importing triton is slow and may be absent
        return triton_logprobs
    return chunked


def _tp_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _reduce_stats(m, s, w, zt, group):
    """Combine per-shard row stats into global ones (in place over this rank's tensors where possible)."""
    if _tp_size(group) == 1:
        return m, s, w, zt
    M = m.clone()
    # raw collectives on purpose: these stats come from this rank's logit shard, already on the TP group's device
    dist.all_reduce(M, op=dist.ReduceOp.MAX, group=group)
    scale = torch.exp(m - M)  # m may be the -1e30 sentinel for an all -inf shard: scale 0, and s = w = 0 there
    parts = [s * scale, zt]
    if w is not None:
        # sum e^(z-M)(z-M) = e^(m-M) * (sum e^(z-m)(z-m) + (m - M) * sum e^(z-m))
        parts.append(scale * (w + (m - M) * s))
    buf = torch.stack(parts)
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    return M, buf[0], (buf[2] if w is not None else None), buf[1]


def _finish(M, S, W, ZT, targets):
    """(logprob, entropy or None, log S, mean of z - M) from global stats."""
    log_s = torch.log(S)
    lp = torch.where(targets < 0, torch.zeros_like(ZT), ZT - M - log_s)
    if W is None:
        return lp, None, log_s, torch.zeros_like(S)
    mz = W / S
    return lp, log_s - mz, log_s, mz


def _prep_grads(g_lp, g_ent, targets, with_entropy):
    if g_lp is not None:
        g_lp = torch.where(targets < 0, 0.0, g_lp.float()).contiguous()
    g_ent = g_ent.float().contiguous() if (with_entropy and g_ent is not None) else None
    return g_lp, g_ent


class _LogprobEntropyFn(torch.autograd.Function):
    """logits2d [N, V_local], targets [N] -> (logprob [N] fp32, entropy [N] fp32; zeros when not requested)."""

    @staticmethod
    def forward(ctx, x, targets, group, vocab_start, temperature, impl, chunk, with_entropy):
        be = _backend(impl)
        m, s, w, zt = be.row_stats(x, targets, vocab_start=vocab_start, temperature=temperature,
                                   with_entropy=with_entropy, chunk=chunk)
        M, S, W, ZT = _reduce_stats(m, s, w, zt, group)
        lp, ent, log_s, mz = _finish(M, S, W, ZT, targets)
        ctx.save_for_backward(x, targets, M, log_s, mz)
        ctx.cfg = (vocab_start, temperature, impl, chunk, with_entropy)
        ctx.set_materialize_grads(False)  # unused outputs give None: the kernel then skips that term
        if ent is None:
            ent = torch.zeros_like(lp)
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        x, targets, M, log_s, mz = ctx.saved_tensors
        vocab_start, temperature, impl, chunk, with_entropy = ctx.cfg
        g_lp, g_ent = _prep_grads(g_lp, g_ent, targets, with_entropy)
        if g_lp is None and g_ent is None:
            return (None,) * 8
        dx = _backend(impl).grad_logits(x, targets, M, log_s, mz, g_lp, g_ent, vocab_start=vocab_start,
                                        temperature=temperature, chunk=chunk)
        return dx, None, None, None, None, None, None, None


def _flatten(logits: torch.Tensor, targets: torch.Tensor | None, temperature: float):
    if logits.dtype not in _FLOATS:
        raise TypeError(f"logits must be fp32/bf16/fp16, got {logits.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    V = logits.shape[-1]
    x = logits.reshape(-1, V)
    if x.stride(-1) != 1:  # kernels need unit stride along the vocab; any row stride is fine
        x = x.contiguous()
    if targets is None:  # entropy only: every row "ignored" for the logprob
        t = torch.full((x.shape[0],), -1, dtype=torch.long, device=logits.device)
    else:
        if targets.shape != logits.shape[:-1]:
            raise ValueError(f"targets shape {tuple(targets.shape)} != logits.shape[:-1] {tuple(logits.shape[:-1])}")
        t = targets.reshape(-1).to(torch.long).contiguous()
    return x, t


def _run(logits, targets, tp_group, vocab_start_index, temperature, chunk, impl, with_entropy):
    x, t = _flatten(logits, targets, temperature)
    impl = choose_impl(x, impl)
    lp, ent = _LogprobEntropyFn.apply(x, t, tp_group, int(vocab_start_index), float(temperature), impl, chunk,
                                      with_entropy)
    shape = logits.shape[:-1]
    return lp.view(shape), ent.view(shape)


def token_logprobs(logits, targets, *, tp_group=None, vocab_start_index=0, temperature=1.0, chunk=None,
                   impl=None):
    """log softmax(logits / temperature)[target] per token, fp32, shape logits.shape[:-1].

    logits: [..., V_local] fp32/bf16/fp16 — the full vocab, or with ``tp_group`` this rank's shard covering
    [vocab_start_index, vocab_start_index + V_local). targets: global token ids; negative = ignored (logprob 0,
    no gradient). chunk: vocab tile (int) or (token rows, vocab cols) tile. impl: "triton" / "torch" / None (auto,
    or $MEGATRON_RL_LOGPROB_IMPL). Differentiable w.r.t. logits without any [tokens, V] fp32 buffer.
    """
    return _run(logits, targets, tp_group, vocab_start_index, temperature, chunk, impl, False)[0]


def token_entropy(logits, *, tp_group=None, vocab_start_index=0, temperature=1.0, chunk=None, impl=None):
    """Entropy of softmax(logits / temperature) per token (fp32, nats), differentiable; TP as token_logprobs."""
    return _run(logits, None, tp_group, vocab_start_index, temperature, chunk, impl, True)[1]


def token_logprobs_and_entropy(logits, targets, *, tp_group=None, vocab_start_index=0, temperature=1.0,
                               chunk=None, impl=None):
    """(token_logprobs, token_entropy) from one pass over the logits; both differentiable."""
    return _run(logits, targets, tp_group, vocab_start_index, temperature, chunk, impl, True)


class _LinearLogprobFn(torch.autograd.Function):
    """hidden [N, H], weight [V_local, H] -> (logprob [N], entropy [N] or zeros); logits never materialised."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, group, vocab_start, temperature, chunk, with_entropy,
                reduce_hidden_grad):
        m, s, w, zt = linear.row_stats(hidden, weight, targets, vocab_start=vocab_start, temperature=temperature,
                                       with_entropy=with_entropy, chunk=chunk)
        M, S, W, ZT = _reduce_stats(m, s, w, zt, group)
        lp, ent, log_s, mz = _finish(M, S, W, ZT, targets)
        ctx.save_for_backward(hidden, weight, targets, M, log_s, mz)
        ctx.cfg = (group, vocab_start, temperature, chunk, with_entropy, reduce_hidden_grad)
        ctx.set_materialize_grads(False)
        if ent is None:
            ent = torch.zeros_like(lp)
            ctx.mark_non_differentiable(ent)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, targets, M, log_s, mz = ctx.saved_tensors
        group, vocab_start, temperature, chunk, with_entropy, reduce_hidden_grad = ctx.cfg
        g_lp, g_ent = _prep_grads(g_lp, g_ent, targets, with_entropy)
        if g_lp is None and g_ent is None:
            return (None,) * 9
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h, grad_w = linear.grads(hidden, weight, targets, M, log_s, mz, g_lp, g_ent, vocab_start=vocab_start,
                                      temperature=temperature, chunk=chunk, need_hidden=need_h, need_weight=need_w)
        if grad_h is None:
            return None, grad_w, None, None, None, None, None, None, None
        if reduce_hidden_grad and _tp_size(group) > 1:
            # hidden is replicated across the TP group; each rank only saw its vocab shard's share of dL/dhidden
            # (grad_h is on hidden's device, where the TP group's backend needs it)
            dist.all_reduce(grad_h, group=group)
        return grad_h.to(hidden.dtype), grad_w, None, None, None, None, None, None, None


def linear_token_logprobs(hidden, weight, targets, *, tp_group=None, vocab_start_index=0, temperature=1.0,
                          chunk=None, return_entropy=False, reduce_hidden_grad=True):
    """token_logprobs(hidden @ weight.T, targets) computed tile by tile: no [N, V] logits in forward or backward.

    hidden [N, H] (or [..., H]), weight [V_local, H] (this rank's vocab shard with ``tp_group``). Logit tiles are
    computed in the inputs' dtype like a plain lm-head, statistics in fp32. With ``return_entropy`` also returns the
    entropy. With TP the hidden gradient is summed over the group (hidden is replicated, each rank holds part of
    the vocab); pass ``reduce_hidden_grad=False`` if the caller's copy-to-TP-region already does that.
    chunk: (token rows, vocab cols) of a logit block, or vocab cols (kernels/linear.py). One plain-torch
    implementation on every device: its GEMMs are the library's, and on CUDA the elementwise work per block is a
    few large kernels; a Triton version that fuses that work into the GEMM's epilogue is not written.
    """
    if hidden.dtype not in _FLOATS or weight.dtype != hidden.dtype:
        raise TypeError(f"hidden/weight must share a float dtype, got {hidden.dtype}/{weight.dtype}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    lead = hidden.shape[:-1]
    if targets.shape != lead:
        raise ValueError(f"targets shape {tuple(targets.shape)} != hidden.shape[:-1] {tuple(lead)}")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1).to(torch.long).contiguous()
    lp, ent = _LinearLogprobFn.apply(h, weight, t, tp_group, int(vocab_start_index), float(temperature), chunk,
                                     bool(return_entropy), bool(reduce_hidden_grad))
    return (lp.view(lead), ent.view(lead)) if return_entropy else lp.view(lead)
