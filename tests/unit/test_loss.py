"""GRPO loss against an independent, loop-based plain-python computation for every option; micro-batch additivity."""
import dataclasses
import math
import zlib

import pytest
import torch

from megatron_rl.algorithms.loss import grpo_loss, mismatch_metrics
from megatron_rl.config.schema import LossConfig

D = torch.float64  # exact comparisons against the python reference


def make_batch(seed=0, lens=(5, 3, 6, 4)):
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    seq_ids = torch.cat([torch.full((l,), i) for i, l in enumerate(lens)])
    mask = torch.rand(n, generator=g, dtype=D) > 0.2
    seq_adv = torch.randn(len(lens), generator=g, dtype=D) * 1.5
    return dict(
        logprobs=-torch.rand(n, generator=g, dtype=D) * 3,
        old_logprobs=-torch.rand(n, generator=g, dtype=D) * 3,
        ref_logprobs=-torch.rand(n, generator=g, dtype=D) * 3,
        gen_logprobs=-torch.rand(n, generator=g, dtype=D) * 3,
        entropy=torch.rand(n, generator=g, dtype=D) * 2,
        advantages=seq_adv[seq_ids],
        mask=mask,
        seq_ids=seq_ids,
    )


def reference_loss(b, cfg):
    """Written from the definitions, token by token, without sharing code with the implementation."""
    n = len(b["mask"])
    seqs = sorted(set(b["seq_ids"].tolist()))
    seq_tokens = {s: [t for t in range(n) if int(b["seq_ids"][t]) == s and bool(b["mask"][t])] for s in seqs}
    seq_w = {}
    for s, toks in seq_tokens.items():
        prod = 1.0
        for t in toks:
            prod *= math.exp(float(b["old_logprobs"][t] - b["gen_logprobs"][t]))
        seq_w[s] = min(prod, cfg.importance_cap)
    per_tok = {}
    for t in range(n):
        if not bool(b["mask"][t]):
            continue
        lp, old, a = b["logprobs"][t], float(b["old_logprobs"][t]), float(b["advantages"][t])
        ratio = torch.exp(lp - old)
        clipped_ratio = torch.clamp(ratio, 1 - cfg.ratio_clip_low, 1 + cfg.ratio_clip_high)
        obj = torch.min(ratio * a, clipped_ratio * a)
        if cfg.ratio_clip_c is not None and a < 0:
            obj = torch.max(obj, torch.tensor(cfg.ratio_clip_c * a, dtype=D))
        if cfg.importance_correction == "token":
            w = min(math.exp(float(b["old_logprobs"][t] - b["gen_logprobs"][t])), cfg.importance_cap)
        elif cfg.importance_correction == "sequence":
            w = seq_w[int(b["seq_ids"][t])]
        else:
            w = 1.0
        term = -w * obj
        if cfg.kl_coef:
            x = b["ref_logprobs"][t] - lp
            if cfg.kl_clamp is not None:
                x = torch.clamp(x, -cfg.kl_clamp, cfg.kl_clamp)
            kl = {"k1": -x, "k2": x ** 2 / 2, "k3": torch.exp(x) - x - 1}[cfg.kl_estimator]
            c = cfg.kl_value_clamp
            if c is not None and (kl > c or (cfg.kl_estimator == "k1" and kl < -c)):
                kl = kl.detach().clamp(-c, c)  # a clamped token's KL is a constant: no gradient
            term = term + cfg.kl_coef * w * kl
        if cfg.entropy_coef:
            term = term - cfg.entropy_coef * b["entropy"][t]
        per_tok[t] = term
    if cfg.effective_normalizer() == "tokens":
        return sum(per_tok.values()) / len(per_tok)
    total = 0.0
    for s, toks in seq_tokens.items():
        if toks:
            total = total + sum(per_tok[t] for t in toks) / len(toks)
    return total / len(seqs)


