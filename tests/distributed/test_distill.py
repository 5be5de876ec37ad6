"""On-policy distillation on Megatron (docs/distillation.md): the frozen teacher's logprobs equal HF transformers' at
TP=2, PP=2 and on the unfused logits path, it takes its turn on the device (offloaded: refused; onloaded: the same
numbers); the student's distillation loss and gradient (grad norm, and the weights after one AdamW step) equal a
plain-torch reverse-KL reference on HF logits at DP=2 and TP=2; a megatron-rl checkpoint serves as a teacher at
another split. Top-k: the teacher's top-k over its TP-sharded vocabulary equals HF's torch.topk, and the student's
top-k + tail reverse-KL step equals a plain-torch one at DP=2, TP=2 and TP=2 unfused. Every student layout also runs
on the FSDP2 backend (DP=2, DTensor TP=2, and TP=2 unfused for top-k) against the same references, and its step equals
megatron's at the same split. One 2-process launch."""
import pytest
import torch

from megatron_rl.distributed.launch import run_distributed
from megatron_rl.models.tiny import write_tiny_hf_model
from tests.distributed import distill_bodies


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("distill")
    # another architecture and size than the student, the same 250-token vocabulary
    student = str(write_tiny_hf_model(root / "student", "qwen2", seed=3))
    teacher = str(write_tiny_hf_model(root / "teacher", "llama", seed=8))
    return run_distributed(distill_bodies.distill_suite, 2, args=(student, teacher, str(root / "ckpt")),
                           timeout=900)[0]


@pytest.mark.parametrize("layout", list(distill_bodies.TEACHER_LAYOUTS))
def test_teacher_logprobs_equal_hf(results, layout):
    r = results[f"teacher_{layout}"]
    for got, want in zip(r["logprobs"], results["ref_teacher"]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    assert r["frozen"] and not r["has_optimizer"]


def test_teacher_takes_its_turn_on_the_device(results):
    r = results["teacher_tp2"]
    offloaded, resident = r["states"]
    state, device_bytes, host_bytes = r["offloaded"]
    assert state == offloaded and device_bytes == 0 and host_bytes > 0
    assert r["refused"] is not None and "offloaded" in r["refused"]
    assert r["onloaded"][0] == resident and r["onloaded"][1] > 0
    for got, want in zip(r["after_onload"], r["logprobs"]):
        assert torch.equal(got, want)


@pytest.mark.parametrize("layout", list(distill_bodies.STUDENT_LAYOUTS))
def test_distill_loss_and_gradient_equal_plain_torch_reverse_kl(results, layout):
    r, ref = results[f"student_{layout}"], results["ref"]
    m = r["metrics"]
    assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert m["reverse_kl"] == pytest.approx(ref["reverse_kl"], rel=1e-5, abs=1e-7)  # the estimate alone
    after = r["after"]
    assert set(after) <= set(ref["state"])
    for k, v in after.items():
        torch.testing.assert_close(v, ref["state"][k], atol=2e-6, rtol=1e-5, msg=lambda s: f"{layout} {k}: {s}")


def test_checkpoint_teacher_at_another_split_equals_hf(results):
    for got, want in zip(results["ckpt_teacher"], results["ckpt_ref"]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # the checkpoint is the trained student, not the teacher it learned from
    assert max(float((a - b).abs().max()) for a, b in zip(results["ckpt_ref"], results["ref_teacher"])) > 1e-2


@pytest.mark.parametrize("layout", ["tp2", "tp2_unfused"])
def test_teacher_topk_equals_hf_topk(results, layout):
    """The k most likely ids over the whole (TP-sharded) vocabulary, and their whole-vocabulary logprobs."""
    ref_ids, ref_lps = results["ref_topk"]
    for (ids, lps), want_ids, want_lps in zip(results[f"topk_{layout}"], ref_ids, ref_lps):
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(lps, want_lps, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", list(distill_bodies.TOPK_STUDENT_LAYOUTS))
def test_topk_distill_loss_and_gradient_equal_plain_torch(results, layout):
    r, ref = results[f"topk_student_{layout}"], results["ref_topk_step"]
    m = r["metrics"]
    assert m["loss"] == pytest.approx(ref["loss"], rel=1e-5, abs=1e-7)
    assert m["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5)
    assert m["reverse_kl"] > 0
    for k, v in r["after"].items():
        torch.testing.assert_close(v, ref["state"][k], atol=2e-6, rtol=1e-5, msg=lambda s: f"{layout} {k}: {s}")


# (result key, its megatron counterpart): the FSDP2 student's step at each split against megatron's at the same split
FSDP2_PAIRS = [(f"{kind}_{name}", f"{kind}_{name[len('fsdp2_'):]}")
               for kind, layouts in (("student", distill_bodies.STUDENT_LAYOUTS),
                                     ("topk_student", distill_bodies.TOPK_STUDENT_LAYOUTS))
               for name in layouts if name.startswith("fsdp2_")]


@pytest.mark.parametrize("fsdp2,megatron", FSDP2_PAIRS, ids=[a for a, _ in FSDP2_PAIRS])
def test_fsdp2_student_step_equals_megatron(results, fsdp2, megatron):
    """The same distillation step on both policy backends: loss, reverse KL, grad norm and every weight after the
    AdamW step agree to fp32 rounding."""
    a, b = results[fsdp2], results[megatron]
    for key in ("loss", "reverse_kl", "grad_norm"):
        assert a["metrics"][key] == pytest.approx(b["metrics"][key], rel=1e-5, abs=1e-7), key
    assert set(a["after"]) == set(b["after"])
    for k, v in a["after"].items():
        torch.testing.assert_close(v, b["after"][k], atol=2e-6, rtol=1e-5, msg=lambda s: f"{fsdp2} {k}: {s}")
