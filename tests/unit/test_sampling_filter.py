"""Filtered-sampling logprobs (policy/sampling_filter.py) against a plain-torch filtered softmax written from the
sampler's definition (vLLM's `apply_top_k_top_p`: top-k on the logits, then top-p on the ascending-sorted
probabilities renormalised over what top-k kept, masking while the cumulative sum stays <= 1 - p, the largest always
kept), in fp32: values and gradients, with the fused head and with logits, at TP = 1 in process and TP = 2 over gloo
(each rank a vocabulary shard, as megatron's output layer splits it). The importance ratio of an on-policy sample
is exp(trainer - engine) = 1 to 1e-5 when the engine's logprob is the reference's."""
from __future__ import annotations

import pytest
import torch

from megatron_rl.distributed.launch import run_distributed
from megatron_rl.policy.sampling_filter import TokenScoring, log_kept

N, H, V = 12, 16, 96


def reference_filtered_logprobs(z: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """log softmax of the filtered, temperature-scaled logits [n, V] (-inf outside the kept set)."""
    logits = z / temperature
    if top_k > 0:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=False)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        mask_sorted = cum <= 1 - top_p
        mask_sorted[:, -1] = False
        mask = torch.zeros_like(mask_sorted).scatter(-1, order, mask_sorted)
        logits = logits.masked_fill(mask, float("-inf"))
    return logits.log_softmax(-1)


def _problem(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(N, H, generator=g, dtype=torch.float64)
    w = torch.randn(V, H, generator=g, dtype=torch.float64) * 0.7
    z = h @ w.t()
    ref = reference_filtered_logprobs(z, 0.8, 20, 0.8)
    # the engine's samples: tokens of the filtered distribution
    targets = torch.multinomial(ref.exp().float(), 1, generator=g)[:, 0]
    return h.float(), w.float(), targets


class _Head:
    def __init__(self, weight, vocab_start=0):
        self.weight, self.vocab_start = weight, vocab_start


def _filtered(h, w, targets, scoring, fused: bool):
    """(the plain log-softmax's target entry, the trainer's filtered logprob, positions cut at max_kept)."""
    z = h @ w.t()
    lp_full = (z / scoring.temperature).log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    if fused:
        lp, truncated = log_kept(h, _Head(w), targets, scoring)
    else:
        lp, truncated = log_kept(z, None, targets, scoring)
    return lp_full, lp, truncated


@pytest.mark.parametrize("fused", [True, False], ids=["fused-head", "logits"])
@pytest.mark.parametrize("top_k,top_p", [(20, 0.8), (20, 1.0), (-1, 0.8)])
def test_matches_the_sampler_filtered_softmax(fused, top_k, top_p, monkeypatch):
    from megatron_rl.policy import topk

    monkeypatch.setattr(topk, "_ROWS_BUDGET", 5 * 21 * H)  # the fused rows in chunks of ~5 positions
    h, w, targets = _problem()
    scoring = TokenScoring(0.8, top_k, top_p)
    h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
    ref = reference_filtered_logprobs(h64 @ w64.t(), 0.8, top_k, top_p).gather(-1, targets[:, None])[:, 0]
    assert torch.isfinite(ref).all()  # every target was in the kept set
    ref.sum().backward()

    hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
    lp_full, lp, truncated = _filtered(hh, ww, targets, scoring, fused)
    assert truncated == 0
    torch.testing.assert_close(lp.double(), ref.detach(), atol=1e-5, rtol=0)
    # on-policy: the engine's logprob of its own sample is the reference's; the ratio is 1
    ratio = torch.exp(lp.double() - ref.detach())
    assert (ratio - 1).abs().max() < 1e-5
    # the filter moved the logprobs (the kept mass is below 1), so the check is not the unfiltered one
    assert (lp - lp_full > 1e-3).any()
    lp.sum().backward()
    torch.testing.assert_close(hh.grad.double(), h64.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(ww.grad.double(), w64.grad, atol=1e-5, rtol=1e-4)


def test_top_p_alone_counts_positions_cut_at_max_kept():
    h, w, targets = _problem()
    _, lp, truncated = _filtered(h, w, targets, TokenScoring(0.8, -1, 0.99, max_kept=4), fused=True)
    assert truncated > 0 and torch.isfinite(lp).all()


def tp2_body(rank: int, world: int):
    import torch.distributed as dist

    h, w, targets = _problem()
    out = {}
    shard = V // world
    for fused in (True, False):
        for top_k, top_p in ((20, 0.8), (-1, 0.8)):
            scoring = TokenScoring(0.8, top_k, top_p)
            hh = h.clone().requires_grad_()
            wl = w[rank * shard:(rank + 1) * shard].clone().requires_grad_()
            if fused:
                lp, _ = log_kept(hh, _Head(wl, rank * shard), targets, scoring, dist.group.WORLD)
            else:
                z_local = hh @ wl.t()
                lp, _ = log_kept(z_local, None, targets, scoring, dist.group.WORLD, rank * shard)
            lp.sum().backward()
            grad_h = hh.grad.clone()
            if not fused:  # megatron's output layer sums its input's gradient over TP
                dist.all_reduce(grad_h)
            out[(fused, top_k, top_p)] = (lp.detach(), grad_h, wl.grad.clone())
    return out


def test_tp2_equals_tp1():
    h, w, targets = _problem()
    results = run_distributed(tp2_body, 2, timeout=300)
    for (fused, top_k, top_p), _ in results[0].items():
        scoring = TokenScoring(0.8, top_k, top_p)
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        _, lp, _ = _filtered(hh, ww, targets, scoring, fused=True)
        lp.sum().backward()
        for rank, r in enumerate(results):
            lp2, gh, gw = r[(fused, top_k, top_p)]
            torch.testing.assert_close(lp2, lp.detach(), atol=1e-5, rtol=0)
            torch.testing.assert_close(gh, hh.grad, atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(gw, ww.grad[rank * (V // 2):(rank + 1) * (V // 2)], atol=1e-5, rtol=1e-4)
