"""Loss variants (GSPO, CISPO, Dr. GRPO's constant normaliser), the KL value clamp and the mask-style mismatch
corrections (masked IS, icepop), each against an independent reference written here with per-sequence loops over
python floats: values, gradients, metrics, and micro-batch additivity."""
import math
import zlib

import pytest
import torch

from megatron_rl.algorithms.loss import grpo_loss, kl_estimate
from megatron_rl.algorithms.loss_fn import GRPOLossFn
from megatron_rl.config.schema import LossConfig
from megatron_rl.policy.loss_api import LossInputs

D = torch.float64
LENS = (5, 3, 6, 4, 7)


def make_batch(seed=0, lens=LENS, spread=0.15, gen_spread=0.4):
    """Current logprobs near the old ones (so some ratios fall inside even GSPO's narrow clip range, some outside),
    generator logprobs further away (so the mismatch masks drop some tokens/sequences and keep others)."""
    g = torch.Generator().manual_seed(seed)
    n = sum(lens)
    seq_ids = torch.cat([torch.full((l,), i) for i, l in enumerate(lens)])
    old = -torch.rand(n, generator=g, dtype=D) * 3
    seq_adv = torch.randn(len(lens), generator=g, dtype=D) * 1.5
    mask = torch.rand(n, generator=g, dtype=D) > 0.15
    mask[torch.tensor([sum(lens[:i]) for i in range(len(lens))])] = True  # every sequence has a valid token
    return dict(
        logprobs=old + torch.randn(n, generator=g, dtype=D) * spread,
        old_logprobs=old,
        ref_logprobs=old + torch.randn(n, generator=g, dtype=D),
        gen_logprobs=old + torch.randn(n, generator=g, dtype=D) * gen_spread,
        entropy=torch.rand(n, generator=g, dtype=D),
        advantages=seq_adv[seq_ids], mask=mask, seq_ids=seq_ids)


def run(b, cfg, idx=None, num_tokens=None, num_seqs=None):
    sel = (lambda x: x) if idx is None else (lambda x: x[idx])
    return grpo_loss(sel(b["logprobs"]), sel(b["old_logprobs"]), sel(b["advantages"]), sel(b["mask"]), cfg=cfg,
                     ref_logprobs=sel(b["ref_logprobs"]), gen_logprobs=sel(b["gen_logprobs"]),
                     entropy=sel(b["entropy"]), seq_ids=sel(b["seq_ids"]),
                     num_global_tokens=num_tokens if num_tokens is not None else float(b["mask"].sum()),
                     num_global_seqs=num_seqs if num_seqs is not None else float(len(set(b["seq_ids"].tolist()))))


# ---- the independent reference --------------------------------------------------------------------------------

def f(x):
    return float(x.detach()) if torch.is_tensor(x) else float(x)


