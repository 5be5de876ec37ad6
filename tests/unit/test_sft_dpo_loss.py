"""The SFT and DPO losses against formulas written here from the papers (per-sequence loops, no shared helper), the
global-count contract (micro-batch losses add up to the batch loss), and the plan that keeps a pair together."""
from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_rl.algorithms.supervised_loss import DPOLossFn, SFTLossFn
from megatron_rl.config.schema import DPOConfig
from megatron_rl.policy.interface import RolloutBatch
from megatron_rl.policy.loss_api import LossInputs
from megatron_rl.policy.packing import plan_microbatches


def _pairs(n_pairs=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = [int(x) for x in torch.randint(2, 7, (2 * n_pairs,), generator=g)]
    lp = [-torch.rand(n, generator=g, dtype=torch.float64) * 3 for n in lens]
    ref = [-torch.rand(n, generator=g, dtype=torch.float64) * 3 for n in lens]
    return lens, lp, ref


def _inputs(idx, lens, lp, ref, n_seqs, masks=None):
    """LossInputs of the sequences `idx` (one micro-batch), pairs (2k, 2k + 1) with the chosen first."""
    toks = torch.cat([lp[i] for i in idx]).requires_grad_(True)
    mask = torch.cat([masks[i] if masks else torch.ones(lens[i], dtype=torch.float64) for i in idx])
    return toks, LossInputs(
        logprobs=toks, entropy=None, advantages=torch.zeros_like(toks), mask=mask,
        seq_ids=torch.cat([torch.full((lens[i],), i) for i in idx]), old_logprobs=toks.detach(),
        ref_logprobs=torch.cat([ref[i] for i in idx]), gen_logprobs=None, num_global_tokens=float(mask.sum()),
        num_global_seqs=float(n_seqs), seqs=torch.tensor(idx), seq_groups=torch.tensor([i // 2 for i in idx]),
        seq_roles=torch.tensor([1.0 - i % 2 for i in idx]))


def paper_loss(cfg: DPOConfig, lens, lp, ref):
    """Rafailov et al. 2023 eq. 7 (with conservative label smoothing), Azar et al. 2023 eq. 17 (IPO), SLiC's hinge;
    one pair at a time."""
    total = 0.0
    for k in range(len(lens) // 2):
        w, l = 2 * k, 2 * k + 1
        s = (lambda i: float(lp[i].mean())) if cfg.average_logprobs else (lambda i: float(lp[i].sum()))
        r = (lambda i: float(ref[i].mean())) if cfg.average_logprobs else (lambda i: float(ref[i].sum()))
        h = (s(w) - r(w)) - (s(l) - r(l))
        sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
        if cfg.loss == "sigmoid":
            e = cfg.label_smoothing
            loss = -(1 - e) * math.log(sig(cfg.beta * h)) - e * math.log(sig(-cfg.beta * h))
        elif cfg.loss == "ipo":
            loss = (h - 1 / (2 * cfg.beta)) ** 2
        else:
            loss = max(0.0, 1 - cfg.beta * h)
        total += loss + cfg.sft_loss_weight * (-float(lp[w].sum()) / lens[w])
    return total / (len(lens) // 2)


CASES = [DPOConfig(), DPOConfig(beta=0.5, label_smoothing=0.2), DPOConfig(loss="ipo", beta=0.3),
         DPOConfig(loss="hinge", beta=2.0), DPOConfig(average_logprobs=True, sft_loss_weight=0.7),
         DPOConfig(loss="ipo", average_logprobs=True)]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"{c.loss}-ls{c.label_smoothing}-avg{c.average_logprobs}")
def test_dpo_loss_equals_paper_formula_and_splits_by_pair(cfg):
    lens, lp, ref = _pairs(4)
    n = len(lens)
    _, whole = _inputs(list(range(n)), lens, lp, ref, n)
    loss, m = DPOLossFn(cfg)(whole)
    assert float(loss.detach()) == pytest.approx(paper_loss(cfg, lens, lp, ref), rel=1e-10)
    # micro-batches of whole pairs, in any order: their losses and metrics add up to the batch's
    parts = [[4, 5, 0, 1], [6, 7], [3, 2]]
    split = [DPOLossFn(cfg)(_inputs(p, lens, lp, ref, n)[1]) for p in parts]
    assert sum(float(x.detach()) for x, _ in split) == pytest.approx(float(loss.detach()), rel=1e-10)
    for k in m:
        assert sum(float(mm[k]) for _, mm in split) == pytest.approx(float(m[k]), rel=1e-9, abs=1e-12), k


def test_dpo_gradient_and_metrics_by_hand():
    cfg = DPOConfig(beta=0.4)
    lens, lp, ref = _pairs(2, seed=1)
    toks, inp = _inputs([0, 1, 2, 3], lens, lp, ref, 4)
    loss, m = DPOLossFn(cfg)(inp)
    loss.backward()
    grads = torch.split(toks.grad, lens)
    for k in range(2):
        w, l = 2 * k, 2 * k + 1
        h = (lp[w].sum() - ref[w].sum()) - (lp[l].sum() - ref[l].sum())
        coef = -cfg.beta * (1 - torch.sigmoid(cfg.beta * h)) / 2  # d/dlogp_w of -log sigma(beta h), over 2 pairs
        torch.testing.assert_close(grads[w], torch.full_like(grads[w], float(coef)))
        torch.testing.assert_close(grads[l], torch.full_like(grads[l], -float(coef)))
    rc = [cfg.beta * float(lp[i].sum() - ref[i].sum()) for i in (0, 2)]
    rr = [cfg.beta * float(lp[i].sum() - ref[i].sum()) for i in (1, 3)]
    assert float(m["rewards_chosen"]) == pytest.approx(sum(rc) / 2)
    assert float(m["rewards_margin"]) == pytest.approx((sum(rc) - sum(rr)) / 2)
    assert float(m["rewards_accuracy"]) == pytest.approx(sum(a > b for a, b in zip(rc, rr)) / 2)
    assert float(m["logps_rejected"]) == pytest.approx(float(lp[1].sum() + lp[3].sum()) / 2)
    assert float(m["logps_accuracy"]) == pytest.approx(sum(float(lp[w].sum()) > float(lp[w + 1].sum())
                                                           for w in (0, 2)) / 2)


def test_dpo_refuses_a_split_pair():
    lens, lp, ref = _pairs(2)
    with pytest.raises(ValueError, match="incomplete preference pairs"):
        DPOLossFn(DPOConfig())(_inputs([0, 1, 2], lens, lp, ref, 4)[1])


@pytest.mark.parametrize("normalizer", ["tokens", "sequences"])
def test_sft_loss_is_masked_nll_normalised_globally(normalizer):
    lens, lp, ref = _pairs(3, seed=2)
    masks = [torch.tensor([float(j % 3 != 0) if j else 1.0 for j in range(n)], dtype=torch.float64) for n in lens]
    n = len(lens)
    trained = sum(float(m.sum()) for m in masks)
    if normalizer == "tokens":
        want = -sum(float((lp[i] * masks[i]).sum()) for i in range(n)) / trained
    else:
        want = -sum(float((lp[i] * masks[i]).sum() / masks[i].sum()) for i in range(n)) / n
    parts = [[0, 3], [1], [2, 4, 5]]
    got = 0.0
    for p in parts:
        _, inp = _inputs(p, lens, lp, ref, n, masks)
        inp.num_global_tokens = trained
        got += float(SFTLossFn(normalizer)(inp)[0].detach())
    assert got == pytest.approx(want, rel=1e-10)


@pytest.mark.parametrize("shared,varlen", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("dp", [1, 2])
def test_plan_keeps_each_pair_in_one_micro_batch(shared, varlen, dp):
    rng = random.Random(7)
    ids, plens, groups, roles = [], [], [], []
    for k in range(9):
        prompt = [rng.randrange(100) for _ in range(rng.randint(2, 12))]
        for role in (1.0, 0.0):
            ids.append(prompt + [rng.randrange(100) for _ in range(rng.randint(1, 15))])
            plens.append(len(prompt))
            groups.append(k)
            roles.append(role)
    batch = RolloutBatch(ids, plens, group_ids=groups, seq_roles=roles, keep_groups=True)
    seen = []
    for r in range(dp):
        plan = plan_microbatches(batch, shared=shared, varlen=varlen, max_tokens=64, dp_size=dp, dp_rank=r)
        assert len(plan) > 1  # the budget forces several micro-batches: the pairs must still stay whole
        for mb in plan:
            members = [i for u in mb for i in u.members]
            assert sorted(members) == sorted(i for g in {groups[i] for i in members}
                                             for i in range(len(ids)) if groups[i] == g)
            seen += members
        if shared:  # a pair that fits is one shared-prefix unit: its prompt is computed once
            assert all(len(u.members) == 2 for mb in plan for u in mb)
    assert sorted(seen) == list(range(len(ids)))


def test_rm_loss_on_the_whole_batch_path_reads_each_pairs_margin():
    """Validation's path (`batch_inputs`, one micro-batch of the whole batch): each sequence's reward is its last
    value, and a pair's margin enters TRL's formula -log sigmoid(r_c - r_r - margin), written out here."""
    import torch.nn.functional as F

    from megatron_rl.algorithms.rm_loss import RMLossFn
    from megatron_rl.algorithms.supervised_batches import rm_pair_batch
    from megatron_rl.algorithms.supervised_loss import batch_inputs
    from megatron_rl.data.supervised import PairExample

    batch = rm_pair_batch([PairExample((1, 2), (3, 4), (5,), 0, 0.5), PairExample((1,), (3,), (6, 7), 1, None)])
    g = torch.Generator().manual_seed(0)
    values = [torch.randn(n, generator=g) for n in batch.response_lens()]
    loss, metrics = RMLossFn(None)(batch_inputs(batch, values))
    rc, rr = torch.stack([values[0][-1], values[2][-1]]), torch.stack([values[1][-1], values[3][-1]])
    want = -F.logsigmoid(rc - rr - torch.tensor([0.5, 0.0])).mean()
    assert float(loss) == pytest.approx(float(want), rel=1e-6)
    assert metrics["accuracy"] == pytest.approx(float((rc > rr).float().mean()))
