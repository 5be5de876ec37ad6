"""Leaving zero-advantage sequences out of training (`algorithms/trainable.py`): for every loss variant, normaliser
and mismatch correction, the loss and its gradient over the sequences with a nonzero advantage (divided by the whole
step's counts) equal the whole batch's; the kept part, the top-up to the DP size, the metric rescaling, and the
config terms that make leaving them out wrong."""
import pytest
import torch

from megatron_rl.algorithms.loss import grpo_loss
from megatron_rl.algorithms.trainable import rescale_metrics, trainable_part, why_not_skippable
from megatron_rl.config.loader import load_config
from megatron_rl.config.schema import LossConfig
from megatron_rl.policy.interface import RolloutBatch

D = torch.float64
LENS = (5, 3, 6, 4, 7, 2)
ADV = (0.0, 1.3, 0.0, -0.7, 0.0, 0.4)  # three sequences without gradient (a group whose rewards were all equal)


def _flat(seed=0):
    g = torch.Generator().manual_seed(seed)
    n = sum(LENS)
    seq = torch.cat([torch.full((l,), i) for i, l in enumerate(LENS)])
    old = -torch.rand(n, generator=g, dtype=D) * 3
    return dict(lp=old + torch.randn(n, generator=g, dtype=D) * 0.2, old=old,
                gen=old + torch.randn(n, generator=g, dtype=D) * 0.4, adv=torch.tensor(ADV, dtype=D)[seq], seq=seq)


def _loss_and_grad(b, cfg, keep_seqs, num_tokens, num_seqs):
    idx = torch.isin(b["seq"], torch.tensor(keep_seqs))
    lp = b["lp"][idx].clone().requires_grad_(True)
    loss, metrics = grpo_loss(lp, b["old"][idx], b["adv"][idx], torch.ones_like(lp, dtype=torch.bool), cfg=cfg,
                              gen_logprobs=b["gen"][idx], num_global_tokens=num_tokens, seq_ids=b["seq"][idx],
                              num_global_seqs=num_seqs)
    loss.backward()
    full_grad = torch.zeros_like(b["lp"])
    full_grad[idx] = lp.grad
    return float(loss.detach()), full_grad, metrics


CASES = [
    LossConfig(),
    LossConfig(ratio_clip_c=3.0, ratio_clip_high=0.28),
    LossConfig(variant="gspo"),
    LossConfig(variant="cispo"),
    LossConfig(normalizer="sequences"),
    LossConfig(normalizer="constant", normalizer_max_len=8),
    LossConfig(importance_correction="sequence", importance_mask="token"),
    LossConfig(variant="gspo", importance_correction="token", importance_mask="sequence"),
]


@pytest.mark.parametrize("cfg", CASES, ids=lambda c: f"{c.variant}-{c.effective_normalizer()}-"
                                                     f"{c.importance_correction}-{c.importance_mask}-{c.ratio_clip_c}")