def reference(b, cfg):
    """Loss and metric counts from the papers' formulas, one sequence and one token at a time."""
    seqs = sorted(set(b["seq_ids"].tolist()))
    lp, old, gen, ref = b["logprobs"], b["old_logprobs"], b["gen_logprobs"], b["ref_logprobs"]
    norm = cfg.effective_normalizer()
    total, n_valid = 0.0, 0
    masked_tokens, masked_seqs = 0, 0
    for s in seqs:
        toks = [t for t in range(len(lp)) if int(b["seq_ids"][t]) == s and bool(b["mask"][t])]
        if not toks:
            continue
        a = f(b["advantages"][toks[0]])
        # mismatch: truncated IS weight and the keep mask, from pi_old / pi_gen
        seq_log_r = sum(f(old[t]) - f(gen[t]) for t in toks)
        weights = {}
        for t in toks:
            tok_r = math.exp(f(old[t]) - f(gen[t]))
            w = {"off": 1.0, "token": min(tok_r, cfg.importance_cap),
                 "sequence": min(math.exp(seq_log_r), cfg.importance_cap)}[cfg.importance_correction or "off"]
            r_for_mask = {"token": tok_r, "sequence": math.exp(seq_log_r)}.get(cfg.importance_mask)
            if r_for_mask is not None and not cfg.importance_mask_low <= r_for_mask <= cfg.importance_mask_high:
                w = 0.0
                masked_tokens += 1
            weights[t] = w
        masked_seqs += any(weights[t] == 0.0 for t in toks) and cfg.importance_mask != "off"
        # the variant's objective per token
        if cfg.variant == "gspo":
            s_i = torch.exp(sum(lp[t] - old[t] for t in toks) / len(toks))
            s_clip = torch.clamp(s_i, 1 - cfg.gspo_clip_low, 1 + cfg.gspo_clip_high)
            seq_obj = torch.min(s_i * a, s_clip * a)
            objs = {t: seq_obj for t in toks}
        elif cfg.variant == "cispo":
            objs = {}
            for t in toks:
                is_w = min(max(math.exp(f(lp[t]) - f(old[t])), 1 - cfg.cispo_clip_low), 1 + cfg.cispo_clip_high)
                objs[t] = is_w * a * lp[t]  # a python float weight: no gradient through it
        else:
            objs = {}
            for t in toks:
                r = torch.exp(lp[t] - old[t])
                objs[t] = torch.min(r * a, torch.clamp(r, 1 - cfg.ratio_clip_low, 1 + cfg.ratio_clip_high) * a)
        seq_terms = []
        for t in toks:
            term = -weights[t] * objs[t]
            if cfg.kl_coef:
                x = torch.clamp(ref[t] - lp[t], -cfg.kl_clamp, cfg.kl_clamp)
                kl = torch.exp(x) - x - 1
                if cfg.kl_value_clamp is not None and f(kl) > cfg.kl_value_clamp:
                    kl = torch.tensor(cfg.kl_value_clamp, dtype=D)
                term = term + cfg.kl_coef * weights[t] * kl
            seq_terms.append(term)
        n_valid += len(toks)
        total = total + (sum(seq_terms) / len(toks) if norm == "sequences" else sum(seq_terms))
    denom = {"tokens": n_valid, "sequences": len(seqs), "constant": len(seqs) * (cfg.normalizer_max_len or 0)}[norm]
    return total / denom, masked_tokens / n_valid, masked_seqs / len(seqs)


CASES = {
    "gspo": dict(variant="gspo"),  # the paper's clip range and per-sequence mean
    "gspo_wide_clip": dict(variant="gspo", gspo_clip_low=0.05, gspo_clip_high=0.08),
    "gspo_tokens": dict(variant="gspo", gspo_clip_low=0.05, gspo_clip_high=0.08, normalizer="tokens"),
    "gspo_kl_seq_is": dict(variant="gspo", gspo_clip_low=0.05, gspo_clip_high=0.08, kl_coef=0.1,
                           importance_correction="sequence", importance_cap=3.0),
    "cispo": dict(variant="cispo"),
    "cispo_both_bounds": dict(variant="cispo", cispo_clip_low=0.1, cispo_clip_high=0.1),
    "cispo_kl_token_is": dict(variant="cispo", kl_coef=0.05, importance_correction="token"),
    "dr_grpo_constant": dict(normalizer="constant", normalizer_max_len=9),
    "cispo_constant": dict(variant="cispo", normalizer="constant", normalizer_max_len=12),
    "masked_is_sequence": dict(importance_mask="sequence", importance_mask_low=0.5, importance_mask_high=2.0),
    "mis_with_tis": dict(importance_mask="sequence", importance_correction="sequence", importance_cap=1.5),
    "icepop": dict(importance_mask="token", importance_correction="token", importance_cap=5.0,
                   importance_mask_low=0.7, importance_mask_high=1.4),
    "icepop_gspo": dict(variant="gspo", importance_mask="token", importance_mask_low=0.7, importance_mask_high=1.4),
    "kl_value_clamp_tight": dict(kl_coef=0.2, kl_value_clamp=0.3),
}


