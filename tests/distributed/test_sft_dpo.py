"""SFT and DPO on the Megatron policy worker at DP=2, TP=2, PP=2 equal independent references (HF transformers'
masked cross-entropy; the DPO paper's loss in plain torch on HF logits; torch AdamW), and packed (shared-prompt,
dense or varlen cascade) DPO equals unpacked to 1e-5 in fp32; the FSDP2 backend's SFT and DPO steps at DP=2 equal the
same references and the megatron backend's step. One launch for all layouts (sft_dpo_bodies.py)."""
import pytest
import torch

from megatron_rl.distributed.launch import run_distributed
from megatron_rl.models.tiny import write_tiny_hf_model
from tests.distributed import sft_dpo_bodies

SFT_LAYOUTS = ["dp2", "tp2", "pp2", "dp2_varlen_small_mb", "fsdp2_dp2"]
DPO_LAYOUTS = ["dp2", "tp2", "pp2", "dp2_small_mb", "dp2_unpacked", "dp2_varlen", "fsdp2_dp2"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    model = write_tiny_hf_model(root / "policy", "qwen2", seed=3)
    other = write_tiny_hf_model(root / "reference", "qwen2", seed=4)  # DPO's reference logprobs: h != 0
    return run_distributed(sft_dpo_bodies.sft_dpo_layouts, 2, args=(str(model), str(other)), timeout=900)[0]


def test_small_budgets_split_the_batch(results):
    # several micro-batches per DP rank: the global normalisation (and, for DPO, whole pairs) is what keeps the
    # small-budget layouts equal to the references below
    assert results[("sft", "dp2_varlen_small_mb")]["micro_batches"] > 1
    assert results[("dpo", "dp2_small_mb")]["micro_batches"] > 1
    assert results[("sft", "dp2")]["micro_batches"] == results[("dpo", "dp2")]["micro_batches"] == 1


def _weights_match(after, ref_state, what):
    assert set(after) <= set(ref_state) and len(after) >= len(ref_state) - 1, what  # tied lm_head: not exported
    for k, v in after.items():
        torch.testing.assert_close(v, ref_state[k], atol=2e-6, rtol=1e-5, msg=lambda s: f"{what} {k}: {s}")


@pytest.mark.parametrize("layout", SFT_LAYOUTS)
def test_sft_step_equals_hf_masked_cross_entropy(results, layout):
    loss, norm, state = results["sft_ref"]
    m = results[("sft", layout)]["metrics"]
    assert m["loss"] == pytest.approx(loss, rel=1e-5)
    assert m["grad_norm"] == pytest.approx(norm, rel=1e-5)
    _weights_match(results[("sft", layout)]["after"], state, f"sft {layout}")


@pytest.mark.parametrize("layout", DPO_LAYOUTS)
def test_dpo_step_equals_paper_formula_on_hf_logits(results, layout):
    loss, norm, state, lps = results["dpo_ref"]
    r = results[("dpo", layout)]
    m = r["metrics"]
    assert m["loss"] == pytest.approx(loss, rel=1e-5)
    assert m["grad_norm"] == pytest.approx(norm, rel=1e-5)
    _weights_match(r["after"], state, f"dpo {layout}")
    # the worker's reference pass is the frozen initial weights' (the HF model before the step)
    for got, want in zip(r["worker_ref"], results["init_lps"]):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # the metrics as TRL defines them, from the HF logprobs and the given reference
    beta = sft_dpo_bodies.DPO.beta
    chosen = [beta * float(lps[i].sum() - results["dpo_ref_in"][i].sum()) for i in range(0, len(lps), 2)]
    rejected = [beta * float(lps[i].sum() - results["dpo_ref_in"][i].sum()) for i in range(1, len(lps), 2)]
    pairs = len(chosen)
    # a reward is beta x a difference of two summed logprobs: each token may differ from HF's by fp32 rounding of
    # the logits (the 1e-5 the logprob checks allow; the fused head's blocked GEMM rounds in its own order)
    tol = beta * 1e-5 * max(len(x) for x in lps)
    assert m["rewards_chosen"] == pytest.approx(sum(chosen) / pairs, rel=1e-5, abs=tol)
    assert m["rewards_rejected"] == pytest.approx(sum(rejected) / pairs, rel=1e-5, abs=tol)
    assert m["rewards_accuracy"] == pytest.approx(sum(c > x for c, x in zip(chosen, rejected)) / pairs)
    assert m["logps_chosen"] == pytest.approx(sum(float(lps[i].sum()) for i in range(0, len(lps), 2)) / pairs,
                                              rel=1e-5)


def test_packed_dpo_equals_unpacked(results):
    packed, unpacked, varlen = (results[("dpo", k)] for k in ("dp2", "dp2_unpacked", "dp2_varlen"))
    # the layouts are what they claim: a pair's prompt computed once (dense block mask / varlen cascade) vs twice
    assert packed["shared_prefix"] and not packed["varlen"]
    assert not unpacked["shared_prefix"] and varlen["shared_prefix"] and varlen["varlen"]
    for other in (packed, varlen):
        for k in ("loss", "grad_norm"):
            assert other["metrics"][k] == pytest.approx(unpacked["metrics"][k], rel=1e-5), k
        # differences of ~50-nat fp32 sums: equal to 1e-5 absolute (fp32 rounding of the sums is ~1e-6)
        for k in ("rewards_chosen", "rewards_rejected", "rewards_margin", "logps_chosen", "logps_rejected"):
            assert other["metrics"][k] == pytest.approx(unpacked["metrics"][k], rel=0, abs=1e-5), k
        for k, v in unpacked["after"].items():
            torch.testing.assert_close(other["after"][k], v, atol=1e-5, rtol=0)


@pytest.mark.parametrize("algo", ["sft", "dpo"])
def test_fsdp2_step_equals_megatron_step(results, algo):
    # the two backends side by side on the same batch (each is also checked against the HF reference above)
    fsdp2, meg = results[(algo, "fsdp2_dp2")], results[(algo, "dp2")]
    for k in ("loss", "grad_norm"):
        assert fsdp2["metrics"][k] == pytest.approx(meg["metrics"][k], rel=1e-5), k
    assert set(fsdp2["after"]) == set(meg["after"])
    for k, v in meg["after"].items():
        torch.testing.assert_close(fsdp2["after"][k], v, atol=1e-5, rtol=0, msg=lambda s: f"{algo} {k}: {s}")
    if algo == "dpo":  # the reference pass: both backends' frozen initial weights
        for got, want in zip(fsdp2["worker_ref"], meg["worker_ref"]):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
