"""TP=2 rank bodies (run in spawned gloo processes by tests/kernels/test_tp.py). All checks share one launch.

Every rank builds the same full-vocab inputs from a seed, keeps its half of the vocab, runs the vocab-parallel op,
and compares with the full-vocab reference computed locally: forward outputs must equal the reference's, and the
rank's gradient shard must equal the matching slice of the full gradient.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from kernels import linear_token_logprobs, token_logprobs, token_logprobs_and_entropy
from kernels.reference import ref_token_entropy, ref_token_logprobs
from tests.kernels.cases import bf16_tols, make_case


def _close(name, a, b, **tol):
    torch.testing.assert_close(a, b, msg=lambda m: f"[rank {dist.get_rank()}] {name}: {m}", **tol)


def _logits_checks(rank, world, group, done):
    V = 1000  # 500 per rank: not a power of two nor a multiple of the tiles
    Vl = V // world
    lo = rank * Vl
    for impl, chunk in (("triton", (16, 128)), ("torch", (8, 96))):
        for case in ("basic", "extreme", "neginf"):
            for dtype in (torch.float32, torch.bfloat16):
                T = 0.7 if case != "extreme" else 1.0
                x, t = make_case(case, V=V)
                x = x.to(dtype)
                g = torch.Generator().manual_seed(1)
                g_lp, g_ent = torch.randn(t.shape, generator=g), torch.randn(t.shape, generator=g)

                shard = x[:, lo:lo + Vl].clone().requires_grad_()
                lp, ent = token_logprobs_and_entropy(shard, t, tp_group=group, vocab_start_index=lo,
                                                     temperature=T, impl=impl, chunk=chunk)
                (lp * g_lp + ent * g_ent).sum().backward()

                full = x.float().requires_grad_()
                ref_lp = ref_token_logprobs(full, t, temperature=T)
                ref_ent = ref_token_entropy(full, temperature=T)
                (ref_lp * g_lp + ref_ent * g_ent).sum().backward()

                tag = f"{impl}/{case}/{dtype}"
                _close(f"{tag} logprob", lp, ref_lp, atol=2e-5, rtol=1e-5)
                _close(f"{tag} entropy", ent, ref_ent, atol=2e-5, rtol=1e-5)
                ref_g = full.grad[:, lo:lo + Vl]
                if dtype == torch.float32:
                    _close(f"{tag} grad", shard.grad, ref_g, atol=1e-5, rtol=1e-5)
                else:
                    _close(f"{tag} grad", shard.grad.float(), ref_g, **bf16_tols(ref_g))
                done.append(tag)

    # logprob-only path plus the gather-based TP reference itself (forward and backward)
    x, t = make_case("basic", V=V, seed=4)
    shard = x[:, lo:lo + Vl].clone().requires_grad_()
    token_logprobs(shard, t, tp_group=group, vocab_start_index=lo, impl="torch").sum().backward()
    ref_shard = x[:, lo:lo + Vl].clone().requires_grad_()
    ref_tp = ref_token_logprobs(ref_shard, t, tp_group=group)
    ref_tp.sum().backward()
    full = x.clone().requires_grad_()
    ref_lp = ref_token_logprobs(full, t)
    ref_lp.sum().backward()
    _close("gather reference forward", ref_tp, ref_lp, atol=1e-6, rtol=0)
    _close("gather reference grad", ref_shard.grad, full.grad[:, lo:lo + Vl], atol=1e-6, rtol=0)
    _close("logprob-only grad", shard.grad, full.grad[:, lo:lo + Vl], atol=1e-5, rtol=1e-5)
    done.append("logprob-only + gather reference")


def _linear_checks(rank, world, group, done):
    N, H, V = 40, 16, 302
    Vl = V // world
    lo = rank * Vl
    g = torch.Generator().manual_seed(2)
    h = torch.randn(N, H, generator=g)
    w = torch.randn(V, H, generator=g) * 0.7
    t = torch.randint(0, V, (N,), generator=g)
    t[3] = -100
    for with_ent in (False, True):
        hs, ws = h.clone().requires_grad_(), w[lo:lo + Vl].clone().requires_grad_()
        out = linear_token_logprobs(hs, ws, t, tp_group=group, vocab_start_index=lo, temperature=0.8,
                                    chunk=(16, 64), return_entropy=with_ent)
        lp, ent = out if with_ent else (out, None)
        hf, wf = h.clone().requires_grad_(), w.clone().requires_grad_()
        logits = hf @ wf.t()
        ref_lp = ref_token_logprobs(logits, t, temperature=0.8)
        loss, ref_loss = lp.sum(), ref_lp.sum()
        if with_ent:
            ref_ent = ref_token_entropy(logits, temperature=0.8)
            loss, ref_loss = loss + 0.3 * ent.sum(), ref_loss + 0.3 * ref_ent.sum()
            _close(f"linear entropy", ent, ref_ent, atol=2e-5, rtol=1e-5)
        loss.backward()
        ref_loss.backward()
        _close(f"linear logprob ent={with_ent}", lp, ref_lp, atol=2e-5, rtol=1e-5)
        _close(f"linear grad hidden (all-reduced) ent={with_ent}", hs.grad, hf.grad, atol=1e-5, rtol=1e-5)
        _close(f"linear grad weight shard ent={with_ent}", ws.grad, wf.grad[lo:lo + Vl], atol=1e-5, rtol=1e-5)
        done.append(f"linear ent={with_ent}")


def tp_checks(rank: int, world_size: int):
    group = dist.new_group(list(range(world_size)))  # a real subgroup, as a TP group would be
    done: list[str] = []
    _logits_checks(rank, world_size, group, done)
    _linear_checks(rank, world_size, group, done)
    return done