@pytest.mark.parametrize("name", list(CASES))
def test_variant_loss_gradient_and_mask_metrics_match_reference(name):
    cfg = LossConfig(**CASES[name])
    b = make_batch(seed=zlib.crc32(name.encode()) % 1000)
    b["logprobs"].requires_grad_(True)
    loss, metrics = run(b, cfg)
    (grad,) = torch.autograd.grad(loss, b["logprobs"])
    ref, tok_frac, seq_frac = reference(b, cfg)
    (ref_grad,) = torch.autograd.grad(ref, b["logprobs"])
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10, abs=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert grad[~b["mask"]].abs().max() == 0
    if cfg.importance_mask != "off":
        assert 0 < tok_frac < 1  # the case really drops some and keeps some
        assert float(metrics["is_masked_token_frac"]) == pytest.approx(tok_frac)
        assert float(metrics["is_masked_seq_frac"]) == pytest.approx(seq_frac)
    else:
        assert "is_masked_token_frac" not in metrics


def test_gspo_clip_is_per_sequence():
    """With the paper's narrow range most sequences are clipped: a clipped sequence gets no gradient on any token,
    an unclipped one on all of its valid tokens."""
    b = make_batch(seed=4, spread=0.002)
    b["logprobs"].requires_grad_(True)
    cfg = LossConfig(variant="gspo")
    loss, m = run(b, cfg)
    (grad,) = torch.autograd.grad(loss, b["logprobs"])
    clipped_seqs = 0
    for s in range(len(LENS)):
        toks = (b["seq_ids"] == s) & b["mask"]
        s_i = math.exp(float((b["logprobs"] - b["old_logprobs"])[toks].mean()))
        a = float(b["advantages"][toks][0])
        clipped = (a > 0 and s_i > 1 + 4e-4) or (a < 0 and s_i < 1 - 3e-4)
        clipped_seqs += clipped
        assert bool((grad[toks] == 0).all()) == clipped
    assert 0 < clipped_seqs < len(LENS)
    assert float(m["clip_frac"]) > 0


def test_cispo_keeps_gradient_where_ppo_clip_drops_it():
    # ratio 2 with A > 0: PPO's clip zeroes the gradient; CISPO's weight is clipped to 1.28 but the token still
    # gets -1.28 * A / N on d loss / d lp
    old = torch.tensor([-1.0, -1.0], dtype=D)
    lp = (old + torch.tensor([math.log(2.0), 0.0], dtype=D)).requires_grad_(True)
    adv = torch.tensor([1.0, -0.5], dtype=D)
    ok = torch.ones(2, dtype=torch.bool)
    loss, m = grpo_loss(lp, old, adv, ok, cfg=LossConfig(variant="cispo"), num_global_tokens=2.0)
    (g,) = torch.autograd.grad(loss, lp)
    torch.testing.assert_close(g, torch.tensor([-1.28 * 1.0 / 2, -1.0 * -0.5 / 2], dtype=D))
    assert float(m["clip_frac"]) == pytest.approx(0.5)
    ppo, _ = grpo_loss(lp, old, adv, ok, cfg=LossConfig(), num_global_tokens=2.0)
    (g_ppo,) = torch.autograd.grad(ppo, lp)
    assert g_ppo[0] == 0


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_value_clamp_values_and_zero_gradient(estimator):
    # r = ref - lp: 25 (log-ratio clamp 20 first), 3, 0.1, -0.1, -15
    ref = torch.tensor([0.0, 0.0, -1.0, -1.2, -20.0], dtype=D)
    lp = torch.tensor([-25.0, -3.0, -1.1, -1.1, -5.0], dtype=D, requires_grad=True)
    kl = kl_estimate(lp, ref, estimator, clamp=20.0, value_clamp=10.0)
    (g,) = torch.autograd.grad(kl.sum(), lp)
    for i in range(5):
        r = max(-20.0, min(20.0, float(ref[i] - lp[i])))
        raw = {"k1": -r, "k2": r * r / 2, "k3": math.exp(r) - r - 1}[estimator]
        want = max(-10.0, min(10.0, raw)) if estimator == "k1" else min(10.0, raw)
        assert float(kl[i]) == pytest.approx(want, rel=1e-12)
        d_raw = {"k1": 1.0, "k2": -r, "k3": 1.0 - math.exp(r)}[estimator]  # d kl / d lp (r = ref - lp)
        in_range = abs(raw) < 10.0 if estimator == "k1" else raw < 10.0
        assert float(g[i]) == pytest.approx(d_raw if in_range and abs(float(ref[i] - lp[i])) < 20 else 0.0)
    assert float(kl_estimate(lp, ref, "k3", clamp=20.0)[0]) == pytest.approx(math.exp(20) - 21)  # off: unbounded
    assert LossConfig().kl_value_clamp == 10.0


