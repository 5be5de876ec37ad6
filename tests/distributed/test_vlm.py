"""The FSDP2 backend trains a vision-language model (a tiny Idefics3 / SmolVLM-class one, models/tiny_vlm.py) with
each prompt's images as model inputs: at DP = 2, with micro-batches of several rows (one without images, rows with
one and two images of different sizes), the logprobs equal transformers' forward of each sequence with its images,
and one step equals plain torch AdamW on transformers' model (the vision tower and connector train too). One
2-process launch (vlm_bodies.vlm_agree) serves every test here."""
import pytest
import torch

from megatron_rl.distributed.launch import run_distributed
from megatron_rl.models.tiny_vlm import write_tiny_vlm
from tests.distributed import vlm_bodies


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    model_dir = str(write_tiny_vlm(tmp_path_factory.mktemp("vlm") / "tiny_vlm", seed=1))
    batch = vlm_bodies.vlm_batch(model_dir)
    return run_distributed(vlm_bodies.vlm_agree, 2, args=(model_dir, batch, 64), timeout=600)[0]


def test_micro_batches_carry_their_rows_images(result):
    shapes = [s for rank in result["shapes"] for s in rank]
    assert any(shape[0] > 1 for shape, _ in shapes)  # several rows in one micro-batch
    assert all(keys in ([], ["pixel_attention_mask", "pixel_values"]) for _, keys in shapes)
    # the text-only row alone in a micro-batch: its rank's vision tower gets no gradient from it, yet must take part
    # in FSDP's gradient reduction (fsdp2_scorer.Scorer's zero term), or the other rank's collective hangs
    assert any(keys == [] for _, keys in shapes)


def test_logprobs_equal_transformers_forward_with_the_images(result):
    for i, (got, want) in enumerate(zip(result["logprobs"], result["hf"]["logprobs"])):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0, msg=lambda s: f"sequence {i}: {s}")


def test_one_step_equals_torch_adamw_on_transformers_model(result):
    hf, m = result["hf"], result["metrics"]
    assert m["loss"] == pytest.approx(hf["loss"], rel=1e-5, abs=1e-7)
    assert m["grad_norm"] == pytest.approx(hf["grad_norm"], rel=1e-5)
    assert hf["vision_grad_sq"] > 0  # the images reach the loss: the vision tower has a gradient
    assert set(result["after"]) == set(hf["after"])
    for k, v in result["after"].items():
        torch.testing.assert_close(v, hf["after"][k], atol=1e-5, rtol=1e-5, msg=lambda s: f"{k}: {s}")
