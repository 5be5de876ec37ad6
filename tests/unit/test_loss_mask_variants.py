"""A multi-turn observation token (loss mask 0) is context, not a trained token: with every loss variant, normaliser,
importance correction (the async default), importance mask, KL and entropy term, the loss and its gradient over a
micro-batch whose masked tokens hold garbage (the generator has no logprob for an observation: 0.0 is stored) equal
those over the same micro-batch with the masked tokens deleted. The reference is the deletion, so a masked token that
leaked into any term (a weight, a normaliser, a sequence mean, a metric) would show."""
from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from megatron_rl.algorithms.loss import grpo_loss
from megatron_rl.config.schema import LossConfig

VARIANTS = [dict(variant=v, normalizer=n) for v, n in itertools.product(
    ("grpo", "gspo", "cispo"), ("tokens", "sequences", "constant"))]
EXTRAS = [dict(), dict(importance_correction="token"), dict(importance_correction="sequence"),
          dict(importance_correction="token", importance_mask="token"), dict(importance_mask="sequence"),
          dict(kl_coef=0.1, entropy_coef=0.01, ratio_clip_c=3.0)]


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    lens = [7, 5, 9]
    n = sum(lens)
    seq = torch.cat([torch.full((k,), i) for i, k in enumerate(lens)])
    keep = torch.rand(n, generator=g) > 0.35  # observation tokens where False
    keep[torch.tensor([0, 7, 12])] = True  # every sequence keeps a trained token
    lp = (-torch.rand(n, generator=g) * 2).requires_grad_(True)
    old = (lp.detach() + 0.1 * torch.randn(n, generator=g))
    gen = torch.where(keep, old + 0.05 * torch.randn(n, generator=g), torch.zeros(n))  # 0.0: no generator lp
    ref = lp.detach() + 0.2 * torch.randn(n, generator=g)
    ent = torch.rand(n, generator=g).requires_grad_(True)
    adv = torch.tensor([1.0, -0.5, 0.7])[seq]
    # garbage where masked: what the trainer computes for an observation is no sample of the policy
    old = torch.where(keep, old, torch.full((n,), 5.0))
    return dict(lp=lp, old=old, gen=gen, ref=ref, ent=ent, adv=adv, seq=seq, keep=keep)


def _loss(b, idx, cfg):
    lp, ent = b["lp"], b["ent"]
    loss, metrics = grpo_loss(lp[idx], b["old"][idx], b["adv"][idx], torch.ones(len(idx), dtype=torch.bool), cfg=cfg,
                              ref_logprobs=b["ref"][idx], gen_logprobs=b["gen"][idx], entropy=ent[idx],
                              num_global_tokens=float(b["keep"].sum()), seq_ids=b["seq"][idx], num_global_seqs=3.0)
    return loss, metrics


@pytest.mark.parametrize("extra", EXTRAS, ids=lambda e: "-".join(f"{k}={v}" for k, v in e.items()) or "plain")
@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: f"{v['variant']}-{v['normalizer']}")
def test_masked_tokens_equal_deleted_tokens(variant, extra):
    cfg = LossConfig(**variant, **extra, normalizer_max_len=16)
    b = _batch(3)
    masked_loss, masked_m = grpo_loss(b["lp"], b["old"], b["adv"], b["keep"], cfg=cfg, ref_logprobs=b["ref"],
                                      gen_logprobs=b["gen"], entropy=b["ent"],
                                      num_global_tokens=float(b["keep"].sum()), seq_ids=b["seq"], num_global_seqs=3.0)
    g_lp, g_ent = torch.autograd.grad(masked_loss, [b["lp"], b["ent"]], allow_unused=True)
    kept = b["keep"].nonzero().flatten()
    ref_loss, ref_m = _loss(b, kept, cfg)
    r_lp, r_ent = torch.autograd.grad(ref_loss, [b["lp"], b["ent"]], allow_unused=True)
    torch.testing.assert_close(masked_loss, ref_loss, atol=1e-6, rtol=1e-6)
    for got, want in ((g_lp, r_lp), (g_ent, r_ent)):
        if want is None:
            assert got is None or not got.any()
            continue
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        assert not got[~b["keep"]].any()  # no gradient reaches an observation token
    assert set(masked_m) == set(ref_m)
    for k in ref_m:
        torch.testing.assert_close(masked_m[k].float(), ref_m[k].float(), atol=1e-6, rtol=1e-6, msg=k)


def test_the_check_can_fail():
    """The same comparison with the mask ignored (observations trained) differs: the test above would see a leak."""
    cfg = LossConfig(importance_correction="token")
    b = _batch(3)
    every = torch.ones_like(b["keep"])
    leaked, _ = grpo_loss(b["lp"], b["old"], b["adv"], every, cfg=cfg, gen_logprobs=b["gen"],
                          num_global_tokens=float(b["keep"].sum()), seq_ids=b["seq"], num_global_seqs=3.0)
    ref, _ = _loss(b, b["keep"].nonzero().flatten(), dataclasses.replace(cfg))
    assert abs(float(leaked.detach()) - float(ref.detach())) > 1e-3
