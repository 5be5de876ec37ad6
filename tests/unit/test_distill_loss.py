"""The distillation loss (algorithms/distill_loss.py) against plain-torch reverse-KL formulas written here, and the
`distillation:` config section's checks (config/distillation.py)."""
import json
import shutil
from unittest import mock

import pytest
import torch

from megatron_rl.algorithms.distill_loss import DistillLossFn, distill_advantages, topk_reverse_kl
from megatron_rl.config.schema import DistillationConfig, LossConfig
from megatron_rl.policy.loss_api import LossInputs

torch.manual_seed(0)


def _inputs(lp, teacher, adv_seq, mask, seq_ids, n_tokens, gen=None, old=None):
    return LossInputs(logprobs=lp, entropy=None, advantages=adv_seq, mask=mask, seq_ids=seq_ids,
                      old_logprobs=lp.detach() if old is None else old, ref_logprobs=None, gen_logprobs=gen,
                      num_global_tokens=float(n_tokens), num_global_seqs=float(int(seq_ids.max()) + 1),
                      teacher_logprobs=teacher)


def _sampled(n=12, vocab=7, seed=0):
    """Student logits (a leaf: the gradient is taken w.r.t. them), teacher logits, sampled tokens, two sequences."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, vocab, generator=g, requires_grad=True)
    zt = torch.randn(n, vocab, generator=g) * 2
    x = torch.multinomial(torch.softmax(z.detach(), -1), 1, generator=g)[:, 0]
    seq_ids = torch.tensor([0] * (n // 2) + [1] * (n - n // 2))
    return z, zt, x, seq_ids


def _lp(z, x):
    return torch.log_softmax(z, -1).gather(-1, x[:, None])[:, 0]


@pytest.mark.parametrize("kl_coef,reward_weight", [(1.0, 0.0), (0.3, 0.7)])
def test_loss_and_gradient_equal_plain_reverse_kl(kl_coef, reward_weight):
    z, zt, x, seq_ids = _sampled()
    a_seq = torch.tensor([0.9, -0.4])[seq_ids]
    mask = torch.ones(len(x))
    mask[3] = 0.0  # a context token: counts nowhere
    n = int(mask.sum())
    ls, lt = _lp(z, x), _lp(zt, x)
    lt_masked = lt.clone()
    lt_masked[3] = float("nan")  # whatever the teacher said there must not reach the loss
    fn = DistillLossFn(LossConfig(), DistillationConfig(teacher="t", kl_coef=kl_coef, reward_weight=reward_weight))
    loss, metrics = fn(_inputs(ls, lt_masked, a_seq, mask, seq_ids, n))
    loss.backward()
    got = z.grad.clone()

    # reference: value = mean over kept tokens of kl_coef (log pi_S - log pi_T) - reward_weight a; gradient =
    # the score function mean of kl_coef (log pi_S - log pi_T) grad log pi_S (REINFORCE on reward -reverse KL)
    z2 = z.detach().clone().requires_grad_(True)
    ls2 = _lp(z2, x)
    keep = mask.bool()
    r = (kl_coef * (ls2.detach() - lt) - reward_weight * a_seq)[keep]
    (r * ls2[keep]).sum().div(n).backward()
    assert float(loss) == pytest.approx(float(r.sum() / n), rel=1e-6, abs=1e-7)
    torch.testing.assert_close(got, z2.grad, rtol=1e-6, atol=1e-7)
    assert float(metrics["reverse_kl"]) == pytest.approx(float((ls2.detach() - lt)[keep].mean()), rel=1e-6)


def test_expected_gradient_is_the_exact_reverse_kl_gradient():
    """Averaged over the student's own distribution (every token weighted by its probability, no sampling noise),
    the sampled-token gradient is the gradient of KL(pi_S || pi_T) = sum_v p(v) (log p(v) - log q(v))."""
    vocab = 9
    g = torch.Generator().manual_seed(1)
    z = torch.randn(vocab, generator=g, dtype=torch.float64, requires_grad=True)
    q = torch.log_softmax(torch.randn(vocab, generator=g, dtype=torch.float64) * 2, -1)
    p = torch.softmax(z, -1)
    kl = (p * (torch.log_softmax(z, -1) - q)).sum()
    (exact,) = torch.autograd.grad(kl, z)
    fn = DistillLossFn(LossConfig(ratio_clip_low=0.2), DistillationConfig(teacher="t", kl_coef=1.0))
    expected = torch.zeros_like(z)
    for v in range(vocab):  # one sampled token v, a sequence of one
        zz = z.detach().clone().requires_grad_(True)
        lp = torch.log_softmax(zz, -1)[v:v + 1]
        loss, _ = fn(_inputs(lp, q[v:v + 1], torch.zeros(1), torch.ones(1), torch.zeros(1, dtype=torch.long), 1))
        (gv,) = torch.autograd.grad(loss, zz)
        expected += p.detach()[v] * gv
    torch.testing.assert_close(expected, exact, rtol=1e-10, atol=1e-12)


def test_micro_batches_add_up_to_the_whole_step():
    """Split over micro-batches (global normaliser), the losses and gradients sum to the one-batch values."""
    z, zt, x, seq_ids = _sampled(n=10, seed=2)
    lt = _lp(zt, x)
    fn = DistillLossFn(LossConfig(), DistillationConfig(teacher="t", kl_coef=0.5))
    whole, _ = fn(_inputs(_lp(z, x), lt, torch.zeros(10), torch.ones(10), seq_ids, 10))
    (g_whole,) = torch.autograd.grad(whole, z)
    parts, g_parts = 0.0, torch.zeros_like(z)
    for sl in (slice(0, 5), slice(5, 10)):
        loss, _ = fn(_inputs(_lp(z, x)[sl], lt[sl], torch.zeros(5), torch.ones(5), seq_ids[sl], 10))
        g_parts += torch.autograd.grad(loss, z)[0]
        parts += float(loss)
    assert parts == pytest.approx(float(whole), rel=1e-6)
    torch.testing.assert_close(g_parts, g_whole)


def test_importance_correction_reweights_the_reverse_kl_advantage():
    """Async rollouts: tokens sampled by the generator (gen logprobs) are reweighted by min(pi_old / pi_gen, cap),
    as in the GRPO loss; the teacher's advantage is measured against pi_old."""
    z, zt, x, seq_ids = _sampled(n=8, seed=3)
    ls, lt = _lp(z, x), _lp(zt, x)
    old = ls.detach() + 0.05 * torch.randn(8)
    gen = ls.detach() - torch.linspace(-1, 1, 8)
    cfg = LossConfig(importance_correction="token", importance_cap=2.0, ratio_clip_low=10.0, ratio_clip_high=10.0)
    fn = DistillLossFn(cfg, DistillationConfig(teacher="t", kl_coef=1.0))
    loss, _ = fn(_inputs(ls, lt, torch.zeros(8), torch.ones(8), seq_ids, 8, gen=gen, old=old))
    w = torch.exp(old - gen).clamp(max=2.0)
    ref = -(w * torch.exp(ls - old) * (lt - old)).sum() / 8  # clip range wide: the plain IS-weighted PG
    assert float(loss) == pytest.approx(float(ref), rel=1e-6)