@pytest.mark.parametrize("name", ["gspo", "cispo_constant", "mis_with_tis", "icepop_gspo", "dr_grpo_constant"])
def test_microbatch_additivity(name):
    cfg = LossConfig(**CASES[name])
    b = make_batch(seed=9)
    b["logprobs"].requires_grad_(True)
    full, full_m = run(b, cfg)
    (g_full,) = torch.autograd.grad(full, b["logprobs"])
    split = sum(LENS[:2])  # sequences never span micro-batches
    ntok, nseq = float(b["mask"].sum()), float(len(LENS))
    parts = [run(b, cfg, idx=slice(0, split), num_tokens=ntok, num_seqs=nseq),
             run(b, cfg, idx=slice(split, None), num_tokens=ntok, num_seqs=nseq)]
    total = parts[0][0] + parts[1][0]
    (g_split,) = torch.autograd.grad(total, b["logprobs"])
    assert total.item() == pytest.approx(full.item(), rel=1e-12)
    torch.testing.assert_close(g_split, g_full)
    for k, v in full_m.items():
        assert float(parts[0][1][k] + parts[1][1][k]) == pytest.approx(float(v), rel=1e-12, abs=1e-15), k


def test_effective_normalizer_and_loss_fn_constant_length():
    assert LossConfig().effective_normalizer() == "tokens"
    assert LossConfig(variant="gspo").effective_normalizer() == "sequences"
    assert LossConfig(variant="cispo").effective_normalizer() == "tokens"
    assert LossConfig(variant="gspo", normalizer="constant").effective_normalizer() == "constant"
    with pytest.raises(ValueError, match="normalizer_max_len"):
        GRPOLossFn(LossConfig(normalizer="constant"))
    fn = GRPOLossFn(LossConfig(normalizer="constant"), max_response_len=16)
    assert fn.cfg.normalizer_max_len == 16
    assert GRPOLossFn(LossConfig(normalizer="constant", normalizer_max_len=4), max_response_len=16) \
        .cfg.normalizer_max_len == 4
    b = make_batch(seed=1)
    inp = LossInputs(logprobs=b["logprobs"], entropy=None, advantages=b["advantages"], mask=b["mask"].to(D),
                     seq_ids=b["seq_ids"], old_logprobs=b["old_logprobs"], ref_logprobs=None, gen_logprobs=None,
                     num_global_tokens=float(b["mask"].sum()), num_global_seqs=float(len(LENS)))
    loss, _ = fn(inp)
    ref, _, _ = reference(b, fn.cfg)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10)


def test_option_errors():
    b = make_batch()
    with pytest.raises(ValueError, match="gen_logprobs"):
        grpo_loss(b["logprobs"], b["old_logprobs"], b["advantages"], b["mask"],
                  cfg=LossConfig(importance_mask="token"), num_global_tokens=10.0)
    with pytest.raises(ValueError, match="seq_ids"):
        grpo_loss(b["logprobs"], b["old_logprobs"], b["advantages"], b["mask"], cfg=LossConfig(variant="gspo"),
                  num_global_tokens=10.0, num_global_seqs=5.0)
    with pytest.raises(ValueError, match="num_global_seqs"):
        grpo_loss(b["logprobs"], b["old_logprobs"], b["advantages"], b["mask"],
                  cfg=LossConfig(normalizer="constant", normalizer_max_len=8), num_global_tokens=10.0)