def test_part_with_whole_step_normalisers_gives_the_whole_batch_loss_and_gradient(cfg):
    b = _flat()
    n_tok, n_seq = sum(LENS), len(LENS)
    whole_loss, whole_grad, _ = _loss_and_grad(b, cfg, list(range(n_seq)), n_tok, n_seq)
    part_loss, part_grad, _ = _loss_and_grad(b, cfg, [1, 3, 5], n_tok, n_seq)
    assert whole_grad.abs().max() > 1e-3  # the reference has a gradient to compare with
    assert part_loss == pytest.approx(whole_loss, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(part_grad, whole_grad, atol=1e-14, rtol=1e-12)
    # the part's own counts would be a different (larger) step: the normalisers are what keeps it exact
    own_loss, _, _ = _loss_and_grad(b, cfg, [1, 3, 5], LENS[1] + LENS[3] + LENS[5], 3)
    assert abs(own_loss - whole_loss) > 1e-6


def _batch(adv):
    ids = [[1] * (2 + l) for l in LENS]  # prompt of 2, response of l
    return RolloutBatch(input_ids=ids, prompt_lens=[2] * len(LENS), advantages=list(adv),
                        gen_logprobs=[torch.full((l,), float(i)) for i, l in enumerate(LENS)],
                        group_ids=[i // 2 for i in range(len(LENS))])


def test_trainable_part_keeps_nonzero_advantages_in_order_with_the_whole_step_counts():
    b = _batch(ADV)
    part = trainable_part(b)
    assert part.advantages == [1.3, -0.7, 0.4] and part.group_ids == [0, 1, 2]
    assert [float(t[0]) for t in part.gen_logprobs] == [1.0, 3.0, 5.0]
    assert part.loss_normalizers() == (sum(LENS), len(LENS))
    assert b.loss_normalizers() == (sum(LENS), len(LENS)) and b.step_tokens is None
    assert trainable_part(_batch([0.5] * len(LENS))).step_tokens is None  # nothing to leave out: the batch itself


def test_trainable_part_tops_up_to_min_seqs_with_the_shortest_zero_advantage_sequences():
    part = trainable_part(_batch([0.0] * len(LENS)), min_seqs=2)
    assert [len(x) - 2 for x in part.input_ids] == [3, 2]  # LENS' two shortest, in batch order
    assert part.loss_normalizers() == (sum(LENS), len(LENS))
    one = trainable_part(_batch((0.0, 0.0, 0.0, 0.0, 0.0, 0.4)), min_seqs=2)
    assert [a for a in one.advantages] == [0.0, 0.4] and [len(x) - 2 for x in one.input_ids] == [3, 2]


def test_rescaled_metrics_are_means_over_the_trained_tokens():
    part = trainable_part(_batch(ADV))
    trained = LENS[1] + LENS[3] + LENS[5]
    # what the worker reports: each metric's sum over trained tokens divided by the whole step's count
    raw = {"entropy": 0.5 * trained / sum(LENS), "clip_frac": 0.1 * trained / sum(LENS), "loss": -0.02,
           "pg_loss": -0.02, "grad_norm": 3.0, "lr": 1e-5, "num_tokens_fed": 40.0, "is_masked_seq_frac": 1 / 6}
    got = rescale_metrics(raw, part)
    assert got["entropy"] == pytest.approx(0.5) and got["clip_frac"] == pytest.approx(0.1)
    assert got["is_masked_seq_frac"] == pytest.approx(1 / 3)  # one of the 3 trained sequences
    assert {k: got[k] for k in ("loss", "pg_loss", "grad_norm", "lr", "num_tokens_fed")} == \
        {k: raw[k] for k in ("loss", "pg_loss", "grad_norm", "lr", "num_tokens_fed")}
    assert rescale_metrics(raw, _batch(ADV)) == raw  # a whole batch: the worker's numbers are already means


@pytest.mark.parametrize("override,key", [
    ([], None), (["grpo.loss.kl_coef=0.001"], "grpo.loss.kl_coef"),
    (["grpo.loss.entropy_coef=0.01"], "grpo.loss.entropy_coef"),
    (["policy.moe_aux_loss_coef=0.001"], "policy.moe_aux_loss_coef")])
def test_terms_with_gradient_on_every_token_turn_it_off(override, key):
    assert why_not_skippable(load_config("configs/demo_cpu.yaml", override, check_model=False)) == key


def test_loss_masks_travel_with_the_trained_part_and_set_its_normalisers():
    """Multi-turn observation tokens (loss_mask False) count in no normaliser: the step's token count is the kept
    tokens, and the part left after dropping zero-advantage sequences keeps each sequence's own mask."""
    from megatron_rl.policy.batching import check_batch

    b = _batch(ADV)
    b.loss_mask = [torch.arange(n) % 3 != 1 for n in LENS]  # every third token from the second on: observation
    kept = [sum(1 for k in range(n) if k % 3 != 1) for n in LENS]
    assert b.loss_normalizers() == (sum(kept), len(LENS))
    part = trainable_part(b)
    assert [m.tolist() for m in part.loss_mask] == [[k % 3 != 1 for k in range(LENS[i])] for i in (1, 3, 5)]
    assert part.loss_normalizers() == (sum(kept), len(LENS))
    # the rescaled per-token metrics are means over the part's kept tokens
    own = kept[1] + kept[3] + kept[5]
    assert rescale_metrics({"entropy": 0.5 * own / sum(kept)}, part)["entropy"] == pytest.approx(0.5)
    assert b.trained_mask().tolist() == [float(k % 3 != 1) for n in LENS for k in range(n)]
    check_batch(b, vocab_size=100, max_positions=64)
    b.loss_mask[2] = b.loss_mask[2][:-1]
    with pytest.raises(ValueError, match=r"loss_mask\[2\] has 5 entries for a response of 6 tokens"):
        check_batch(b, vocab_size=100, max_positions=64)
    b.loss_mask[2] = torch.ones(6)
    with pytest.raises(ValueError, match=r"loss_mask\[2\] has dtype torch.float32"):
        check_batch(b, vocab_size=100, max_positions=64)