def test_advantages_without_teacher_are_refused():
    fn = DistillLossFn(LossConfig(), DistillationConfig(teacher="t"))
    lp = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="teacher's logprobs"):
        fn(_inputs(lp, None, torch.zeros(2), torch.ones(2), torch.zeros(2, dtype=torch.long), 2))
    adv = distill_advantages(torch.tensor([-1.0, float("inf")]), torch.tensor([-2.0, 0.0]), torch.tensor([1.0, 1.0]),
                             torch.tensor([1.0, 0.0]), kl_coef=2.0, reward_weight=0.5)
    assert adv.tolist() == [2.5, 0.0]


# ------------------------------------------------------------------------------------------------------------ top-k

def test_topk_over_the_whole_vocabulary_is_the_exact_reverse_kl():
    g = torch.Generator().manual_seed(4)
    z = torch.randn(3, 11, generator=g, dtype=torch.float64, requires_grad=True)
    q = torch.log_softmax(torch.randn(3, 11, generator=g, dtype=torch.float64) * 2, -1)
    ids = torch.argsort(q, -1, descending=True)  # every id, the teacher's order
    got = topk_reverse_kl(torch.log_softmax(z, -1).gather(-1, ids), q.gather(-1, ids))
    (g_got,) = torch.autograd.grad(got.sum(), z)
    p = torch.softmax(z, -1)
    want = (p * (torch.log_softmax(z, -1) - q)).sum(-1)
    (g_want,) = torch.autograd.grad(want.sum(), z)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(g_got, g_want, rtol=1e-9, atol=1e-10)