VARIANTS = {
    "plain": {},
    "clip_higher": dict(ratio_clip_low=0.1, ratio_clip_high=0.35),
    "dual_clip": dict(ratio_clip_c=1.5, ratio_clip_low=0.1, ratio_clip_high=0.1),
    "kl_k1": dict(kl_coef=0.1, kl_estimator="k1"),
    "kl_k2": dict(kl_coef=0.1, kl_estimator="k2"),
    "kl_k3": dict(kl_coef=0.1, kl_estimator="k3"),
    "kl_k3_clamped": dict(kl_coef=0.1, kl_estimator="k3", kl_clamp=0.5),
    "kl_unclamped": dict(kl_coef=0.1, kl_clamp=None),
    "kl_k3_value_clamped": dict(kl_coef=0.1, kl_estimator="k3", kl_value_clamp=1.0),
    "kl_k1_value_clamped": dict(kl_coef=0.1, kl_estimator="k1", kl_value_clamp=0.5),
    "kl_k2_value_unclamped": dict(kl_coef=0.1, kl_estimator="k2", kl_value_clamp=None),
    "sequence_level": dict(normalizer="sequences"),
    "is_token": dict(importance_correction="token", importance_cap=1.5),
    "is_sequence": dict(importance_correction="sequence", importance_cap=3.0),
    "entropy": dict(entropy_coef=0.01),
    "everything": dict(ratio_clip_c=2.0, ratio_clip_high=0.28, kl_coef=0.05, normalizer="sequences",
                       importance_correction="sequence", entropy_coef=0.02),
}


def run_loss(b, cfg, idx=None, num_tokens=None, num_seqs=None):
    sel = (lambda x: x) if idx is None else (lambda x: x[idx])
    return grpo_loss(
        sel(b["logprobs"]), sel(b["old_logprobs"]), sel(b["advantages"]), sel(b["mask"]), cfg=cfg,
        ref_logprobs=sel(b["ref_logprobs"]), gen_logprobs=sel(b["gen_logprobs"]), entropy=sel(b["entropy"]),
        num_global_tokens=num_tokens if num_tokens is not None else float(b["mask"].sum()),
        seq_ids=sel(b["seq_ids"]), num_global_seqs=num_seqs if num_seqs is not None else 4.0)


@pytest.mark.parametrize("name", list(VARIANTS))
def test_loss_and_gradient_match_reference(name):
    cfg = LossConfig(**VARIANTS[name])
    b = make_batch(seed=zlib.crc32(name.encode()) % 1000)
    b["logprobs"].requires_grad_(True)
    loss, metrics = run_loss(b, cfg)
    (grad,) = torch.autograd.grad(loss, b["logprobs"])
    ref = reference_loss(b, cfg)
    (ref_grad,) = torch.autograd.grad(ref, b["logprobs"])
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert float(metrics["loss"]) == pytest.approx(loss.item())
    assert grad[~b["mask"]].abs().max() == 0


def test_clipping_paths_and_clip_frac_by_hand():
    cfg = LossConfig(ratio_clip_low=0.2, ratio_clip_high=0.28, ratio_clip_c=3.0)
    # ratios: 2.0 (A>0 -> clipped at 1.28), 0.5 (A<0 -> clipped at 0.8), 5.0 (A<0 -> dual clip: -3*A... floor),
    # 1.1 (A>0 -> inside), 0.5 (A>0 -> unclipped, min picks ratio*A)
    ratio = torch.tensor([2.0, 0.5, 5.0, 1.1, 0.5], dtype=D)
    adv = torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0], dtype=D)
    old = torch.full((5,), -1.0, dtype=D)
    lp = (old + ratio.log()).requires_grad_(True)
    loss, m = grpo_loss(lp, old, adv, torch.ones(5, dtype=torch.bool), cfg=cfg, num_global_tokens=5.0)
    expected_obj = [1.28, -0.8, -3.0, 1.1, 0.5]
    assert loss.item() == pytest.approx(-sum(expected_obj) / 5)
    assert float(m["clip_frac"]) == pytest.approx(3 / 5)
    assert float(m["dual_clip_frac"]) == pytest.approx(1 / 5)
    (g,) = torch.autograd.grad(loss, lp)
    assert g[0] == 0 and g[1] == 0 and g[2] == 0 and g[3] != 0 and g[4] != 0


