"""Ulysses sequence parallelism on the FSDP2 backend (policy.sp, policy/fsdp2_sp.py): at SP = 2, alone and with TP = 2
or DP = 2 (several rows, with fillers), at SP = 4 and SP 2 x TP 2 with KV heads replicated (fewer than SP ranks), on
one masked varlen row per micro-batch, on several and on dense group rows, one logprob pass and one training step give
the logprobs, loss, gradient norm and updated weights of SP = 1 and of the unpacked HF + torch AdamW reference, in fp32
to 1e-5; one rank per SP group sends results and exports."""
import pytest
import torch

from megatron_rl.distributed.launch import run_distributed
from megatron_rl.models.tiny import write_tiny_hf_model
from tests.distributed.policy_bodies import close_lists
from tests.distributed import sp_bodies

TWO = [n for n, (size, _, _) in sp_bodies.LAYOUTS.items() if size == 2]  # the GQA model only
FOUR = [n for n, (size, _, _) in sp_bodies.LAYOUTS.items() if size == 4]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {"gqa": str(write_tiny_hf_model(root / "gqa", "llama", seed=5)),
            "mha": str(write_tiny_hf_model(root / "mha", "llama", seed=5, config_overrides={"num_key_value_heads": 4}))}


@pytest.fixture(scope="module")
def two(models):
    return run_distributed(sp_bodies.sp_vs_reference, 2, args=({"gqa": models["gqa"]}, TWO), timeout=900)[0]


@pytest.fixture(scope="module")
def four(models):
    return run_distributed(sp_bodies.sp_vs_reference, 4, args=(models, FOUR), timeout=900)[0]


@pytest.mark.parametrize("name", [n for n in sp_bodies.LAYOUTS if n != "sp1_dp2"])
def test_sp_equals_reference(two, four, name):
    res = two if name in TWO else four
    r, ref = res[name], res[sp_bodies.LAYOUTS[name][1]]
    close_lists(r["logprobs"], ref["ref_lps"], 1e-5)
    close_lists([r["train_logprobs"][i] for i in range(ref["n"])], ref["ref_lps"], 1e-5)
    assert r["metrics"]["loss"] == pytest.approx(ref["ref_loss"], rel=1e-5, abs=1e-7)
    assert r["metrics"]["grad_norm"] == pytest.approx(ref["ref_norm"], rel=1e-5)
    assert r["after"] and set(r["after"]) <= set(ref["ref_state"])
    for k, v in r["after"].items():
        torch.testing.assert_close(v, ref["ref_state"][k], atol=2e-6, rtol=1e-5, msg=lambda s: f"{name} {k}: {s}")
    coords = r["coords"]
    assert all(c["impl"] == "megatron_rl_ulysses" for c in coords)
    sp = sp_bodies.LAYOUTS[name][2]["sp"]
    assert sorted(c["sp_rank"] for c in coords) == sorted(list(range(sp)) * (len(coords) // sp))
    assert r["senders"] == max(c["dp_rank"] for c in coords) + 1  # one sender per data-parallel replica
    if name == "sp2_split":
        assert all(len(c["rows"]) >= 2 for c in coords)
    if name == "sp2_dp2":  # uneven micro-batch counts over DP: the short replica's SP ranks run fillers together
        assert any(c["fillers"] for c in coords)
    if name == "sp2_dense":
        assert any(b > 1 for c in coords for b, _ in c["rows"])  # several rows of one micro-batch split together


def test_sp2_equals_sp1(two):
    a, b = two["sp2"], two["sp1_dp2"]
    close_lists(a["logprobs"], b["logprobs"], 1e-5)
    for key in ("loss", "grad_norm", "tokens"):
        assert a["metrics"][key] == pytest.approx(b["metrics"][key], rel=1e-5, abs=1e-7), key
    for k, v in a["after"].items():
        torch.testing.assert_close(v, b["after"][k], atol=1e-5, rtol=0, msg=lambda s: f"{k}: {s}")