def test_topk_loss_is_the_kl_over_the_k_ids_and_the_tail():
    """k < vocabulary: the KL of two distributions over the k ids plus "any other id", written here from
    probabilities; the loss adds the reward's policy gradient and normalises by the step's tokens."""
    g = torch.Generator().manual_seed(5)
    n, vocab, k = 6, 13, 4
    z = torch.randn(n, vocab, generator=g, requires_grad=True)
    zt = torch.randn(n, vocab, generator=g) * 2
    x = torch.randint(vocab, (n,), generator=g)
    lt_full = torch.log_softmax(zt, -1)
    top = lt_full.topk(k, -1)
    seq_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    a_seq = torch.tensor([0.7, -0.2])[seq_ids]
    mask = torch.ones(n)
    ls_full = torch.log_softmax(z, -1)
    inp = _inputs(ls_full.gather(-1, x[:, None])[:, 0], None, a_seq, mask, seq_ids, 10)
    inp.student_topk_logprobs, inp.teacher_topk_logprobs = ls_full.gather(-1, top.indices), top.values
    fn = DistillLossFn(LossConfig(), DistillationConfig(teacher="t", kl_coef=0.4, reward_weight=0.5, topk=k))
    loss, metrics = fn(inp)
    (g_got,) = torch.autograd.grad(loss, z)

    z2 = z.detach().clone().requires_grad_(True)
    p = torch.softmax(z2, -1).gather(-1, top.indices)
    t = top.values.exp()
    tail_p, tail_t = 1 - p.sum(-1), 1 - t.sum(-1)
    kl = (p * (p.log() - t.log())).sum(-1) + tail_p * (tail_p.log() - tail_t.log())
    lx = torch.log_softmax(z2, -1).gather(-1, x[:, None])[:, 0]
    ref = (0.4 * kl.sum() - (0.5 * a_seq * torch.exp(lx - lx.detach())).sum()) / 10
    (g_want,) = torch.autograd.grad(ref, z2)
    assert float(loss) == pytest.approx(float(ref), rel=1e-5)
    assert float(metrics["reverse_kl"]) == pytest.approx(float(kl.sum() / 10), rel=1e-5)
    torch.testing.assert_close(g_got, g_want, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------------------------------ the config

def _cfg(overrides, **kw):
    from megatron_rl.config.loader import apply_overrides, from_dict, validate

    return validate(from_dict(apply_overrides({}, overrides)), check_model=False, **kw)


def test_defaults_live_in_the_schema_and_the_section_is_off_by_default():
    assert _cfg([]).distillation is None
    d = _cfg(["distillation.teacher=/some/teacher"]).distillation
    assert (d.tp, d.pp, d.kl_coef, d.reward_weight, d.topk) == (1, 1, 1.0, 0.0, 0)


@pytest.mark.parametrize("overrides,match", [
    (["distillation.tp=2"], r"distillation.teacher is required"),
    (["distillation.teacher=t", "distillation.tp=0"], r"distillation.tp must be >= 1"),
    (["distillation.teacher=t", "distillation.kl_coef=-1"], r"distillation.kl_coef must be >= 0"),
    (["distillation.teacher=t", "distillation.kl_coef=0"], r"distillation.kl_coef and distillation.reward_weight"),
    (["distillation.teacher=t", "distillation.topk=-1"], r"distillation.topk must be >= 0"),
    (["distillation.teacher=t", "grpo.loss.variant=gspo"], r"grpo.loss.variant=gspo"),
    (["distillation.teacher=t", "grpo.advantage.dynamic_sampling=true"], r"grpo.advantage.dynamic_sampling"),
    (["distillation.teacher=t", "distillation.tp=3"], r"distillation.tp\*pp = 3 does not divide"),
    (["distillation.teacher=t", "distillation.bogus=1"], r"unknown key 'distillation.bogus'"),
    (["distillation.teacher=t", "algorithm=sft", "data.path=x.jsonl"], r"runs with algorithm grpo"),
])
def test_invalid_sections_name_the_key(overrides, match):
    from megatron_rl.config.loader import ConfigError

    with pytest.raises(ConfigError, match=match):
        _cfg(overrides)


@pytest.mark.parametrize("topk", [0, 8])
def test_an_fsdp2_student_distils_from_a_megatron_teacher(topk):
    """policy.backend=fsdp2 takes a distillation section (both modes); the teacher's ranks stay megatron's."""
    from megatron_rl.config.distillation import teacher_policy_config

    cfg = _cfg(["distillation.teacher=/some/teacher", f"distillation.topk={topk}", "distillation.tp=2",
                "policy.backend=fsdp2", "policy.tp=2", "cluster.devices_per_node=2"])
    teacher = teacher_policy_config(cfg)
    assert cfg.policy.backend == "fsdp2" and cfg.distillation.topk == topk
    assert teacher.backend == "megatron" and teacher.model == "/some/teacher" and teacher.tp == 2


@pytest.mark.parametrize("device, want", [("cuda", "varlen"), ("cpu", "none")])
def test_an_fsdp2_students_teacher_packs_as_the_megatron_backend_does(device, want):
    """The fsdp2 student's resolved packing is none (its own rule); its megatron teacher takes megatron's `auto`, the
    platform's default (varlen on GPU: fused attention instead of an explicit [t, t] mask). A megatron student's
    packing, chosen or resolved, is the teacher's too."""
    from megatron_rl.config.distillation import teacher_policy_config
    from megatron_rl.platform import Platform

    platform = Platform(device, "nccl" if device == "cuda" else "gloo", torch.bfloat16, "torch", "shared_memory",
                        "collective", False)
    fsdp2 = _cfg(["distillation.teacher=/some/teacher", "policy.backend=fsdp2"])
    megatron = _cfg(["distillation.teacher=/some/teacher", "policy.packing=none"])
    assert fsdp2.policy.packing == "none"
    with mock.patch("megatron_rl.platform.get_platform", lambda: platform):
        assert teacher_policy_config(fsdp2).packing == want
        assert teacher_policy_config(megatron).packing == "none"  # the user's choice for a megatron model


def test_a_teacher_of_a_family_megatron_does_not_build_is_refused_naming_the_key(tmp_path):
    """An fsdp2 student may be OLMo-2; its teacher is built by megatron's model code, which refuses the family."""
    from megatron_rl.config.distillation import check_teacher_family
    from megatron_rl.config.loader import ConfigError

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Olmo2ForCausalLM"], "model_type": "olmo2"}))
    with pytest.raises(ConfigError, match=rf"distillation.teacher={tmp_path}: .*unsupported model.*megatron backend"):
        check_teacher_family(_cfg([f"distillation.teacher={tmp_path}", "policy.backend=fsdp2"]))


def test_zero_advantage_skip_is_off_under_distillation():
    from megatron_rl.algorithms.trainable import why_not_skippable

    assert why_not_skippable(_cfg([])) is None
    assert why_not_skippable(_cfg(["distillation.teacher=t"])) == "distillation"


def test_colocated_teacher_takes_a_third_of_each_bundle():
    from megatron_rl.distributed.parallel_dims import layout_of

    assert layout_of(_cfg([])).share == 0.5
    colo = layout_of(_cfg(["distillation.teacher=t"]))
    assert colo.share == colo.policy_share == 0.3333
    dis = layout_of(_cfg(["distillation.teacher=t", "cluster.colocated=false", "cluster.devices_per_node=2"]))
    assert dis.share == 1.0 and dis.policy_share == 0.5


def _tokenizer_copy(src, dst, swap=None):
    """The student's tokenizer folder, with two tokens' ids swapped in the copy when `swap` is given."""
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file() and (f.name.startswith("tokenizer") or f.name in ("special_tokens_map.json",
                                                                          "chat_template.jinja", "config.json")):
            shutil.copy(f, dst / f.name)
    if swap:
        tj = json.loads((dst / "tokenizer.json").read_text())
        vocab = tj["model"]["vocab"]
        a, b = list(vocab)[swap[0]], list(vocab)[swap[1]]  # two ordinary tokens (the specials come first)
        vocab[a], vocab[b] = vocab[b], vocab[a]
        (dst / "tokenizer.json").write_text(json.dumps(tj))
    return dst


def test_teacher_must_share_the_students_vocabulary(tmp_path):
    from megatron_rl.config.distillation import check_teacher_vocab
    from megatron_rl.config.loader import ConfigError
    from megatron_rl.data.tokenizer import load_tokenizer
    from megatron_rl.paths import default_model_dir

    src = default_model_dir()
    if not (src / "tokenizer.json").is_file():
        pytest.skip(f"{src} missing: run launch/setup_env.sh")
    student = load_tokenizer(src)
    same = _tokenizer_copy(src, tmp_path / "same")
    check_teacher_vocab(_cfg([f"distillation.teacher={same}"]), student)  # passes
    other = _tokenizer_copy(src, tmp_path / "other", swap=(1000, 1001))
    with pytest.raises(ConfigError) as e:
        check_teacher_vocab(_cfg([f"distillation.teacher={other}"]), student)
    msg = str(e.value)
    assert "\n" not in msg and f"distillation.teacher={other}" in msg and "policy.model=default" in msg
    assert "do not share a tokenizer vocabulary" in msg and "2 differ" in msg