def test_masked_garbage_is_ignored():
    b = make_batch(seed=3)
    b["logprobs"][~b["mask"]] = float("nan")
    b["old_logprobs"][~b["mask"]] = float("inf")
    b["logprobs"].requires_grad_(True)
    cfg = LossConfig(kl_coef=0.1, importance_correction="sequence")
    loss, metrics = run_loss(b, cfg)
    (g,) = torch.autograd.grad(loss, b["logprobs"])
    assert torch.isfinite(loss) and torch.isfinite(g).all()
    assert all(torch.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", ["plain", "sequence_level", "everything", "is_token"])
def test_microbatch_additivity(name):
    """Two micro-batches with the global counts give the full batch's loss, gradient and metrics."""
    cfg = LossConfig(**VARIANTS[name])
    b = make_batch(seed=7, lens=(4, 6, 3, 5))
    b["logprobs"].requires_grad_(True)
    full, full_m = run_loss(b, cfg)
    (g_full,) = torch.autograd.grad(full, b["logprobs"])
    split = 10  # sequences 0,1 | 2,3: a sequence never spans micro-batches
    ntok = float(b["mask"].sum())
    parts = [run_loss(b, cfg, idx=slice(0, split), num_tokens=ntok),
             run_loss(b, cfg, idx=slice(split, None), num_tokens=ntok)]
    total = parts[0][0] + parts[1][0]
    (g_split,) = torch.autograd.grad(total, b["logprobs"])
    assert total.item() == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(g_split, g_full)
    for k, v in full_m.items():
        assert float(parts[0][1][k] + parts[1][1][k]) == pytest.approx(float(v), rel=1e-12, abs=1e-15), k


def test_metrics_values():
    b = make_batch(seed=11)
    cfg = LossConfig(kl_coef=0.0, importance_correction="token", importance_cap=1.2)
    _, m = run_loss(b, cfg)
    msk = b["mask"]
    k3 = torch.exp(b["ref_logprobs"] - b["logprobs"]) - (b["ref_logprobs"] - b["logprobs"]) - 1
    assert float(m["kl"]) == pytest.approx(float(k3[msk].mean()))  # reported even when kl_coef is 0
    assert float(m["entropy"]) == pytest.approx(float(b["entropy"][msk].mean()))
    w = torch.exp(b["old_logprobs"] - b["gen_logprobs"]).clamp(max=1.2)
    assert float(m["importance_weight_mean"]) == pytest.approx(float(w[msk].mean()))


def test_option_errors():
    b = make_batch()
    with pytest.raises(ValueError, match="seq_ids"):
        grpo_loss(b["logprobs"], b["old_logprobs"], b["advantages"], b["mask"], cfg=LossConfig(normalizer="sequences"),
                  num_global_tokens=10.0)
    with pytest.raises(ValueError, match="gen_logprobs"):
        grpo_loss(b["logprobs"], b["old_logprobs"], b["advantages"], b["mask"],
                  cfg=LossConfig(importance_correction="token"), num_global_tokens=10.0)
    with pytest.raises(ValueError, match="ref_logprobs"):
        grpo_loss(b["logprobs"], b["old_logprobs"], b["advantages"], b["mask"], cfg=LossConfig(kl_coef=0.1),
                  num_global_tokens=10.0)


def test_mismatch_metrics_by_hand():
    gen = torch.tensor([-1.0, -2.0, -0.5, 7.0], dtype=D)
    train = torch.tensor([-1.1, -1.8, -0.5, float("nan")], dtype=D)
    mask = torch.tensor([True, True, True, False])
    m = mismatch_metrics(gen, train, mask)
    diffs = [-0.1, 0.2, 0.0]
    assert m["token_mult_prob_error"] == pytest.approx(sum(math.exp(abs(d)) for d in diffs) / 3)
    assert m["gen_kl_error"] == pytest.approx(sum(math.exp(d) - d - 1 for d in diffs) / 3)
    half = mismatch_metrics(gen[:2], train[:2], mask[:2], num_tokens=3)
    rest = mismatch_metrics(gen[2:], train[2:], mask[2:], num_tokens=3)
    assert half["gen_kl_error"] + rest["gen_kl_error"] == pytest.approx(m["gen_kl_error"])
    same = mismatch_metrics(gen, gen, mask)
    assert same == {"token_mult_prob_error": 1.0, "gen_kl_error": 0.0}


def test_config_defaults_are_used_not_redeclared():
    # the loss reads every knob from LossConfig; a changed config changes the result
    b = make_batch(seed=5)
    base, _ = run_loss(b, LossConfig())
    other, _ = run_loss(b, dataclasses.replace(LossConfig(), ratio_clip_low=0.01, ratio_clip_high=0.01))
    assert float(base) != float(other)
